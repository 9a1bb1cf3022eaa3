"""`cudawrap monitor --daemon` for installs without systemd, and what `cudawrap doctor` says about it."""
import os
import signal
import subprocess
import sys
import time

import pytest

from cudawrap import locations as loc
from cudawrap.base.daemon import running, stop
from support.procs import wait_for


@pytest.fixture
def daemon_pids():
    pids = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_daemon_keeps_the_snapshot_and_refuses_a_second_one(installed, daemon_pids):
    inst = installed("a100-mig7")
    root = str(inst.layout.root)
    pid_file = loc.under(root, loc.MONITOR_PID)
    r = inst.cli("monitor", "--daemon")
    assert r.returncode == 0, r.stderr
    pid = running(pid_file)
    assert pid and pid > 0
    assert os.stat(pid_file).st_mode & 0o777 == 0o600  # a user's flock on it would block the monitor
    daemon_pids.append(pid)
    assert f"pid {pid}".encode() in r.stdout
    wait_for(inst.layout.usage_snapshot.exists)
    doctor = inst.cli("doctor")
    assert b"ok: monitor: running" in doctor.stdout, doctor.stdout

    again = inst.cli("monitor", "--daemon")
    assert again.returncode == 64
    assert f"already running (pid {pid}".encode() in again.stderr
    assert running(pid_file) == pid  # the refused start did not disturb it

    os.kill(pid, signal.SIGTERM)
    # The kernel drops the lock when the daemon exits: its pid file is never taken for a live one.
    wait_for(lambda: running(pid_file) is None)
    assert open(pid_file).read().strip() == str(pid)  # the file is still there
    inst.layout.usage_snapshot.unlink()
    doctor = inst.cli("doctor")
    assert b"note: monitor: not running: launches pay NVML themselves" in doctor.stdout, doctor.stdout
    assert b"the devices it tries" in doctor.stdout  # sync left the layout cache


def test_doctor_says_when_launches_enumerate_every_device(installed):
    inst = installed("four-gpus")
    inst.layout.inventory_cache.unlink()
    doctor = inst.cli("doctor")
    assert b"each enumerates every device through NVML" in doctor.stdout, doctor.stdout


def test_stop_ends_the_daemon_and_waits_for_its_lock(installed, daemon_pids):
    """What install.sh --uninstall and the .deb's prerm use: the daemon is gone when it returns."""
    inst = installed("four-gpus")
    pid_file = loc.under(str(inst.layout.root), loc.MONITOR_PID)
    assert stop(pid_file) is None  # none runs: nothing to do, nothing signalled
    assert inst.cli("monitor", "--daemon").returncode == 0
    pid = running(pid_file)
    daemon_pids.append(pid)
    assert stop(pid_file) == pid
    assert running(pid_file) is None


def test_stop_says_when_the_holder_will_not_exit(tmp_path):
    """A holder that ignores SIGTERM is reported, not waited on forever (and not SIGKILLed)."""
    pid_file = tmp_path / "monitor.pid"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
fd = os.open({str(pid_file)!r}, os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
print("ready", flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "ready\n"
        with pytest.raises(TimeoutError, match=f"pid {holder.pid} did not exit"):
            stop(str(pid_file), wait_s=0.2)
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait()


def test_stop_never_signals_a_pid_reused_since_the_pid_file_was_written(tmp_path):
    """Issue 51 item 6: the pid a pid file names may belong to another process by the time
    it is read (the daemon ended, its pid reused). Here a holder keeps the file locked while
    it names a process started after the file was written: that process is never signalled."""
    pid_file = tmp_path / "service.pid"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys
fd = os.open({str(pid_file)!r}, os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("ready", flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    written = time.time() - 2  # the pid file's time: before the victim started
    victim = subprocess.Popen(["sleep", "60"])
    try:
        assert holder.stdout.readline() == "ready\n"
        pid_file.write_text(f"{victim.pid}\n")
        os.utime(pid_file, (written, written))
        with pytest.raises(PermissionError, match=f"pid {victim.pid} is not the daemon"):
            stop(str(pid_file), wait_s=0.5)
        assert victim.poll() is None
    finally:
        for proc in (holder, victim):
            proc.kill()
            proc.wait()
