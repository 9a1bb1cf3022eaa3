"""Fair turns between real users, limits, reservations and runs that do not take their turn.

Run as root with real accounts (tests/support/users.py), on the simulated machine. Orders are read
from the start records the stand-in programs log themselves; no assertion depends on timing.
"""
from __future__ import annotations

import json
import os
import select
import signal
import time
from typing import Dict, List

import pytest

from cudawrap.sched.turns import STALL_S
from support.installed import ready_line, waiting_line
from support.procs import root_only, wait_for
from test_service import Served, _ledger

pytestmark = root_only


def starts(log) -> List[int]:  # type: ignore[no-untyped-def]
    return [j["pid"] for j in map(json.loads, log.read_text().splitlines()) if j["event"] == "start"]


def config(inst, text: str) -> None:  # type: ignore[no-untyped-def]
    inst.layout.config_file.write_text(text)
    inst.layout.config_file.chmod(0o644)


def test_a_second_user_is_served_before_the_first_users_batch(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    d0, d1 = inst.machine.leaf_uuids()[:2]
    inst.allow(d0, d1)
    holders = [inst.start(alice, "recon", "--hold", "600") for _ in range(2)]
    for h in holders:
        ready_line(h)
    batch = []
    for n in range(3):
        p = inst.start(alice, "recon", "--hold", "0.3", "--log", str(inst.log))
        assert f"position {n + 1} in line" in waiting_line(p)
        batch.append(p)
    late = inst.start(bob, "recon", "--hold", "0.3", "--log", str(inst.log))
    # Bob holds nothing and alice two: he is next although he came last.
    assert "position 1 in line" in waiting_line(late)
    seen = inst.status(bob)["waiting"]
    assert [(w["user"], w["position"]) for w in seen] == [(bob.name, 1)] + [(alice.name, n) for n in (2, 3, 4)]
    holders[0].kill()
    assert late.wait(timeout=30) == 0
    # Alice's batch then runs on the one device freed, one at a time: in arrival order.
    for p in batch:
        assert p.wait(timeout=30) == 0
    holders[1].kill()
    assert starts(inst.log) == [late.pid] + [p.pid for p in batch]


def test_three_users_the_fewest_held_goes_next(mu) -> None:  # type: ignore[no-untyped-def]
    """Each freed device goes to the waiting user holding the fewest devices; ties to the
    user whose oldest waiting run came first (README: Order of service)."""
    inst = mu("four-gpus")
    alice, bob, carol = inst.world.alice, inst.world.bob, inst.world.carol
    inst.wrap("recon")
    d0, d1 = inst.machine.leaf_uuids()[:2]
    inst.allow(d0, d1)
    holders = [inst.start(None, "recon", "--hold", "600") for _ in range(2)]
    for h in holders:
        ready_line(h)
    runs = {}
    for name, user, n in (("a", alice, 3), ("b", bob, 1), ("c", carol, 1)):
        for i in range(n):
            runs[f"{name}{i + 1}"] = p = inst.start(user, "recon", "--hold", "600")
            waiting_line(p)

    def next_to_start(kill: str) -> str:
        victim = holders.pop(0) if kill == "root" else runs.pop(kill)
        victim.kill()
        victim.wait()
        waiting = {p.stdout.fileno(): name for name, p in runs.items() if name not in started}
        ready, _, _ = select.select(list(waiting), [], [], 30)
        assert len(ready) == 1, [waiting[fd] for fd in ready]
        name = waiting[ready[0]]
        ready_line(runs[name])
        started.append(name)
        return name

    started: List[str] = []
    # all hold 0: alice's run is the oldest | alice 1, bob 0, carol 0: bob's is older than carol's
    assert next_to_start("root") == "a1"
    assert next_to_start("root") == "b1"
    # alice 0, bob 1, carol 0: alice's a2 arrived before carol's c1
    assert next_to_start("a1") == "a2"
    # alice 1, bob 0 (nothing waiting), carol 0: carol
    assert next_to_start("b1") == "c1"
    assert next_to_start("a2") == "a3"


def test_a_large_run_does_not_idle_devices_then_gets_them_reserved(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice, bob, carol = inst.world.alice, inst.world.bob, inst.world.carol
    inst.wrap("recon")
    inst.wrap("big")
    # Bob's large run starves after 6 s (carol's runs: the default 300 s); long enough for the
    # first hand-over below to happen before it, even on a loaded machine.
    config(inst, '[programs."big"]\ngpus = 4\nreserve_after = 6\n')
    holders = [inst.start(alice, "recon", "--hold", "600") for _ in range(4)]
    for h in holders:
        ready_line(h)
    large = inst.start(bob, "big", "--log", str(inst.log))
    assert "position 1 in line" in waiting_line(large)
    bob_queued = time.monotonic()
    small = [inst.start(carol, "recon", "--hold", "600", "--log", str(inst.log)) for _ in range(2)]
    for p in small:
        waiting_line(p)
    # Bob waits for four; a freed device goes to one of carol's runs instead of idling.
    holders[0].kill()
    holders[0].wait()
    fds = {p.stdout.fileno(): n for n, p in enumerate(small)}
    ready, _, _ = select.select(list(fds), [], [], 30)
    assert len(ready) == 1, [fds[fd] for fd in ready]
    started = small[fds[ready[0]]]
    ready_line(started)
    small = [started] + [p for p in small if p is not started]
    assert time.monotonic() - bob_queued < 6, "the first hand-over came after bob started starving"
    time.sleep(max(0.0, bob_queued + 6.5 - time.monotonic()))  # bob has now waited longer than reserve_after
    holders[1].kill()
    holders[1].wait()
    why: Dict[int, str] = {}

    def kept_for_bob() -> bool:
        why.clear()
        why.update({w["pid"]: w["reason"] for w in inst.status(None)["waiting"]})
        return "kept for a run that has waited longer" in why.get(small[1].pid, "")

    wait_for(kept_for_bob, 30, "the device kept for bob's run", lambda: str(why))
    assert "kept for this run, waiting for" in why[large.pid]
    assert small[1].poll() is None
    for p in holders[2:] + small[:1]:
        p.kill()
    assert ready_line(large)["devices"] and large.wait(timeout=30) == 0
    assert len(json.loads(inst.log.read_text().splitlines()[-1])["devices"]) == 4
    small[1].kill()


def test_limits_per_user_and_their_messages(both) -> None:  # type: ignore[no-untyped-def]
    way = both(users=True)
    inst = way.inst
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("big")
    config(inst, '[limits]\nmax_devices_per_user = 1\n\n[limits.users."%s"]\nmax_devices = 2\n\n'
                 '[programs."big"]\ngpus = 2\n' % bob.name)
    shown = inst.cli(alice, "config").stdout.decode()
    assert "every user (max_devices_per_user)  1" in shown and f"user {bob.name}" in shown
    first = inst.start(alice, "recon", "--hold", "600")
    ready_line(first)
    second = inst.start(alice, "recon", "--log", str(inst.log))
    line = waiting_line(second)
    assert "you hold 1 device, your limit is 1; waiting for one of yours to end" in line, (way, line)
    # Others are not held up by alice's limit, and bob's own limit is 2.
    done = inst.run(bob, "big", CUDAWRAP_WAIT="0")
    assert done.returncode == 0, (way, done.stderr)
    never = inst.run(alice, "big", CUDAWRAP_WAIT="forever")
    assert never.returncode == 75 and "your limit is 1" in never.stderr.decode(), (way, never.stderr)
    first.kill()
    assert second.wait(timeout=30) == 0


@pytest.mark.parametrize("served", [False, True], ids=["daemonless", "service"])
def test_a_stopped_waiter_loses_its_turn_and_gets_it_back(mu, served: bool) -> None:  # type: ignore[no-untyped-def]
    """Alice's run, first in line, is stopped (SIGSTOP) as the device frees: bob's run behind it
    gets the device within turns.STALL_S, and alice's once she is continued. Through the
    service (issue 51, 16) the grant went to her again every 2 s, each time one more "not
    taken" in the ledger, until she was killed: now she is passed over as runs deciding for
    themselves pass her over, and her stall is one "not taken", however long it lasts."""
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    inst.allow(inst.machine.leaf_uuids()[0])
    service = Served(inst) if served else None  # it wraps recon
    if service is None:
        inst.wrap("recon")
    try:
        holder = inst.start(None, "recon", "--hold", "600")
        ready_line(holder)
        stopped = inst.start(alice, "recon", "--log", str(inst.log))
        assert "position 1 in line" in waiting_line(stopped)
        patient = inst.start(bob, "recon", "--hold", "0.5", "--log", str(inst.log))
        assert "position 2 in line" in waiting_line(patient)
        os.kill(stopped.pid, signal.SIGSTOP)
        holder.kill()
        assert patient.wait(timeout=30) == 0  # alice's stopped run did not keep the device idle
        if service is not None:
            time.sleep(2 * STALL_S)  # the device free all along, and alice's run still stopped
            assert [r["how"] for r in _ledger(inst, "end") if r["pid"] == stopped.pid] == ["not taken"]
        os.kill(stopped.pid, signal.SIGCONT)
        assert stopped.wait(timeout=30) == 0
        assert starts(inst.log) == [patient.pid, stopped.pid]
        assert inst.status(None)["waiting"] == []
    finally:
        if service is not None:
            service.proc.terminate()
            service.proc.wait(timeout=10)


def test_the_api_waits_from_a_thread_and_leaves_nothing_behind(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice = inst.world.alice
    inst.allow(inst.machine.leaf_uuids()[0])
    holder = inst.py_start(None, "import sys; sys.path[:0] = sys.argv[1:]\n"
                           "import cudawrap, time; cudawrap.acquire(); print('held', flush=True); time.sleep(60)",
                           *inst.world.path)
    assert holder.stdout.readline() == b"held\n", holder.stderr.read()
    code = ("import sys; sys.path[:0] = sys.argv[1:]\n"
            "import cudawrap, threading, json\n"
            "out = {}\n"
            "def work():\n"
            "    try:\n"
            "        out['got'] = cudawrap.acquire(wait=30)\n"
            "    except Exception as exc:\n"
            "        out['error'] = repr(exc)\n"
            "t = threading.Thread(target=work); t.start(); t.join(); print(json.dumps(out))\n")
    waiter = inst.py_start(alice, code, *inst.world.path)
    wait_for(lambda: inst.status(None)["waiting"], 30)
    holder.kill()
    assert waiter.wait(timeout=30) == 0, waiter.stderr.read()
    assert json.loads(waiter.stdout.read()) == {"got": [inst.machine.leaf_uuids()[0]]}
    assert inst.status(None)["waiting"] == []


# Queue entries made by hand, as an attacker would: N names claiming REQUEST (count,
# placement, narrowed: "999sa") and RESERVE seconds, with an arrival an hour ago, each
# created and flocked by this process; the last one claims LAST ("4sa.0") instead, if given.
FORGED = r"""
import fcntl, os, resource, sys, time
queue, request, reserve, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
last = sys.argv[5] if len(sys.argv) > 5 else request + "." + reserve
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
fds = []
for i in range(n):
    name = "%020d.%d.%s.wait" % (time.time_ns() - 3600 * 10**9 + i, os.getpid(),
                                 last if i == n - 1 else request + "." + reserve)
    fd = os.open(os.path.join(queue, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    fds.append(fd)
print("held", flush=True)
time.sleep(300)
"""


def forge(inst, user, request: str, reserve: str, n: int = 1, last: str = ""):  # type: ignore[no-untyped-def]
    proc = inst.py_start(user, FORGED, str(inst.layout.queue_dir), request, reserve, str(n), *([last] if last else []))
    assert proc.stdout.readline() == b"held\n", proc.stderr.read()
    return proc


def test_a_forged_entry_for_every_device_keeps_none_idle(mu) -> None:  # type: ignore[no-untyped-def]
    """Entries claiming 999 devices, or every device, with reserve_after 0 and an arrival an
    hour ago: devices are kept for nobody, so another user's run is granted at once (before
    the fix it was told they were kept for a run that waited longer, and gave up)."""
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    ready_line(inst.start(None, "recon", "--hold", "600"))  # so that no forged count is met
    forged = [forge(inst, alice, "999sa", "0"), forge(inst, alice, "4sa", "0")]
    seen = {w["count"]: w["reason"] for w in inst.status(None)["waiting"]}
    assert sorted(seen) == [4, 999] and not any("kept for this run" in r for r in seen.values()), seen
    done = inst.run(bob, "recon", CUDAWRAP_WAIT="3")
    assert done.returncode == 0, done.stderr
    # Past the admin's reserve_after (1 s here), a count no run can be given still keeps nothing.
    config(inst, "[policy]\nreserve_after = 1\n")
    forged[1].kill()
    forged.append(forge(inst, alice, "5sa", "0"))
    time.sleep(1.2)  # both now waited longer than reserve_after: only their counts can save bob
    done = inst.run(bob, "recon", CUDAWRAP_WAIT="3")
    assert done.returncode == 0, done.stderr
    for p in forged:
        p.kill()


def test_an_api_caller_claiming_no_reserve_after_jumps_nobody(mu) -> None:  # type: ignore[no-untyped-def]
    """launch.obtain with reserve_after = 0 in the settings it is passed: the entry claims it,
    nobody honours it before the admin's reserve_after (300 s), so the two devices left free
    are not kept for alice's 4-device run and bob's run takes one."""
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    for h in [inst.start(None, "recon", "--hold", "600") for _ in range(2)]:
        ready_line(h)
    code = ("import os, sys; sys.path[:0] = sys.argv[1:]\n"
            "from cudawrap import launch\n"
            "from cudawrap.policy.effective import effective\n"
            "root = os.environ['CUDAWRAP_ROOT']\n"
            "settings = effective(root, None)\n"
            "settings.set('reserve_after', 0.0, 'mine')\n"
            "launch.obtain(root, 'jumper', settings, os.environ, count=4)\n")
    jumper = inst.py_start(alice, code, *inst.world.path)
    waiting_line(jumper)
    (entry,) = os.listdir(inst.layout.queue_dir)
    assert entry.endswith(".4sa.0.wait"), entry
    done = inst.run(bob, "recon", CUDAWRAP_WAIT="3")
    assert done.returncode == 0, done.stderr
    jumper.kill()


def test_entries_beyond_a_users_thousand_count_in_no_decision(mu) -> None:  # type: ignore[no-untyped-def]
    """A user's oldest 1000 entries count, whoever made them: alice's 1001st, claiming every
    device and waited past reserve_after, keeps the free devices from nobody and is not
    listed (counted, it kept them for itself: one is held, so it cannot be served)."""
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    config(inst, "[policy]\nreserve_after = 1\n")
    ready_line(inst.start(None, "recon", "--hold", "600"))  # so that the 1001st cannot be met
    forged = forge(inst, alice, "999sa", "300", n=1001, last="4sa.0")
    time.sleep(1.2)  # the 1001st has waited longer than reserve_after
    done = inst.run(bob, "recon", CUDAWRAP_WAIT="3")
    assert done.returncode == 0, done.stderr
    seen = inst.status(None)["waiting"]
    assert len(seen) == 1000 and {w["count"] for w in seen} == {999}, len(seen)
    forged.kill()
