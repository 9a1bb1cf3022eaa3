"""Faults from outside: a full or read-only disk under the registry, NVML failing while
shims wait, MIG reconfigured under running jobs, a runtime directory lost at reboot.

Disk faults are injected with strace into the real command (``-e inject=…:error=ENOSPC``)
at its first call on the registry's temporary file; NVML faults come from the simulated
machine (tests/fakenvml/FORMAT.md).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import List

import pytest

from support.installed import Installed, waiting_line
from cudawrap.policy import registry
from cudawrap.admin.divert import Dpkg
from cudawrap.monitor.loop import refresh_once
from cudawrap.admin.unwrap import unwrap_programs
from cudawrap.admin.wrap import wrap_programs
from support.admin import Admin, snapshot
from support.strace import inject, needs_strace, traced
from support.procs import wait_for

NO_DPKG = Dpkg(available=False)

# --- the disk fills up or turns read-only while the registry is written -------------------

FAULTS = [  # (system call on the registry's temporary file, errno, what the one line says)
    ("write", "ENOSPC", "No space left on device"),
    ("openat", "EROFS", "Read-only file system"),
    ("rename", "EROFS", "Read-only file system"),
    ("rename", "ENOSPC", "No space left on device"),
]


def _registry_call(calls, admin: Admin, syscall: str):  # type: ignore[no-untyped-def]
    """The command's first SYSCALL on the registry's temporary file (not the .bak copy's)."""
    tmp = f"{admin.layout.registry_file}.tmp"
    for call in calls:
        if call.syscall.startswith(syscall) and (f'"{tmp}"' in call.text or f"<{tmp}>" in call.text):
            return call
    raise AssertionError(f"no {syscall} on {tmp} in {[c.text for c in calls]}")


@needs_strace
@pytest.mark.parametrize("command", ["create", "unwrap"])
def test_registry_write_fails_and_the_old_registry_stays(admin: Admin, command: str) -> None:
    """Disk full or read-only at the registry's first write: the command fails with one line
    saying why, the registry is byte for byte what it was, and nothing else changed."""
    other = admin.program("other")
    prog = admin.program("recon")
    assert not wrap_programs(admin.layout, [str(other)], {"gpus": 2}, dpkg=NO_DPKG, user="root").failed
    if command == "create":
        argv = admin.argv(str(prog), prog="create-cudawrap")
    else:
        assert not wrap_programs(admin.layout, [str(prog)], {}, dpkg=NO_DPKG, user="root").failed
        argv = admin.argv("unwrap", str(prog))
    # List the command's calls once, then put everything back as it was.
    tree_before = snapshot(admin.bindir)
    _, calls = traced(argv, admin.environ(), Path("/"))
    if command == "create":
        assert not unwrap_programs(admin.layout, [str(prog)], dpkg=NO_DPKG).failed
    else:
        assert not wrap_programs(admin.layout, [str(prog)], {}, dpkg=NO_DPKG, user="root").failed
    assert snapshot(admin.bindir) == tree_before
    reg_before = admin.layout.registry_file.read_bytes()
    for syscall, errno_name, words in FAULTS:
        call = _registry_call(calls, admin, syscall)
        result, hit = inject(argv, call, f"error={errno_name}", admin.environ(), Path("/"))
        where = f"{errno_name} at {call.text}"
        assert hit is not None and hit.args() == call.args() and "(INJECTED)" in hit.text, (where, hit)
        assert result.returncode != 0, where
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in result.stderr, (where, result.stderr)
        assert str(admin.layout.registry_file) in lines[0], where
        assert admin.layout.registry_file.read_bytes() == reg_before, where  # byte for byte
        assert not os.path.exists(f"{admin.layout.registry_file}.tmp"), where
        assert snapshot(admin.bindir) == tree_before, where  # the wrap (or unwrap) did not happen
        assert admin.run(prog, "x").stdout == "recon x\n", where
    assert admin.cli("doctor").returncode == 0


# --- NVML failing mid-run -------------------------------------------------------------------




def _starts(inst: Installed) -> List[dict]:
    return [j for j in inst.jobs() if j["event"] == "start"]


@pytest.mark.parametrize("foreign", ["avoid", "ignore"])
def test_a_waiting_shim_is_not_handed_a_gpu_lost_meanwhile(installed, foreign: str) -> None:
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpu = inst.machine.leaf_uuids()[0]
    inst.allow(gpu, extra=f'[policy]\nforeign = "{foreign}"\n')
    holder, _ = inst.hold()
    waiter = inst.start("recon", "--log", str(inst.log), CUDAWRAP_WAIT="20")
    waiting_line(waiter)
    inst.machine.set_fault("gpu_lost", gpu)
    holder.kill()
    holder.wait()
    assert waiter.wait(timeout=20) == 75
    lines = waiter.stderr.read().decode().splitlines()
    assert len(lines) == 1 and "gone" in lines[0], lines
    assert len(_starts(inst)) == 1  # only the holder ever ran on it
    status = json.loads(inst.cli("status", "--json").stdout)
    assert status["lost"] == ["index 0"]  # NVML cannot even tell a lost GPU's UUID
    inst.sync()
    assert (inst.layout.lease_dir / gpu).exists()  # kept: a lost GPU's jobs may still hold it


def test_driver_unloaded_follows_the_policy_in_one_line(installed) -> None:
    inst = installed("four-gpus")
    inst.wrap("recon")
    holder, info = inst.hold()
    inst.machine.set_fault("driver_not_loaded")
    r = inst.run("recon")  # no_driver = "run" (the default): one warning, a lease by the lease files
    assert r.returncode == 0
    assert [line for line in r.stderr.decode().splitlines()] == [
        "recon: warning: the NVIDIA driver is not loaded; "
        "leasing by the lease files alone (processes on the devices unseen)"]
    assert json.loads(r.stdout.splitlines()[0])["cvd"] != info["devices"][0]  # not the held one
    inst.write_config('[policy]\nno_driver = "fail"\n')
    r = inst.run("recon")
    assert r.returncode == os.EX_UNAVAILABLE
    lines = r.stderr.decode().splitlines()
    assert lines[0] == "recon: the NVIDIA driver is not loaded" and len(lines) <= 2, lines
    # sync cannot see the devices: it says so and keeps every lease file (one is held).
    leases = sorted(os.listdir(inst.layout.lease_dir))
    r = inst.cli("sync")
    assert r.returncode == os.EX_UNAVAILABLE
    assert r.stdout.decode().startswith("warning: the NVIDIA driver is not loaded")
    assert sorted(os.listdir(inst.layout.lease_dir)) == leases
    # status still shows who holds what, from the lease files alone.
    r = inst.cli("status", "--json")
    assert r.returncode == 0
    held = {d["uuid"]: d["holder"] for d in json.loads(r.stdout)["devices"]}
    assert held[info["devices"][0]]["pid"] == holder.pid
    holder.kill()


def test_no_permission_hides_processes_but_nothing_breaks(installed) -> None:
    inst = installed("a100-mig7")
    inst.wrap("recon")
    inst.machine.set_fault("no_permission", "all")
    holder, info = inst.hold()
    r = inst.cli("status", "--json")
    assert r.returncode == 0, r.stderr
    devices = {d["uuid"]: d for d in json.loads(r.stdout)["devices"]}
    assert all(d["foreign_pids"] is None for d in devices.values())  # "unknown", not "none"
    assert devices[info["devices"][0]]["holder"]["pid"] == holder.pid
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["devices"] != info["devices"]
    holder.kill()


def test_slow_nvml_init_is_paid_by_the_monitor_not_by_launches(installed) -> None:
    inst = installed("a100-mig7")
    inst.wrap("recon")
    inst.machine.set_fault("slow_init", "1500")
    t0 = time.monotonic()
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 0 and time.monotonic() - t0 >= 1.5  # without a snapshot: pays the wait
    assert refresh_once(inst.layout) is None  # the monitor pays it once
    # Now an init would take ten minutes: a launch that ends at all within run()'s timeout
    # never initialised NVML. (How fast it is, is bench/'s figure, not a test's.)
    inst.machine.set_fault("slow_init", "600000")
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 0, r.stderr
    assert r.stderr == b""


# --- MIG reconfigured while jobs run -------------------------------------------------------

NEW_MIG = "MIG-00000000-1111-2222-3333-444444444444"


def test_mig_reconfigured_under_a_running_job(installed) -> None:
    """Slot 6's instance is destroyed and a new one created in its place while a job holds
    the old one: sync adds the new lease file but keeps the held one; the old instance is
    never handed out again; once its job ends, the next sync removes its file."""
    inst = installed("a100-mig7")
    inst.wrap("recon")
    migs = inst.machine.leaf_uuids()
    old = migs[6]
    holder, _ = inst.hold(CUDA_VISIBLE_DEVICES=old)
    inst.machine.write(inst.machine.read().replace(old, NEW_MIG))
    inst.sync()
    assert (inst.layout.lease_dir / old).exists()  # still held: removing it would let a second job in
    assert (inst.layout.lease_dir / NEW_MIG).exists()
    inst.allow(old, NEW_MIG)
    for _ in range(2):
        r = inst.run("recon", CUDAWRAP_WAIT="0")
        assert json.loads(r.stdout.splitlines()[0])["devices"] == [NEW_MIG], r.stderr
    inst.allow(old)
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 75 and b"only 0 can be used here" in r.stderr
    holder.kill()
    holder.wait()
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 75  # free now, but gone: still never handed out
    inst.sync()
    assert not (inst.layout.lease_dir / old).exists()


@pytest.mark.parametrize("holder_registers", [True, False], ids=["cuda-holder", "plain-holder"])
def test_a_waiter_is_not_handed_an_instance_removed_meanwhile(installed, tmp_path, holder_registers: bool) -> None:
    """A shim waits for slot 6; MIG is reconfigured (slot 6 now holds a new instance) and
    the holder exits before any sync: the waiter must not be granted the old UUID (the
    lease file of which still exists) on the strength of what NVML says about the slot."""
    inst = installed("a100-mig7")
    inst.wrap("recon")
    if not holder_registers:  # a program NVML never lists (no CUDA context): nothing looks busy
        plain = tmp_path / "plain"
        plain.write_text("#!/bin/sh\necho ready\nexec sleep 30\n")
        plain.chmod(0o755)
        inst.wrap("plain", plain)
    old = inst.machine.leaf_uuids()[6]
    inst.allow(old)
    if holder_registers:
        holder, _ = inst.hold()
    else:
        holder = inst.start("plain")
        assert holder.stdout.readline() == b"ready\n"
    waiter = inst.start("recon", "--log", str(inst.log), CUDAWRAP_WAIT="20")
    waiting_line(waiter)
    inst.machine.write(inst.machine.read().replace(old, NEW_MIG))
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    code = waiter.wait(timeout=20)
    out, err = waiter.stdout.read(), waiter.stderr.read().decode()
    assert code == 75, (code, out, err)
    assert "gone" in err and len(err.splitlines()) == 1, err
    assert not [j for j in _starts(inst) if j["pid"] == waiter.pid]


# --- the runtime directory is gone (a reboot without the tmpfiles entry) -------------------


def test_missing_runtime_directory_hints_at_sync_everywhere(installed) -> None:
    inst = installed("four-gpus")
    inst.wrap("recon")
    shutil.rmtree(inst.layout.runtime_dir)
    r = inst.run("recon")
    assert r.returncode == os.EX_OSFILE
    lines = r.stderr.decode().splitlines()
    assert "is missing" in lines[0] and "cudawrap sync" in lines[1] and len(lines) == 2, lines
    r = inst.cli("run", "--", "/bin/true")
    assert r.returncode == os.EX_OSFILE, r.stderr
    assert b"cudawrap sync" in r.stderr and b"Traceback" not in r.stderr
    r = inst.cli("status")
    assert r.returncode == 0 and b"Traceback" not in r.stderr
    assert b"no lease file (run `cudawrap sync`)" in r.stdout
    assert inst.cli("sync").returncode == 0
    assert inst.run("recon").returncode == 0


# --- NVML failing after a good init; a full runtime filesystem --------------------------------


def _stderr_lines(proc) -> List[str]:  # type: ignore[no-untyped-def]
    return proc.stderr.read().decode().splitlines()


@pytest.mark.parametrize("call", ["device_count", "driver_version"])
def test_nvml_failing_after_init_is_one_line_everywhere(installed, call: str) -> None:
    inst = installed("four-gpus")
    inst.wrap("recon")
    inst.machine.set_fault("fails", call)
    r = inst.run("recon")  # no_driver = "run": a lease by the lease files, one warning
    assert r.returncode == 0, r.stderr
    assert r.stderr.decode().splitlines() == [
        "recon: warning: NVML started but cannot list the devices: Unknown Error; "
        "leasing by the lease files alone (processes on the devices unseen)"]
    assert json.loads(r.stdout.splitlines()[0])["cvd"] in inst.machine.leaf_uuids()
    inst.write_config('[policy]\nno_driver = "fail"\n')
    r = inst.run("recon")
    assert r.returncode == os.EX_UNAVAILABLE
    assert r.stderr.decode().splitlines()[0] == "recon: NVML started but cannot list the devices: Unknown Error"
    r = inst.cli("monitor", "--once")
    assert r.returncode == os.EX_UNAVAILABLE
    assert r.stderr.decode().splitlines() == [
        "cudawrap monitor: NVML started but cannot list the devices: Unknown Error"]
    for args in (["status"], ["sync"]):
        r = inst.cli(*args)
        assert b"Traceback" not in r.stderr and r.returncode in (0, os.EX_UNAVAILABLE), (args, r.stderr)


def _monitor(inst: Installed, *strace: str):  # type: ignore[no-untyped-def]
    code = "from cudawrap.cli import main; main()"
    return inst.start(*strace, sys.executable, "-c", code, "monitor", "--period", "0.05",
                      PYTHONDONTWRITEBYTECODE="1")


def _until_fresh(inst: Installed, proc) -> None:  # type: ignore[no-untyped-def]
    from cudawrap.devices.snapshot import read_fresh

    def fresh() -> bool:
        assert proc.poll() is None, _stderr_lines(proc)
        return read_fresh(str(inst.layout.root), max_age=0.5) is not None

    wait_for(fresh, 30, "a snapshot from the monitor")


# Said once where there is no syslog (a container, CI): not what these tests are about.
AUDIT_NOTICE = "cudawrap: warning: /dev/log is missing"


def _first_line(proc) -> str:  # type: ignore[no-untyped-def]
    """The monitor's first line on stderr other than the missing-syslog notice."""
    while True:
        line = proc.stderr.readline().decode()
        if not line.startswith(AUDIT_NOTICE):
            return line


def test_the_monitor_logs_an_nvml_failure_and_keeps_going(installed) -> None:
    inst = installed("four-gpus")
    inst.machine.set_fault("fails", "device_count")
    proc = _monitor(inst)
    try:
        line = _first_line(proc)
        assert line.startswith("cudawrap: NVML started but cannot list the devices"), line
        inst.machine.clear_fault("fails")
        _until_fresh(inst, proc)  # it was still running, and picked up again
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert b"Traceback" not in proc.stderr.read()


@needs_strace
def test_a_full_runtime_filesystem_is_one_line_and_the_monitor_goes_on(installed) -> None:
    inst = installed("four-gpus")
    # The first three renames (the ledger's state or the snapshot's replace) fail as on a
    # full filesystem; then it has room.
    proc = _monitor(inst, "strace", "-f", "-o", "/dev/null", "-e", "trace=rename",
                    "-e", "inject=rename:error=ENOSPC:when=1..3")
    try:
        line = _first_line(proc)
        assert "No space left on device" in line and str(inst.layout.root) in line, line
        _until_fresh(inst, proc)
    finally:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:  # the monitor, under strace
            for pid in f.read().split():
                os.kill(int(pid), signal.SIGTERM)
        proc.wait(timeout=10)
    assert b"Traceback" not in proc.stderr.read()
    for args in (["sync"], ["monitor", "--once"]):
        code = "from cudawrap.cli import main; main()"
        r = inst.run("strace", "-f", "-o", "/dev/null", "-e", "trace=rename",
                     "-e", "inject=rename:error=ENOSPC", sys.executable, "-c", code, *args,
                     PYTHONDONTWRITEBYTECODE="1")
        lines = [ln for ln in r.stderr.decode().splitlines() if not ln.startswith(AUDIT_NOTICE)]
        assert r.returncode == os.EX_CANTCREAT, (args, lines)
        assert lines[0].startswith("cudawrap: cannot write ") and lines[0].endswith(
            ": No space left on device"), lines
        assert b"Traceback" not in r.stderr


def test_sync_removes_from_the_queue_directory_what_no_waiter_holds(installed) -> None:
    import fcntl

    inst = installed("four-gpus")
    queue = inst.layout.queue_dir
    old = time.time() - 3600
    (queue / "junk").write_bytes(b"x" * 4096)
    (queue / "link").symlink_to("/etc/passwd")
    os.mkfifo(queue / "fifo")
    os.link(inst.layout.lease_dir / inst.machine.leaf_uuids()[0], queue / "hardlink")
    (queue / "held").write_bytes(b"")
    (queue / "new").write_bytes(b"")  # just made: may be a waiter's entry about to be locked
    for name in ("junk", "link", "fifo", "hardlink", "held"):
        os.utime(queue / name, (old, old), follow_symlinks=False)
    fd = os.open(queue / "held", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a live waiter's entry
        r = inst.cli("sync")
        assert r.returncode == 0, r.stderr
        assert sorted(os.listdir(queue)) == ["held", "new"]
        assert "removed 4 file(s) from the queue directory" in r.stdout.decode()
        assert os.path.exists("/etc/passwd") and (inst.layout.lease_dir / inst.machine.leaf_uuids()[0]).exists()
    finally:
        os.close(fd)
