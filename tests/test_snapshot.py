"""The monitor's snapshot: launches without NVML while it is fresh, never trusting a stale or forged one."""
import contextlib
import json
import marshal
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time

import pytest

from cudawrap.base import proc
from cudawrap.devices import snapshot
from cudawrap.monitor.loop import refresh_once
from support.installed import ready_line
from support.procs import root_only, wait_for
from support.machine import FAKECUDA


def run_without_nvml(inst, *args, **extra):
    """Run a wrapped program where libnvidia-ml.so.1 cannot be loaded."""
    env = inst.machine.without_library()
    env["PATH"] = f"{inst.bindir}:{env['PATH']}"
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(extra)
    return subprocess.run(list(args), env=env, capture_output=True, timeout=30)


def test_a_fresh_snapshot_spares_nvml(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    assert refresh_once(inst.layout) is None
    r = run_without_nvml(inst, "recon")
    assert r.returncode == 0, r.stderr
    assert r.stderr == b""  # no "no driver" warning: NVML was never needed
    assert json.loads(r.stdout.splitlines()[0])["cvd"].startswith("MIG-")


def test_a_sync_that_changes_the_devices_drops_the_snapshot_of_the_old_ones(installed):
    """A snapshot written just before a MIG change (a service's monitor stopped, then the
    layout changed and synced): fresh for seconds, it named devices that have no lease file
    any more, and every launch failed (72) until it aged."""
    inst = installed("a100-mig7")
    inst.wrap("recon")
    assert refresh_once(inst.layout) is None
    assert inst.cli("sync").returncode == 0  # the same devices: the snapshot stays
    assert inst.layout.usage_snapshot.exists()
    inst.machine.load("dgx-a100-mig56")
    assert inst.cli("sync").returncode == 0
    assert not inst.layout.usage_snapshot.exists()
    r = run_without_nvml(inst, "recon")  # NVML read again (none here): no lease file is missing
    assert r.returncode == 0, r.stderr


def test_a_stale_snapshot_is_ignored(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    refresh_once(inst.layout)
    path = inst.layout.usage_snapshot
    data = marshal.loads(path.read_bytes())
    data["written"] -= snapshot.MAX_AGE_S + 1
    path.write_bytes(marshal.dumps(data))
    r = run_without_nvml(inst, "recon")
    assert b"no NVIDIA driver" in r.stderr  # it asked NVML itself


def test_a_snapshot_not_written_by_root_is_ignored(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    refresh_once(inst.layout)
    os.chmod(inst.layout.usage_snapshot, 0o666)  # anyone could have written it
    r = run_without_nvml(inst, "recon")
    assert b"no NVIDIA driver" in r.stderr


def test_snapshot_shows_every_process_and_discounts_an_exited_lessee(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    proc = inst.start("recon", "--hold", "30", CUDA_VISIBLE_DEVICES=gpus[0])
    ready_line(proc)
    inst.machine.add_process(4242, gpus[1], 2048)
    refresh_once(inst.layout)
    seen = snapshot.read_fresh(str(inst.layout.root))
    assert seen.by_uuid(gpus[0]).pids == (proc.pid,)  # held or not, nothing is hidden
    assert seen.by_uuid(gpus[1]).pids == (4242,)
    proc.kill()
    proc.wait()
    seen = snapshot.read_fresh(str(inst.layout.root))
    assert seen.by_uuid(gpus[0]).pids == ()  # the lessee has exited: it runs nowhere
    # Freed after the snapshot was taken: usable at once, without waiting for the next one.
    r = run_without_nvml(inst, "recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=f"{gpus[0]},{gpus[1]}")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["devices"] == [gpus[0]]


# No process here can have this pid (above the largest pid_max): one NVML names from another
# pid namespace, which the monitor cannot see.
UNSEEN_PID = (1 << 22) + 1


def foreign(inst, uuid: str) -> subprocess.Popen:
    """An unwrapped CUDA program on UUID, ready (listed by NVML)."""
    proc = inst.spawned([str(FAKECUDA), "--hold", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        env=inst.machine.environ(CUDA_VISIBLE_DEVICES=uuid))
    ready_line(proc)
    return proc


def test_an_exited_foreign_process_is_discounted_at_once_and_an_unseen_one_keeps_counting(installed, monkeypatch):
    """An unwrapped CUDA program the snapshot lists stops counting as it exits (or as its pid
    names another process), not at the next snapshot; a pid the monitor never saw counts."""
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    root = str(inst.layout.root)
    first = foreign(inst, gpus[0])
    inst.machine.add_process(UNSEEN_PID, gpus[1], 2048)
    refresh_once(inst.layout)
    seen = snapshot.read_fresh(root)
    assert seen.by_uuid(gpus[0]).pids == (first.pid,)
    assert seen.by_uuid(gpus[1]).pids == (UNSEEN_PID,)
    first.kill()
    first.wait()
    seen = snapshot.read_fresh(root)
    assert seen.by_uuid(gpus[0]).pids == ()
    assert seen.by_uuid(gpus[1]).pids == (UNSEEN_PID,)
    # One device read alone (the service's look at a freed device) says the same.
    for uuid in gpus:
        assert snapshot.read_fresh_device(root, uuid) == (True, seen.by_uuid(uuid))
    assert snapshot.read_fresh_device(root, "GPU-not-there") == (True, None)
    assert snapshot.read_fresh_device(root, gpus[0], max_age=0) == (False, None)
    # The launch takes the device it left at once, and never the one the unseen process is on.
    r = run_without_nvml(inst, "recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=f"{gpus[1]},{gpus[0]}")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["devices"] == [gpus[0]]
    r = run_without_nvml(inst, "recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=gpus[1])
    assert r.returncode == 75, r.stdout
    # A pid reused by another process (another start time) no longer names the one listed.
    second = foreign(inst, gpus[2])
    try:
        refresh_once(inst.layout)
        assert snapshot.read_fresh(root).by_uuid(gpus[2]).pids == (second.pid,)
        # A device read alone looks up its own processes only (the service, at each
        # hand-over): not the one on another device.
        asked = []
        real_started_as = proc.started_as
        monkeypatch.setattr(proc, "started_as", lambda pid, started: asked.append(pid) or real_started_as(pid, started))
        assert snapshot.read_fresh_device(root, gpus[2])[1].pids == (second.pid,)
        assert snapshot.read_fresh_device(root, gpus[3])[1].pids == ()
        assert asked == [second.pid]
        monkeypatch.undo()
        path = inst.layout.usage_snapshot
        data = marshal.loads(path.read_bytes())
        data["started"][second.pid] += 1
        path.write_bytes(marshal.dumps(data))
        assert snapshot.read_fresh(root).by_uuid(gpus[2]).pids == ()
    finally:
        second.kill()
        second.wait()


def test_a_zombie_lessee_is_discounted_before_its_parent_reaps_it(installed):
    """A job's process that has exited but not been reaped (its parent looks later) holds no
    lease and no GPU context: the freed device is usable at once, not after the reap."""
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    proc = inst.start("recon", "--hold", "30", CUDA_VISIBLE_DEVICES=gpus[0])
    ready_line(proc)
    refresh_once(inst.layout)
    os.kill(proc.pid, signal.SIGKILL)  # not waited for: a zombie
    wait_for(lambda: open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z")
    seen = snapshot.read_fresh(str(inst.layout.root))
    assert seen.by_uuid(gpus[0]).pids == ()
    proc.wait()


@contextlib.contextmanager
def monitoring(inst):  # type: ignore[no-untyped-def]
    """A thread rewriting the snapshot meanwhile, as the monitor service would."""
    stop = threading.Event()
    failed = []

    def loop() -> None:
        try:
            while not stop.is_set():
                refresh_once(inst.layout)
                time.sleep(0.1)
        except BaseException as exc:  # said at the end: a dead loop leaves a stale snapshot
            failed.append(exc)

    thread = threading.Thread(target=loop)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    assert failed == [], f"the monitor loop died: {failed}"


def test_a_foreign_process_on_a_leased_device_still_counts_once_the_lease_is_free(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    inst.write_config(f'[devices]\nallow = ["{gpus[0]}"]\n')
    lessee = inst.start("recon", "--hold", "30")
    ready_line(lessee)
    inst.machine.add_process(4242, gpus[0], 2048)  # started by hand beside the lessee
    with monitoring(inst):
        waiter = inst.start("recon", "--log", str(inst.log), CUDAWRAP_WAIT="3")
        assert b"waiting" in waiter.stderr.readline()
        refresh_once(inst.layout)
        lessee.kill()
        lessee.wait()
        # The device's lease is free, but 4242 still runs there: as without the monitor, wait.
        assert waiter.wait(timeout=30) == 75, waiter.stderr.read()
        r = run_without_nvml(inst, "recon", CUDAWRAP_WAIT="0")
        assert r.returncode == 75, r.stdout
    assert inst.jobs() == []


def test_two_threads_writing_the_snapshot_at_once_never_fail(installed):
    """The service's threads, or a test's monitor loop beside a refresh of its own, write the
    same root files: a temporary name per process alone made one's rename find the other's
    already gone (CannotWrite), and a monitor loop died of it, its snapshot going stale."""
    inst = installed("four-gpus")
    errors = []

    def write() -> None:
        try:
            for _ in range(300):
                refresh_once(inst.layout)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert snapshot.read_fresh(str(inst.layout.root)) is not None
    assert [n for n in os.listdir(inst.layout.runtime_dir) if n.endswith(".tmp")] == []


def test_burst_with_the_monitor_running_never_shares_a_device(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    with monitoring(inst):
        procs = [inst.start("recon", "--hold", "0.2", "--log", str(inst.log)) for _ in range(35)]
        assert [p.wait(timeout=120) for p in procs] == [0] * 35
    from support.installed import overlaps

    assert overlaps(inst.jobs()) == []


def test_monitor_gives_new_devices_a_lease_file(installed):
    inst = installed("a100-mig7")
    migs = inst.machine.leaf_uuids()
    new_uuid = "MIG-99999999-1111-2222-3333-444444444444"
    inst.machine.write(inst.machine.read().replace(migs[3], new_uuid))
    refresh_once(inst.layout)
    assert (inst.layout.lease_dir / new_uuid).exists()


def test_monitor_removes_the_snapshot_when_nvml_goes(installed):
    inst = installed("a100-mig7")
    refresh_once(inst.layout)
    assert inst.layout.usage_snapshot.exists()
    inst.machine.set_fault("driver_not_loaded")
    assert "not loaded" in refresh_once(inst.layout)
    assert not inst.layout.usage_snapshot.exists()


def test_monitor_rebuilds_a_stale_policy_cache(installed):
    from cudawrap.policy import effective as policy

    inst = installed("a100-mig7")
    root = str(inst.layout.root)
    assert policy.cache_is_current(root)
    inst.write_config("[policy]\nwait = 5\n")
    assert not policy.cache_is_current(root)
    refresh_once(inst.layout)
    assert policy.cache_is_current(root)
    assert policy.effective(root, None).wait == 5.0


@root_only
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
def test_another_users_process_hidden_by_hidepid_still_counts(mu):  # type: ignore[no-untyped-def]
    """Where /proc hides other users' processes (hidepid=2), a user's launch cannot read a
    foreign process's start: it counts until the kernel says it is gone (signal 0)."""
    inst = mu("four-gpus")
    gpu = inst.machine.leaf_uuids()[0]
    job = subprocess.Popen([str(FAKECUDA), "--hold", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           env=inst.machine.environ(CUDA_VISIBLE_DEVICES=gpu))
    ready_line(job)
    refresh_once(inst.layout)
    code = (f"import json, os, sys; sys.path[:0] = {inst.world.path!r}; from cudawrap.devices import snapshot; "
            f"print(json.dumps([os.path.exists('/proc/{job.pid}'), "
            f"snapshot.read_fresh({str(inst.layout.root)!r}).by_uuid({gpu!r}).pids]))")
    as_alice = shlex.join(inst.world.alice.argv([inst.world.python, "-I", "-c", code]))
    private_proc = ["unshare", "-m", "sh", "-c", f"mount -t proc -o hidepid=2 proc /proc && exec {as_alice}"]

    def alice_sees() -> list:  # type: ignore[type-arg]
        done = subprocess.run(private_proc, env=inst.environ(), capture_output=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    try:
        assert alice_sees() == [False, [job.pid]]  # hidden from her, and still counted
    finally:
        job.kill()
        job.wait()
    assert alice_sees() == [False, []]  # gone: the kernel says so
