"""`cudawrap cancel`: a user cancels their own waiting runs, root anyone's; nobody cancels others'
or a run that already holds a device. Real accounts (run as root; skipped otherwise)."""
from __future__ import annotations

import signal
import subprocess

import pytest

from corefix import ready_line
from test_multiuser import one_line, waiting_line
from userfix import MuInstall, User, root_only

pytestmark = [pytest.mark.root, root_only]


def fill(inst: MuInstall, user: User, n: int = 4) -> list:
    """N runs holding every device of the machine, so the next run waits."""
    jobs = [inst.start(user, "recon", "--hold", "120") for _ in range(n)]
    for job in jobs:
        ready_line(job)
    return jobs


def waiter(inst: MuInstall, user: User) -> subprocess.Popen:
    proc = inst.start(user, "recon", "--hold", "1")
    waiting_line(proc)
    return proc


def ended_by_cancel(proc: subprocess.Popen) -> bool:
    """Cancelled: 75 with the waiter's "cancelled by" line once the wait loop watches for it
    (cancel.CancelWatch); until then the signal's default action ends it."""
    code = proc.wait(timeout=20)
    return code in (75, -signal.SIGUSR1)


def test_cancel_own_run_anyones_as_root_and_never_someone_elses(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    holders = fill(inst, alice)
    mine = waiter(inst, alice)
    theirs = waiter(inst, bob)

    # Bob may not cancel Alice's run: 77, one line, and it keeps waiting.
    done = inst.cli(bob, "cancel", str(mine.pid))
    assert done.returncode == 77, done.stderr
    assert "only cwtest1 or root" in one_line(done)
    # All or none: with one of the pids refused, his own is not cancelled either.
    done = inst.cli(bob, "cancel", str(theirs.pid), str(mine.pid))
    assert done.returncode == 77
    assert mine.poll() is None and theirs.poll() is None

    # A run that holds a device is a running program: refused, with the hint to signal it.
    done = inst.cli(alice, "cancel", str(holders[0].pid))
    assert done.returncode == 65, done.stderr
    assert "running program" in one_line(done) and f"kill {holders[0].pid}" in done.stderr.decode()
    assert holders[0].poll() is None

    # Unknown and malformed pids.
    done = inst.cli(alice, "cancel", "999999999")
    assert done.returncode == 65 and "no such process" in one_line(done)
    for bad in ("abc", "0", "12x", "1" * 30):
        done = inst.cli(alice, "cancel", bad)
        assert done.returncode == 64, (bad, done.stderr)
        assert "not a process id" in one_line(done)
    done = inst.cli(alice, "cancel")
    assert done.returncode == 64 and "no PID given" in one_line(done)
    # A process that is not waiting (bob's shell-less sleeper) is not a waiting run.
    idle = inst.start(alice, "sleep", "60")
    done = inst.cli(alice, "cancel", str(idle.pid))
    assert done.returncode == 65 and "not in the wait queue" in one_line(done)

    # Alice cancels her own; root cancels Bob's.
    done = inst.cli(alice, "cancel", str(mine.pid))
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == f"cancelled pid {mine.pid} (cwtest1)\n"
    assert ended_by_cancel(mine)
    done = inst.cli(None, "cancel", str(theirs.pid))
    assert done.returncode == 0, done.stderr
    assert ended_by_cancel(theirs)
    assert all(h.poll() is None for h in holders)  # nobody else was touched


CANCEL_WATCH = r"""
import os, sys, time
sys.path[:0] = sys.argv[1:]
from cudawrap.cancel import CancelWatch
CancelWatch("recon").start()
print(os.getpid(), flush=True)
time.sleep(60)
"""

GRANTED = r"""
import os, signal, sys, time
sys.path[:0] = sys.argv[1:]
from cudawrap.cancel import CancelWatch
watch = CancelWatch("recon").start()
watch.stop()  # granted: SIGUSR1 is the program's own again
assert signal.SIGUSR1 not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
print("granted", flush=True)
time.sleep(60)
"""


def test_the_waiter_side_names_who_cancelled_it(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice = inst.world.alice
    # By the owner, from another process of hers.
    proc = inst.py_start(alice, CANCEL_WATCH, *inst.world.path)
    pid = int(proc.stdout.readline())
    assert inst.py(alice, f"import os, signal; os.kill({pid}, signal.SIGUSR1)").returncode == 0
    assert proc.wait(timeout=10) == 75
    assert proc.stderr.read().decode() == "recon: cancelled by cwtest1\n"
    # By root.
    proc = inst.py_start(alice, CANCEL_WATCH, *inst.world.path)
    pid = int(proc.stdout.readline())
    import os

    os.kill(pid, signal.SIGUSR1)
    assert proc.wait(timeout=10) == 75
    assert proc.stderr.read().decode() == "recon: cancelled by root\n"
    # Once granted, the watch is gone and the signal is the program's again.
    proc = inst.py_start(alice, GRANTED, *inst.world.path)
    assert proc.stdout.readline() == b"granted\n", proc.stderr.read()
    os.kill(proc.pid, signal.SIGUSR1)
    assert proc.wait(timeout=10) == -signal.SIGUSR1
