"""Each run's GPU memory and the limit of a shared run (cudawrap/memwatch.py).

The decisions are pure and tested alone; the accounting and the enforcement run against real
accounts (tests/support/users.py) on the simulated machine, whose NVML reports what each stand-in
CUDA process registered: its allocation plus its context's cost, growing if told to.
"""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

import pytest

from support import fakecuda
from support.installed import ready_line
from support.procs import open_files, root_only, wait_for
from support.machine import FAKECUDA

from cudawrap.memory import watch as memwatch
from cudawrap.policy.config import parse_config
from cudawrap.errors import ConfigError
from cudawrap.memory.watch import Limit, Track, account, decide, limit_for, owner

CONTEXT = fakecuda.CONTEXT_MIB
TERMINATE = Limit(20480, "terminate", 5.0, 10.0)


# --- the pure part -------------------------------------------------------------------------


def test_owner_walks_up_to_the_holder_and_no_further() -> None:
    parents = {30: 20, 20: 10, 10: 1, 40: 1}
    assert owner(30, parents, {10: 10}) == 10
    assert owner(10, parents, {10: 10}) == 10
    assert owner(40, parents, {10: 10}) is None  # reparented to init: not found by descent


def test_account_sums_each_runs_processes_per_device() -> None:
    usage = {"GPU-a": {1: 1000, 2: 600, 3: None, 9: 5000}, "GPU-b": {2: 300}}
    assert account(usage, {1: 1, 2: 1, 3: 1}) == {1: {"GPU-a": 1600, "GPU-b": 300}}


def test_limit_defaults_to_the_devices_share_and_the_most_specific_key_wins() -> None:
    assert limit_for({}, {}, {}, "GPU-a1", "GPU-a1", "recon", 40960, 2) == Limit(20480, "warn", 5.0, 10.0)
    sharing = {"memory_limit_mib": 10000, "memory_action": "terminate"}
    devices = {"GPU-a": {"grace_s": 2.0}, "GPU-a1": {"memory_limit_mib": 12000}}
    programs = {"recon": {"kill_after_s": 1.0}}
    assert limit_for(sharing, devices, programs, "GPU-a1", "GPU-a1", "recon", 40960, 2) == \
        Limit(12000, "terminate", 5.0, 1.0)  # the longest device prefix only, then [sharing]
    assert limit_for(sharing, devices, {"recon": {"memory_limit_mib": 3000}}, "MIG-x", "GPU-a9", "recon",
                     5000, 1) == Limit(3000, "terminate", 2.0, 10.0)  # a MIG instance matches by its GPU


def test_decide_warns_at_90_percent_then_ends_after_the_grace() -> None:
    track = Track()
    assert [a.kind for a in decide(track, 7, "GPU-a", 18000, TERMINATE, 100.0)] == []
    assert [a.kind for a in decide(track, 7, "GPU-a", 18500, TERMINATE, 100.5)] == ["warn"]
    assert decide(track, 7, "GPU-a", 21000, TERMINATE, 101.0) == []  # over: the grace starts
    assert decide(track, 7, "GPU-a", 21000, TERMINATE, 105.9) == []
    assert [a.kind for a in decide(track, 7, "GPU-a", 25000, TERMINATE, 106.0)] == ["term"]
    assert decide(track, 7, "GPU-a", 25000, TERMINATE, 115.9) == []
    assert [a.kind for a in decide(track, 7, "GPU-a", 25000, TERMINATE, 116.0)] == ["kill"]
    assert decide(track, 7, "GPU-a", 25000, TERMINATE, 200.0) == []


def test_decide_restarts_the_grace_when_the_run_comes_back_inside() -> None:
    track = Track()
    decide(track, 7, "GPU-a", 21000, TERMINATE, 100.0)
    decide(track, 7, "GPU-a", 20000, TERMINATE, 104.0)
    assert decide(track, 7, "GPU-a", 21000, TERMINATE, 106.0) == []  # over again since 106 only
    assert [a.kind for a in decide(track, 7, "GPU-a", 21000, TERMINATE, 111.0)] == ["term"]


def test_decide_only_reports_with_warn_and_never_limits_without_a_limit() -> None:
    track, warn = Track(), Limit(20480, "warn", 5.0, 10.0)
    kinds = [a.kind for t in (100.0, 106.0, 200.0) for a in decide(track, 7, "GPU-a", 30000, warn, t)]
    assert kinds == ["warn", "over"]
    assert decide(Track(), 7, "GPU-a", 10 ** 6, Limit(0, "terminate", 5.0, 10.0), 100.0) == []


