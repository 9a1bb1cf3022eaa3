"""Whether a run offered devices is ignoring its turn, or only slow to take it.

A waiter given devices by the rule (schedule.decide) must take them; one that does not
(stopped, blocked, a hand-made queue entry whose process just sleeps) is passed over by the
others for STALL_S. Wall-clock time alone cannot tell such a run from one that is waiting
for a CPU on a loaded machine: both leave the grant untaken for as long. The kernel can:
/proc/PID/schedstat counts the time a process ran or stood runnable in a run queue. A run
that was woken for its turn is busy or runnable until it has taken it; one that ignores it
sleeps. So a run is passed over once it has *slept* GRACE_S since the offer, or has spent
BUSY_S busy without taking it (a spinning fake), or LONGEST_S has gone by whatever it did.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Optional, Tuple

from ..base.proc import busy_ns, state

# A run given devices that has not taken them after this long asleep loses its turn.
GRACE_S = 0.5
# Within one user only arrival order is at stake: a slow run of one's own is given longer.
OWN_GRACE_S = 3.0
# A real waiter takes a grant in milliseconds of CPU: one that spends this long busy without
# taking it is not going to.
BUSY_S = 1.0
# Whatever the kernel says, nobody keeps a grant untaken longer than this.
LONGEST_S = 10.0
# Being passed over lasts this long, for the entry and (another user's) its user.
STALL_S = 5.0
# Past its grace, a run still busy is looked at again this often.
RECHECK_S = 0.1


def ignores(elapsed: float, busy: Optional[float], grace: float) -> bool:
    """Whether a run offered devices ELAPSED seconds ago, BUSY seconds of which it spent
    running or runnable (None: unknown), ignores its turn. Pure: the rule, testable alone."""
    if elapsed < grace:
        return False
    if busy is None:
        return True  # the kernel does not say: wall-clock time is all there is
    return elapsed - busy >= grace or busy >= BUSY_S or elapsed >= LONGEST_S


def _stopped(pid: int) -> bool:
    """Whether PID is stopped (SIGSTOP, a debugger): it cannot take its turn now."""
    return state(pid) in (b"T", b"t")


class Offers:
    """The runs this process saw offered devices and not yet taking them."""

    def __init__(self) -> None:
        # key -> (when offered, its pid, its busy ns then, its grace)
        self.since: Dict[str, Tuple[float, int, Optional[int], float]] = {}

    def __bool__(self) -> bool:
        return bool(self.since)

    def keep(self, live) -> None:  # type: ignore[no-untyped-def]
        """Forget every offer but those to the keys in LIVE (granted again just now)."""
        for key in [k for k in self.since if k not in live]:
            del self.since[key]

    def offer(self, key: str, pid: int, now: float, own: bool) -> bool:
        """Note KEY (the run PID; OWN: of our own user) offered devices; True when newly offered."""
        if key in self.since:
            return False
        self.since[key] = (now, pid, busy_ns(pid), OWN_GRACE_S if own else GRACE_S)
        return True

    def ignored(self, key: str, now: float) -> bool:
        """Whether KEY, offered devices, ignores its turn now."""
        when, pid, before, grace = self.since[key]
        if _stopped(pid):
            return True
        after = busy_ns(pid) if before is not None else None
        busy = None if after is None or before is None else max(0, after - before) / 1e9
        return ignores(now - when, busy, grace)

    def drop(self, key: str) -> None:
        self.since.pop(key, None)

    def due(self, now: float) -> float:
        """When the next offer should be judged again (a wait's timeout ends by then)."""
        return min(max(when + grace, now + RECHECK_S) for when, _pid, _b, grace in self.since.values())
