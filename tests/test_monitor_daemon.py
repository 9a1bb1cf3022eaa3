"""`cudawrap monitor --daemon` for installs without systemd, and what `cudawrap doctor` says about it."""
import os
import signal

import pytest

from cudawrap import locations as loc
from cudawrap.daemon import running
from corefix import wait_for


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