def test_the_ended_line_names_program_pid_user_and_sizes() -> None:
    assert memwatch.ended_line("recon", 4242, "alice", 44237, 40960) == \
        "recon (pid 4242, alice) ended: 43.2 GiB on a 40 GiB share"


def test_usage_sums_gib_hours_and_keeps_the_peak_per_user() -> None:
    from cudawrap.ops.usage import Lease, summarize

    def lease(user: str, peak: Any, mib_s: float) -> Lease:
        return Lease(user, "recon", ("GPU-a",), 0.0, 3600.0, None, False, 0.0, 0.5, peak, mib_s)

    rows = {r["user"]: r for r in summarize([lease("alice", 20480, 20480 * 3600.0), lease("alice", 30720, 0.0),
                                             lease("bob", None, 0.0)], "user", 0.0, 7200.0)}
    assert (rows["alice"]["memory_gib_hours"], rows["alice"]["memory_peak_gib"]) == (20.0, 30.0)
    assert rows["bob"]["memory_gib_hours"] is None  # nothing recorded: not a zero


def test_status_shows_a_holders_memory_and_a_shares_limit() -> None:
    from cudawrap.ops.statustable import _sharer, holder_text

    holder = {"pid": 4242, "user": "alice", "program": "recon", "memory": {"used_mib": 23654, "limit_mib": None}}
    assert holder_text(holder) == "pid 4242 alice recon 23.1 GiB"
    share = dict(holder, memory={"used_mib": 23654, "limit_mib": 40960})
    assert _sharer(share) == "alice pid 4242 23.1/40 GiB"
    assert holder_text({"pid": 7, "user": "bob", "program": "recon"}) == "pid 7 bob recon"  # not known: nothing


