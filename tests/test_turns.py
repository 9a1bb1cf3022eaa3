"""When a run offered devices ignores its turn (sched/turns.py): the rule alone, then the
kernel's word on real processes: one asleep, one runnable and busy, one stopped."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from cudawrap.base.proc import busy_ns, state
from cudawrap.sched.turns import BUSY_S, GRACE_S, LONGEST_S, OWN_GRACE_S, RECHECK_S, Offers, ignores
from support.procs import Spawned, wait_for


@pytest.mark.parametrize("elapsed, busy, grace, out", [
    (0.4, 0.0, GRACE_S, False),          # within the grace, whatever it did
    (0.6, 0.0, GRACE_S, True),           # asleep all along: a fake, or blocked
    (0.6, None, GRACE_S, True),          # the kernel does not say: the clock decides
    (0.6, 0.55, GRACE_S, False),         # runnable or running nearly all along: a loaded machine
    (3.0, 2.4, GRACE_S, True),           # asleep 0.6 s of it
    (2.0, BUSY_S, GRACE_S, True),        # busy a whole second and still not taken: spinning
    (LONGEST_S, LONGEST_S - 0.1, GRACE_S, True),  # nobody waits longer than this
    (2.9, 0.0, OWN_GRACE_S, False),      # one's own run is given longer
    (3.1, 0.0, OWN_GRACE_S, True),
])
def test_the_rule(elapsed, busy, grace, out) -> None:  # type: ignore[no-untyped-def]
    assert ignores(elapsed, busy, grace) is out


def _proc(spawned: Spawned, code: str) -> subprocess.Popen:
    p = spawned([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline() == b"up\n"
    return p


def test_the_kernel_tells_a_sleeper_from_a_busy_run_and_a_stopped_one(spawned: Spawned) -> None:
    if busy_ns(os.getpid()) is None:
        pytest.fail("/proc/PID/schedstat unreadable: this kernel cannot tell a slow run from an idle one")
    sleeper = _proc(spawned, "import time; print('up', flush=True); time.sleep(60)")
    spinner = _proc(spawned, "print('up', flush=True)\nwhile True: pass")
    stopped = _proc(spawned, "import time; print('up', flush=True); time.sleep(60)")
    os.kill(stopped.pid, signal.SIGSTOP)
    wait_for(lambda: state(stopped.pid) == b"T")  # the signal is delivered, not yet acted on
    offers = Offers()
    now = time.monotonic()
    for key, p in (("s", sleeper), ("b", spinner), ("t", stopped)):
        assert offers.offer(key, p.pid, now, own=False)
        assert not offers.offer(key, p.pid, now, own=False)  # offered once
    assert offers.ignored("t", now)  # stopped: at once
    assert not offers.ignored("s", now) and not offers.ignored("b", now)
    time.sleep(GRACE_S + 0.2)
    later = time.monotonic()
    assert offers.ignored("s", later)
    assert not offers.ignored("b", later)  # ran or stood runnable all along
    assert offers.due(later) == pytest.approx(later + RECHECK_S)
    offers.keep({"b"})
    assert list(offers.since) == ["b"]
    time.sleep(BUSY_S)
    assert offers.ignored("b", time.monotonic())  # busy a second without taking: passed over
