"""What the run path's modules share: one decision as observers see it, and the few facts
of the line that the taking (acquirer.py), the waiting (waiting.py) and the hand-over
(handover.py) all use. It imports none of them, so they import it without a circle."""
from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Iterable, List

    from .terms import Verdict

from ..errors import NoDeviceError

# The first WATCHERS in line watch the machine (see waiting.py).
WATCHERS = 8
# In an amended lock table: a lease found held whose holder the look cannot name (pid -1:
# no process, so it counts for no waiting user).
UNKNOWN_HOLDER = (-1, True)


class Cancelled(NoDeviceError):
    pass


def jitter() -> None:
    """A lost race for a lock: pause a random moment before deciding again, so that two
    runs that backed off together (two users' shares under MPS) do not collide again."""
    import random  # only after a lost race

    time.sleep(random.uniform(0, 0.02))


class Decision:
    """One decision as an observer sees it: what led to it (CAUSE: ARRIVAL, a run deciding
    before it queues; LOOK, a full look while waiting; RELEASE, a look amended by the leases
    RELEASED since), the VERDICTS for every waiter, the FREE devices, KEY the deciding run's
    entry (ARRIVAL: a key sorting after every real one) and SKIPPED the entries it passes over."""

    ARRIVAL, LOOK, RELEASE = "arrival", "look", "release"
    __slots__ = ("cause", "key", "verdicts", "free", "skipped", "released")

    def __init__(self, cause: str, key: str, verdicts: Dict[str, Verdict], free: List[str],
                 skipped: Iterable[str], released: Iterable[str] = ()) -> None:
        self.cause = cause
        self.key = key
        self.verdicts = verdicts
        self.free = free
        self.skipped = sorted(skipped)
        self.released = sorted(released)


def trace(d: Decision) -> None:
    """CUDAWRAP_DEBUG's observer: each decision while waiting on stderr (the arrival's
    verdict is what the run reports as it queues)."""
    if d.cause == Decision.RELEASE:
        verdict = d.verdicts[d.key]
        os.write(2, f"cudawrap[{os.getpid()}]: released {d.released} at {time.time():.3f}: {verdict.kind} "
                    f"{','.join(verdict.devices)} (free={d.free})\n".encode())
    elif d.cause == Decision.LOOK:
        os.write(2, (f"cudawrap[{os.getpid()}]: decision at {time.time():.3f}: free={d.free} skipped="
                     f"{d.skipped} " + "; ".join(
                         f"{k.split('.')[1]}:{v.kind}:{','.join(v.devices)}"
                         for k, v in sorted(d.verdicts.items(), key=lambda kv: kv[1].position))
                     + "\n").encode())
