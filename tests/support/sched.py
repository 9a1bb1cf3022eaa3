"""A Waiter from the arguments the scheduler's tests think in (its request's fields inline)."""
from __future__ import annotations

from typing import FrozenSet, Optional

from cudawrap.sched.request import Request
from cudawrap.sched.schedule import Waiter


def make_waiter(key: str, uid: int, pid: int, count: int, candidates: Optional[FrozenSet[str]],
                placement: str = "spread", reserve_after: float = 300.0, arrival: float = 0.0, program: str = "?",
                min_free_mib: int = 0, max_util: int = 100, share: bool = False) -> Waiter:
    return Waiter(key, uid, pid, Request(count, candidates, placement, reserve_after, min_free_mib, max_util, share),
                  arrival, program)
