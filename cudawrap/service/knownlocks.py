"""The leases' locks as the service knows them, without reading /proc/locks.

That read costs 8-18 ms whenever nothing read the table a moment before (the kernel waits
out an RCU grace period), and a hand-over is that cold read: a turnover of one-second jobs
paid it at every grant. Where the service can know the table otherwise (a lone run asking,
or every held lease one it granted), it tries the locks itself (microseconds for 56).

Apart from waitline.py (the line and its decisions) because it is one question, how the
leases are held now, answered the cheap way where that is the whole answer; FREE is the
line's own try of a lease's lock (Line._free, which believes a lease found free while the
file watch reports nothing of it).
"""
from __future__ import annotations

import time
from typing import Callable, Collection, Dict, List, Optional, Tuple

from ..lease.files import LeaseFiles
from ..sched.queue import Scan
from ..sched.tally import UNNAMED_HOLDER

Claimed = Dict[str, List[Tuple[int, bool]]]  # uuid -> (client pid, exclusive) of each grant sent, not confirmed
Free = Callable[[str, float], bool]  # whether a lease (a device of one slot) is free now


def probed(leases: LeaseFiles, present: Collection[str], claimed: Claimed, free: Free) -> Scan:
    """The leases PRESENT as trying each one's lock says (held or not).

    The holders stay unnamed, which only limits and turns (see Line._alone) would need. A
    lease sent and not yet confirmed (CLAIMED) is not tried: held, as decide() counts it,
    and our try could meet its client taking it (its lock is taken without waiting)."""
    table = {}
    now = time.monotonic()
    for uuid, ident in leases.idents(present).items():
        if uuid in claimed:
            continue
        if ident is not None and not free(uuid, now):
            table[ident] = [UNNAMED_HOLDER]
    return Scan([], table, {})


def known_locks(leases: LeaseFiles, present: Collection[str], slots_of: Dict[str, int],
                granted: Dict[str, int], claimed: Claimed, free: Free) -> Optional[Scan]:
    """The lock table of the leases PRESENT (SLOTS_OF: uuid -> its slots) where the service
    knows it all, the queue directory being empty: each held lease is one the service
    granted (GRANTED names its client), the rest free (trying their locks says so). None
    where that is not all: a lease held by a run that decided for itself (its holder only
    the kernel's table names), a shared device in use (its sharers and slots likewise). A
    lease sent and not yet confirmed (CLAIMED) is its client's: decide() counts it held."""
    table = {}
    now = time.monotonic()
    for uuid, ident in leases.idents(present).items():
        if ident is None:
            continue
        slots = slots_of.get(uuid, 1)
        if uuid in claimed:
            if slots > 1:
                return None  # a share being taken: its device's other sharers only the table names
            continue  # sent, not yet confirmed: held (decide() counts it), and not tried (see probed)
        if slots > 1:
            if not (leases.free_now(uuid) and all(leases.slot_free(uuid, k) for k in range(1, slots + 1))):
                return None
            continue
        if free(uuid, now):
            continue
        if uuid in granted:
            table[ident] = [(granted[uuid], True)]
        else:
            return None
    return Scan([], table, {})
