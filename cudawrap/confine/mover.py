"""Where a run's move into its cgroup is made: at once on the service's loop, where this
kernel moves a process at once, else on a worker thread while the run is decided on.

A move (a write to cgroup.procs) takes cgroup_threadgroup_rwsem for writing, which on a kernel
of 6.0 or newer without favordynmods can first wait for an RCU grace period: ~10 ms measured
on one 6.18 VM for a move after a pause, where the service's loop must not wait. Where moves
are made at once (favordynmods, a kernel before 6.0, or one whose grace periods are short:
0.06 ms on another 6.18 VM), the hand-off to the worker and back is what a launch waits for
instead (~0.5 ms on a 2-core VM: waking the thread, then the loop, and the GIL between them).
Which one this kernel is, the moves say: a move after a pause (LONE_GAP_S since the last one:
the rwsem's fast mode had time to come back) that took under FAST_S means the next is made at
once; one that did not sends the next ones to the worker until a lone move is fast again.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

LONE_GAP_S = 0.05  # a move this long after the last one is alone (a grace period is ~ms)
FAST_S = 0.001  # a lone move under this: the kernel did not wait


class Mover:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="cudawrap-confine")
        self.last = float("-inf")  # when the last move ended (time.monotonic)
        self.at_once = False  # lone moves are fast here: no worker for the next

    def submit(self, fn: Callable[..., Any], *args: Any) -> "Future[Any]":
        """FN(*ARGS), which makes a move (timed by ``move``): at once where moves are, else on
        the worker; its outcome in a Future either way."""
        if not self.at_once:
            return self.worker.submit(fn, *args)
        done: "Future[Any]" = Future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:  # as the worker's Future would carry it
            done.set_exception(exc)
        return done

    def move(self, write: Callable[[], None]) -> None:
        """WRITE (the move itself), timed: whether the next one is made at once."""
        start = self.clock()
        try:
            write()
        finally:
            end = self.clock()
            if start - self.last >= LONE_GAP_S:
                self.at_once = end - start < FAST_S
            self.last = end
