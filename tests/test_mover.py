"""Where a run's move into its cgroup is made (confine/mover.py): on the worker until a move
after a pause shows this kernel moves at once, then at once; back to the worker when a lone
move waits again."""
import threading

import pytest

from cudawrap.confine.mover import FAST_S, LONE_GAP_S, Mover


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def where(mover: Mover) -> str:
    """The thread SUBMIT ran its function on."""
    return mover.submit(lambda: threading.current_thread().name).result(timeout=10)


def moved(mover: Mover, clock: Clock, after: float, taking: float) -> None:
    clock.now += after

    def write() -> None:
        clock.now += taking

    mover.move(write)


def test_the_worker_first_then_at_once_after_a_fast_lone_move() -> None:
    clock = Clock()
    mover = Mover(clock)
    try:
        assert where(mover).startswith("cudawrap-confine")  # nothing known yet: the worker
        moved(mover, clock, after=LONE_GAP_S * 1.1, taking=FAST_S / 10)
        assert where(mover) == threading.current_thread().name
    finally:
        mover.worker.shutdown()


def test_a_slow_lone_move_sends_the_next_to_the_worker_and_a_slow_one_in_a_row_does_not() -> None:
    clock = Clock()
    mover = Mover(clock)
    try:
        moved(mover, clock, after=1.0, taking=FAST_S / 10)
        assert mover.at_once
        moved(mover, clock, after=LONE_GAP_S / 10, taking=FAST_S * 5)  # in a row: says nothing
        assert mover.at_once
        moved(mover, clock, after=LONE_GAP_S * 1.1, taking=FAST_S * 5)  # alone and slow: an RCU wait
        assert not mover.at_once and where(mover).startswith("cudawrap-confine")
        moved(mover, clock, after=LONE_GAP_S / 10, taking=FAST_S / 10)  # fast in a row: not enough
        assert not mover.at_once
        moved(mover, clock, after=LONE_GAP_S * 1.1, taking=FAST_S / 10)
        assert mover.at_once
    finally:
        mover.worker.shutdown()


@pytest.mark.parametrize("at_once", [False, True])
def test_a_failure_comes_back_in_the_future_either_way(at_once: bool) -> None:
    mover = Mover(Clock())
    mover.at_once = at_once
    try:
        def fail() -> None:
            raise OSError(3, "No such process")

        with pytest.raises(OSError, match="No such process"):
            mover.submit(fail).result(timeout=10)
    finally:
        mover.worker.shutdown()