# --- the configuration -------------------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ("[sharing]\ngrace_s = 0\n", "'grace_s': 0 is not a number of seconds above 0"),
    ("[sharing]\ngrace_s = -1\n", "'grace_s': -1 is not a number of seconds above 0"),
    ('[sharing]\nkill_after_s = "soon"\n', "'kill_after_s': 'soon' is not a number of seconds from 0"),
    ("[sharing]\nmemory_limit_mib = -5\n", "'memory_limit_mib': -5 is not a whole number of MiB"),
    ('[sharing]\nmemory_action = "kill"\n', "'memory_action': 'kill' is not one of warn, terminate"),
    ('[sharing.devices."GPU-a"]\ngrace_s = 0\n', "'grace_s': 0 is not a number of seconds above 0"),
    ('[programs."recon"]\nmemory_action = 1\n', "'memory_action': 1 is not one of warn, terminate"),
], ids=["grace-zero", "grace-negative", "kill-text", "limit-negative", "action", "device-grace", "program-action"])
def test_bad_memory_keys_are_one_line_and_exit_78(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(Path("/etc/cudawrap/config.toml"), text)
    assert message in info.value.message and "\n" not in info.value.message
    assert info.value.exit_code == 78


def test_memory_keys_per_device_and_per_program_are_read() -> None:
    config = parse_config(Path("c.toml"), '[sharing]\nslots = 2\nmemory_action = "terminate"\n'
                          '[sharing.devices."GPU-a"]\ngrace_s = 2\n[programs."recon"]\nmemory_limit_mib = 100\n')
    assert config.sharing["memory_action"].value == "terminate"
    assert config.sharing["device_memory"]["GPU-a"]["grace_s"].value == 2.0
    assert "GPU-a" not in config.sharing["devices"]  # no slots of its own: [sharing] slots
    assert config.programs["recon"]["memory_limit_mib"].value == 100


# --- the stand-in CUDA program --------------------------------------------------------------


def _registered(fake: Any, pid: int) -> int:
    text = (fake.procs_dir / str(pid)).read_text() if (fake.procs_dir / str(pid)).exists() else ""
    return int(text.split()[1]) if text else -1


def test_the_stand_in_counts_its_context_grows_and_has_children(machine: Any) -> None:
    fake = machine("four-gpus")
    proc = subprocess.Popen([sys.executable, str(FAKECUDA), "--hold", "60", "--mem", "1000", "--grow", "4000",
                             "--max", "3000", "--children", "2"],
                            env=fake.environ(CUDA_VISIBLE_DEVICES="0"), stdout=subprocess.PIPE, text=True)
    try:
        hello = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
        children = hello["children"]
        assert len(children) == 2 and all(os.path.exists(f"/proc/{c}") for c in children)
        for pid in [proc.pid, *children]:
            assert _registered(fake, pid) >= 1000 + CONTEXT  # each its own context
        wait_for(lambda: all(_registered(fake, p) == 3000 + CONTEXT for p in [proc.pid, *children]))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == -signal.SIGTERM
        assert not any((fake.procs_dir / str(p)).exists() for p in [proc.pid, *children])
    finally:
        proc.kill()
        proc.wait()


def test_an_escaped_child_is_no_child_of_the_program(machine: Any) -> None:
    fake = machine("four-gpus")
    proc = subprocess.Popen([sys.executable, str(FAKECUDA), "--hold", "60", "--children", "1", "--escape"],
                            env=fake.environ(CUDA_VISIBLE_DEVICES="0"), stdout=subprocess.PIPE, text=True)
    try:
        (child,) = json.loads(proc.stdout.readline())["children"]  # type: ignore[union-attr]
        with open(f"/proc/{child}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) != proc.pid
        assert _registered(fake, child) == 256 + CONTEXT
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        wait_for(lambda: not (fake.procs_dir / str(child)).exists())
    finally:
        proc.kill()
        proc.wait()


# --- with real accounts ------------------------------------------------------------------------




def rows(snapshot: Dict[str, Any], pid: int) -> List[Dict[str, Any]]:
    return [r for r in snapshot["runs"] if r["pid"] == pid]


def one_device(mu: Any, config: str = "") -> Any:
    """An install on four-gpus where runs get its first device only, and `recon` wrapped."""
    inst = mu("four-gpus")
    inst.wrap("recon")
    inst.configure(config, inst.machine.leaf_uuids()[0])
    return inst


@root_only
def test_a_run_of_three_processes_is_summed(mu: Any) -> None:
    inst = one_device(mu)
    d0 = inst.machine.leaf_uuids()[0]
    run = inst.start(inst.world.alice, "recon", "--hold", "600", "--mem", "1000", "--children", "2")
    hello = ready_line(run)
    assert len(hello["children"]) == 2
    snapshot = memwatch.Watch(inst.layout).cycle()
    (row,) = rows(snapshot, run.pid)
    assert row["device"] == d0 and row["used_mib"] == 3 * (1000 + CONTEXT)
    assert row["processes"] == sorted([run.pid, *hello["children"]])
    assert row["limit_mib"] is None and not row["shared"]  # exclusive: never limited
    assert memwatch.read_snapshot(inst.layout)["runs"] == snapshot["runs"]  # what status shows
    shown = inst.cli(None, "status").stdout.decode()
    assert f"pid {run.pid} {inst.world.alice.name} recon {3 * (1000 + CONTEXT) / 1024:.1f} GiB" in shown, shown


@root_only
def test_a_child_without_the_lease_counts_by_descent(mu: Any) -> None:
    """A child that closed what it inherited (a Python program's subprocess workers) holds no
    lease: only its parent chain, read from /proc as the cycle walks it, makes it the run's."""
    inst = one_device(mu)
    run = inst.start(inst.world.alice, "recon", "--hold", "600", "--mem", "1500", "--children", "1", "--close-fds")
    (child,) = ready_line(run)["children"]
    assert not any(link.startswith(str(inst.layout.lease_dir)) for link in open_files(child))
    (row,) = rows(memwatch.Watch(inst.layout).cycle(), run.pid)
    assert row["used_mib"] == 2 * (1500 + CONTEXT) and row["processes"] == sorted([run.pid, child])


@root_only
def test_a_child_that_escaped_its_parent_counts_while_it_holds_the_lease(mu: Any) -> None:
    inst = one_device(mu)
    run = inst.start(inst.world.bob, "recon", "--hold", "600", "--mem", "2000", "--children", "1", "--escape")
    (child,) = ready_line(run)["children"]
    (row,) = rows(memwatch.Watch(inst.layout).cycle(), run.pid)
    assert row["used_mib"] == 2 * (2000 + CONTEXT) and child in row["processes"]


@root_only
def test_a_share_over_its_limit_is_warned_then_ended_and_the_other_is_untouched(
        mu: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Two shares of 20 GiB on a 40 GiB device; alice's grows to 25 GiB."""
    from cudawrap.ledger import looks as ledger, files as ledgerfile

    inst = one_device(mu, '[sharing]\nslots = 2\nmemory_action = "terminate"\ngrace_s = 0.3\nkill_after_s = 5\n')
    d0 = inst.machine.leaf_uuids()[0]
    alice, bob = inst.world.alice, inst.world.bob
    theirs = inst.start(bob, "recon", "--hold", "600", "--mem", "8000", CUDAWRAP_SHARE="1")
    ready_line(theirs)
    grower = inst.start(alice, "recon", "--hold", "600", "--mem", "17000", "--grow", "20000",
                        "--max", str(25600 - CONTEXT), CUDAWRAP_SHARE="1")
    assert ready_line(grower)["devices"] == [d0]
    ledger.observe(inst.layout)  # the grants, as the monitor records them
    watch = memwatch.Watch(inst.layout)
    caplog.set_level(logging.WARNING, logger="cudawrap.memory.watch")
    seen: List[int] = []

    def cycle() -> bool:
        snapshot = watch.cycle()
        seen.extend(r["used_mib"] for r in rows(snapshot, grower.pid))
        return grower.poll() is not None

    wait_for(cycle, timeout=30)
    assert grower.returncode == -signal.SIGTERM
    assert theirs.poll() is None  # bob's share runs on
    warning = next(r.getMessage() for r in caplog.records if "uses" in r.getMessage())
    assert f"recon (pid {grower.pid}) uses" in warning and "of its 20.0 GiB share" in warning
    used = float(re.search(r"uses ([0-9.]+) GiB", warning).group(1))
    assert 18.0 <= used < 20.0  # warned at 90 %, before it was over
    ended = [r.getMessage() for r in caplog.records if "ended:" in r.getMessage()]
    assert ended == [f"recon (pid {grower.pid}, {alice.name}) ended: 25.0 GiB on a 20 GiB share"]
    ledger.observe(inst.layout)
    records = [json.loads(line) for line in ledgerfile.ledger_path(inst.layout).read_text().splitlines()]
    end = next(r for r in records if r["event"] == "end" and r["pid"] == grower.pid)
    assert end["how"] == ended[0] and end["memory_peak_mib"] == 25600
    assert not any(r["event"] == "end" and r["pid"] == theirs.pid for r in records)


# --- telling the frameworks ----------------------------------------------------------------------


def _env_of(path: Path) -> Dict[bytes, bytes]:
    return dict(item.split(b"=", 1) for item in path.read_bytes().split(b"\0") if b"=" in item)


def test_a_share_tells_the_frameworks_its_allowance_unless_the_user_did(installed: Any, tmp_path: Path) -> None:
    from test_sharing import SHARE, share_config

    inst = installed("four-gpus")
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    share_config(inst, slots=3, allow=(d0,))
    out = tmp_path / "env"
    assert inst.run("recon", "--env-out", str(out), **SHARE).returncode == 0
    env = _env_of(out)
    assert env[b"XLA_PYTHON_CLIENT_MEM_FRACTION"] == b"0.33"  # 40960 // 3 MiB of 40960, rounded down
    assert env[b"TF_FORCE_GPU_ALLOW_GROWTH"] == b"true"
    assert inst.run("recon", "--env-out", str(out), **SHARE, XLA_PYTHON_CLIENT_MEM_FRACTION="0.9",
                    TF_FORCE_GPU_ALLOW_GROWTH="false").returncode == 0
    env = _env_of(out)
    assert (env[b"XLA_PYTHON_CLIENT_MEM_FRACTION"], env[b"TF_FORCE_GPU_ALLOW_GROWTH"]) == (b"0.9", b"false")
    assert inst.run("recon", "--env-out", str(out)).returncode == 0  # a whole device: nothing to tell
    assert b"XLA_PYTHON_CLIENT_MEM_FRACTION" not in out.read_bytes()


def test_the_device_and_program_limits_reach_the_share_and_mps(installed: Any, tmp_path: Path) -> None:
    from test_sharing import SHARE, share_config

    inst = installed("four-gpus")
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    share_config(inst, slots=4, extra=f'mode = "mps"\n[sharing.devices."{d0[:12]}"]\nmemory_limit_mib = 4096\n',
                 allow=(d0,))
    out = tmp_path / "env"
    assert inst.run("recon", "--env-out", str(out), **SHARE).returncode == 46  # no MPS daemon here
    env = _env_of(out)
    assert env[b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == b"0=4096M"
    assert env[b"XLA_PYTHON_CLIENT_MEM_FRACTION"] == b"0.10"
    text = inst.layout.config_file.read_text() + '\n[programs."recon"]\nmemory_limit_mib = 8192\n'
    inst.write_config(text)
    assert inst.run("recon", "--env-out", str(out), **SHARE).returncode == 46
    assert _env_of(out)[b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == b"0=8192M"


def test_the_metrics_file_has_each_runs_memory() -> None:
    from cudawrap.monitor.metrics import Counters, render

    text = render([], {}, Counters(), [{"pid": 4242, "uid": 0, "program": "recon", "device": "GPU-a",
                                          "used_mib": 1024, "limit_mib": None}])
    assert 'cudawrap_run_memory_bytes{device="GPU-a",user="root",program="recon",pid="4242"} 1073741824' in text


def test_a_limit_above_a_devices_memory_is_reported_by_sync_and_doctor(installed: Any) -> None:
    inst = installed("two-models")
    small = next(d for d in inst.machine.parse().gpus if d.memory_mib < 50000)
    big = next(d for d in inst.machine.parse().gpus if d.memory_mib > small.memory_mib)
    inst.write_config(f'[sharing]\nslots = 2\n[programs."recon"]\nmemory_limit_mib = {small.memory_mib + 1}\n')
    warning = (f'memory_limit_mib = {small.memory_mib + 1} in [programs."recon"] is above the '
               f"{small.memory_mib} MiB of {small.uuid}")
    r = inst.cli("sync")
    assert r.returncode == 0 and f"warning: {warning}".encode() in r.stdout + r.stderr, r.stdout + r.stderr
    assert big.uuid.encode() not in b"".join(l for l in (r.stdout + r.stderr).splitlines() if b"above" in l)
    r = inst.cli("doctor")
    assert warning.encode() in r.stdout + r.stderr, r.stdout


# --- placement -----------------------------------------------------------------------------------


def test_a_share_asking_free_memory_joins_only_where_the_other_shares_leave_it(installed: Any) -> None:
    from test_sharing import SHARE, share_config

    inst = installed("four-gpus")
    inst.wrap("recon")
    d0, d1 = inst.machine.leaf_uuids()[:2]
    share_config(inst, slots=4, allow=(d0, d1))
    big = inst.start("recon", "--hold", "60", "--mem", "30000", **SHARE)
    (first,) = ready_line(big)["devices"]
    other = d1 if first == d0 else d0
    # 40960 - 30518 MiB is left where the big share runs: a run asking 20000 free goes elsewhere ...
    roomy = inst.start("recon", "--hold", "60", CUDAWRAP_MIN_FREE_MEMORY_MIB="20000", **SHARE)
    assert ready_line(roomy)["devices"] == [other]
    # ... and one asking 5000 fills the first device, as shares do.
    small = inst.start("recon", "--hold", "60", CUDAWRAP_MIN_FREE_MEMORY_MIB="5000", **SHARE)
    assert ready_line(small)["devices"] == [first]
    # A program's policy asks the same: it joins where room is left, now the second device.
    inst.wrap("roomy")
    inst.write_config(inst.layout.config_file.read_text() + '\n[programs."roomy"]\nmin_free_memory_mib = 20000\n')
    policy = inst.start("roomy", "--hold", "60", **SHARE)
    assert ready_line(policy)["devices"] == [other]


@root_only
def test_the_monitor_loop_ends_a_share_over_its_limit_and_reports_its_memory(mu: Any) -> None:
    """The same through `cudawrap monitor`'s loop: the overrun is acted on by the monitor itself,
    and its metrics file carries each run's memory."""
    import threading

    from cudawrap.ledger import looks as ledger, files as ledgerfile
    from cudawrap.monitor import loop as monitor

    prom = Path(tempfile.mkdtemp(prefix="prom-", dir="/tmp")) / "cudawrap.prom"
    inst = one_device(mu, '[sharing]\nslots = 2\nmemory_action = "terminate"\ngrace_s = 0.2\n'
                          f'[metrics]\ntextfile = "{prom}"\n')
    calm = inst.start(inst.world.bob, "recon", "--hold", "600", "--mem", "1000", CUDAWRAP_SHARE="1")
    ready_line(calm)
    grower = inst.start(inst.world.alice, "recon", "--hold", "600", "--mem", "30000", CUDAWRAP_SHARE="1")
    ready_line(grower)
    stop = threading.Event()
    loop = threading.Thread(target=monitor.run, args=(inst.layout, 0.05, stop.is_set))
    loop.start()
    try:
        wait_for(lambda: prom.exists() and f'pid="{calm.pid}"' in prom.read_text(), timeout=30)
        assert grower.wait(timeout=30) == -signal.SIGTERM
    finally:
        stop.set()
        loop.join()
    assert calm.poll() is None
    assert f'cudawrap_run_memory_bytes{{device="{inst.machine.leaf_uuids()[0]}",user="{inst.world.bob.name}",' \
        f'program="recon",pid="{calm.pid}"}} {(1000 + CONTEXT) << 20}' in prom.read_text()
    ledger.observe(inst.layout)
    records = [json.loads(line) for line in ledgerfile.ledger_path(inst.layout).read_text().splitlines()]
    end = next(r for r in records if r["event"] == "end" and r["pid"] == grower.pid)
    assert end["how"] == f"recon (pid {grower.pid}, {inst.world.alice.name}) ended: 29.8 GiB on a 20 GiB share"
    shutil.rmtree(prom.parent)


@root_only
def test_the_warning_reaches_the_runs_own_terminal_and_never_its_pipe(mu: Any) -> None:
    import pty
    import select

    inst = one_device(mu, "[sharing]\nslots = 2\n")
    alice = inst.world.alice
    master, slave = pty.openpty()
    os.fchown(slave, alice.uid, -1)  # her terminal, as login makes it
    at_tty = subprocess.Popen(alice.argv(["recon", "--hold", "600", "--mem", "19000"]),
                              env=inst.environ(CUDAWRAP_SHARE="1"), stdout=subprocess.PIPE, stderr=slave,
                              cwd=inst.dir)
    inst.spawned.add(at_tty)
    os.close(slave)
    at_pipe = inst.start(inst.world.bob, "recon", "--hold", "600", "--mem", "19000", CUDAWRAP_SHARE="1")
    ready_line(at_tty), ready_line(at_pipe)
    memwatch.Watch(inst.layout).cycle()  # both at 19518 of 20480 MiB: over 90 %
    assert select.select([master], [], [], 10)[0]
    said = os.read(master, 4096).decode()
    assert f"cudawrap: recon (pid {at_tty.pid}) uses 19.1 GiB of its 20.0 GiB share" in said, said
    assert not select.select([at_pipe.stderr], [], [], 0)[0]  # a pipe is the run's output, not ours
    os.close(master)


def test_cudawrap_config_shows_the_memory_keys_and_where_they_come_from(installed: Any) -> None:
    inst = installed("four-gpus")
    inst.write_config('[sharing]\nslots = 2\nmemory_action = "terminate"\n[sharing.devices."GPU-5e7f"]\ngrace_s = 2\n')
    shown = inst.cli("config").stdout.decode()

    def row(name: str) -> str:
        return next(line for line in shown.splitlines() if line.startswith(name + " "))

    assert "terminate" in row("memory_action") and "config.toml" in row("memory_action"), shown
    assert "10" in row("kill_after_s") and "default" in row("kill_after_s"), shown
    assert any(line.startswith("grace_s of GPU-5e7f") and "2" in line for line in shown.splitlines()), shown


@root_only
def test_a_share_that_ignores_sigterm_is_killed_after_kill_after_s(mu: Any, caplog: pytest.LogCaptureFixture) -> None:
    inst = one_device(mu, '[sharing]\nslots = 2\nmemory_action = "terminate"\ngrace_s = 0.1\nkill_after_s = 0.5\n')
    run = inst.start(inst.world.alice, "recon", "--hold", "600", "--mem", "12000", "--children", "1", "--stubborn",
                     CUDAWRAP_SHARE="1")
    (child,) = ready_line(run)["children"]
    watch = memwatch.Watch(inst.layout)
    caplog.set_level(logging.WARNING, logger="cudawrap.memory.watch")
    wait_for(lambda: watch.cycle() is not None and run.poll() is not None, timeout=30)
    assert run.returncode == -signal.SIGKILL
    wait_for(lambda: not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z")
    said = [r.getMessage() for r in caplog.records]
    assert any("ended: 24.4 GiB on a 20 GiB share" in m for m in said), said  # 2 x (12000 + 518) MiB
    assert any(f"recon (pid {run.pid}, {inst.world.alice.name}) still runs 0.5 s after SIGTERM: SIGKILL" in m
               for m in said), said
