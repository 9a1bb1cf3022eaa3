"""A run's way to its devices: taken at once when its turn is now (acquirer.py), else
waited for in the queue (waiting.py, imported only then: a launch nobody waits before
never loads the waiting machinery). The launch calls Acquirer.arrive() itself and comes
here only to wait (wait_in_line), so a run served at once does not load even this module."""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Callable, Optional

    from ..lease.files import Lease

from .acquirer import Acquirer, Queued


def acquire(acquirer: Acquirer, wait_s: float, info: bytes,
            on_wait: Optional[Callable[[str], None]] = None) -> Lease:
    """ACQUIRER's devices within WAIT_S seconds (inf: as long as it takes), in fair turns.
    INFO is written into its queue entry; ON_WAIT is told why it waits."""
    arrived = acquirer.arrive(wait_s, info)
    if not isinstance(arrived, Queued):
        return arrived
    return wait_in_line(acquirer, arrived, on_wait)


def wait_in_line(acquirer: Acquirer, queued: Queued, on_wait: Optional[Callable[[str], None]] = None) -> Lease:
    """The devices of a run that ACQUIRER.arrive() put in line (QUEUED), once its turn comes."""
    from .waiting import Waiting

    return Waiting(acquirer, queued.entry, queued.deadline, queued.wait_s, on_wait, queued.verdict,
                   queued.ahead).run()
