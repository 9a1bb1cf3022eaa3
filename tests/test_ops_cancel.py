"""`cudawrap cancel`: a user cancels their own waiting runs, root anyone's; nobody cancels others'
or a run that already holds a device. Real accounts (run as root; skipped otherwise)."""
from __future__ import annotations

import subprocess

import pytest

from support.installed import ready_line, waiting_line
from support.procs import one_line, root_only
from support.users import MuInstall, User

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


def ended_by_cancel(proc: subprocess.Popen, by: str) -> bool:
    """Cancelled: 75, and the waiter's last line names who cancelled it."""
    code = proc.wait(timeout=20)
    last = proc.stderr.read().decode().splitlines()[-1]
    return code == 75 and last == f"recon: cancelled by {by}"


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
    assert "only cwtest1 or root" in one_line(done, hint=True)
    # Root's run: root is named once, not "only root or root".
    roots = waiter(inst, None)
    done = inst.cli(bob, "cancel", str(roots.pid))
    assert done.returncode == 77 and one_line(done, hint=True).endswith("'s run; only root may cancel it"), done.stderr
    roots.kill()
    # All or none: with one of the pids refused, his own is not cancelled either.
    done = inst.cli(bob, "cancel", str(theirs.pid), str(mine.pid))
    assert done.returncode == 77
    assert mine.poll() is None and theirs.poll() is None

    # A run that holds a device is a running program: refused, with the hint to signal it.
    done = inst.cli(alice, "cancel", str(holders[0].pid))
    assert done.returncode == 65, done.stderr
    assert "running program" in one_line(done, hint=True) and f"kill {holders[0].pid}" in done.stderr.decode()
    assert holders[0].poll() is None

    # Unknown and malformed pids.
    done = inst.cli(alice, "cancel", "999999999")
    assert done.returncode == 65 and "no such process" in one_line(done, hint=True)
    for bad in ("abc", "0", "12x", "1" * 30):
        done = inst.cli(alice, "cancel", bad)
        assert done.returncode == 64, (bad, done.stderr)
        assert "not a process id" in one_line(done, hint=True)
    done = inst.cli(alice, "cancel")
    assert done.returncode == 64 and "no PID given" in one_line(done, hint=True)
    # A process that is not waiting (bob's shell-less sleeper) is not a waiting run.
    idle = inst.start(alice, "sleep", "60")
    done = inst.cli(alice, "cancel", str(idle.pid))
    assert done.returncode == 65 and "not in the wait queue" in one_line(done, hint=True)

    # Alice cancels her own; root cancels Bob's.
    done = inst.cli(alice, "cancel", str(mine.pid))
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == f"cancelled pid {mine.pid} (cwtest1)\n"
    assert ended_by_cancel(mine, alice.name)
    done = inst.cli(None, "cancel", str(theirs.pid))
    assert done.returncode == 0, done.stderr
    assert ended_by_cancel(theirs, "root")
    assert all(h.poll() is None for h in holders)  # nobody else was touched


def test_cancelling_a_hand_made_entry_takes_it_out_of_everyones_decisions(mu) -> None:  # type: ignore[no-untyped-def]
    """Entries made and locked by hand never read their cancel line: cancelled, they are
    removed, every one the process holds, so nobody counts them any more."""
    from test_fairness import forge

    inst = mu("four-gpus")
    alice = inst.world.alice
    inst.wrap("recon")
    forged = forge(inst, alice, "1sa", "300", n=3)
    assert [w["pid"] for w in inst.status(None)["waiting"]] == [forged.pid] * 3
    done = inst.cli(None, "cancel", str(forged.pid))
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == f"cancelled pid {forged.pid} ({alice.name})\n"
    assert forged.poll() is None  # still holding its locks, but no longer in the queue
    assert inst.status(None)["waiting"] == [] and list(inst.layout.queue_dir.iterdir()) == []
    done = inst.cli(None, "cancel", str(forged.pid))
    assert done.returncode == 65 and "not in the wait queue" in one_line(done, hint=True)
    forged.kill()
