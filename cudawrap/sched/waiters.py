"""Who waits for a device now, one entry per process with every queue entry it holds: the
queue as the scheduler sees it (WaitQueue.scan, beyond the per-user bound too). `cudawrap
cancel` picks the runs it ends among them, and the ledger's look counts them.
"""
from __future__ import annotations

TYPE_CHECKING = False  # as in cancel.py, which imports it: no typing at run time
if TYPE_CHECKING:
    from typing import Dict, List, Sequence


class Waiter:
    __slots__ = ("pid", "uid", "key", "paths")

    def __init__(self, pid: int, uid: int, key: str, paths: Sequence[str] = ()) -> None:
        self.pid = pid  # the kernel's record of who holds the entry's lock
        self.uid = uid  # the entry's owner, who also owns that pid
        self.key = key  # its place in the queue (its first entry's)
        self.paths = list(paths)  # its entries: one, unless made by hand


def waiters(root: str) -> List[Waiter]:
    """The runs waiting for a device now, as the scheduler sees them (waitqueue.WaitQueue.scan),
    one per process, with every entry it holds (beyond the per-user bound too)."""
    from .. import locations as loc
    from ..errors import SetupError
    from .queue import WaitQueue

    try:
        queue = WaitQueue(loc.under(root, loc.QUEUE_DIR))
    except SetupError:  # no queue directory: nobody can be waiting
        return []
    scan = queue.scan(clean=False, bounded=False)
    out: Dict[int, Waiter] = {}
    for w in scan.waiters:
        out.setdefault(w.pid, Waiter(w.pid, w.uid, w.key)).paths.append(scan.paths[w.key])
    return list(out.values())
