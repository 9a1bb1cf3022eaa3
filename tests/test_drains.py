"""Drain and resume: no new lease on a drained device, holders undisturbed, bad names refused."""
import json
import os
import sys
import time

import pytest

from support.installed import ready_line
from cudawrap.devices.model import Device
from cudawrap.sched.drains import covering, drained, undrained

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="drain is root's: these tests run the commands as root")


def status(inst) -> dict:  # type: ignore[no-untyped-def]
    done = inst.cli("status", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_drained_gpu_covers_its_mig_instances_now_and_later() -> None:
    drains = {"GPU-aaa": None}
    mig = Device("MIG-1", "1g.10gb", "GPU-aaa", 0, 1, 10, 0, ())
    later = Device("MIG-9", "3g.40gb", "GPU-aaa", 0, 2, 40, 0, ())  # made after the drain
    other = Device("GPU-bbb", "A100", "GPU-bbb", 1, None, 80, 0, ())
    assert covering(drains, mig.uuid, mig.parent_uuid) == "GPU-aaa"  # type: ignore[arg-type]
    assert undrained([mig, later, other], drains) == [other]  # type: ignore[arg-type]


def test_drain_by_index_prefix_and_uuid_then_resume(installed) -> None:  # type: ignore[no-untyped-def]
    inst = installed("four-gpus")
    gpus = inst.machine.gpu_uuids()
    done = inst.cli("drain", "1", gpus[2][:12], gpus[3], "--reason", "fan replacement")
    assert done.returncode == 0, done.stderr
    assert sorted(drained(str(inst.layout.root))) == sorted(gpus[1:])
    shown = status(inst)["drained"]
    assert shown[gpus[1]]["reason"] == "fan replacement" and shown[gpus[1]]["by"] == "root"
    table = inst.cli("status").stdout.decode()
    assert "DRAINED" in table and "fan replacement" in table
    # Only GPU 0 is left: a run gets it; a second one cannot be met and fails at once.
    recon = inst.wrap()
    first = inst.start(str(recon), "--hold", "30")
    assert ready_line(first)["devices"] == [gpus[0]]
    done = inst.run(str(recon), timeout=20, CUDAWRAP_WAIT="0")
    assert done.returncode == 75  # busy, and the drained ones are not even candidates
    first.kill()
    first.wait()
    # Asking for more devices than undrained ones exist: 75 at once, naming the drained.
    inst.write_config("[policy]\ngpus = 2\n")
    started = time.monotonic()
    done = inst.run(str(recon), timeout=20)
    assert done.returncode == 75, done.stderr
    line = done.stderr.decode().splitlines()[0]
    assert "drained" in line and gpus[1] in line, line
    assert time.monotonic() - started < 15  # it did not wait (forever) for a drained device
    done = inst.cli("resume", "1", "2", "3")
    assert done.returncode == 0, done.stderr
    assert drained(str(inst.layout.root)) == {}
    inst.write_config("")
    done = inst.run(str(recon))
    assert done.returncode == 0, done.stderr


def test_drain_wait_returns_when_the_holder_ends(installed) -> None:  # type: ignore[no-untyped-def]
    inst = installed("four-gpus")
    recon = inst.wrap()
    holder = inst.start(str(recon), "--hold", "30", CUDA_VISIBLE_DEVICES="0")
    got = ready_line(holder)["devices"]
    done = inst.cli("drain", "0", "--wait", "0.5")
    assert done.returncode == 75, done.stderr
    assert got[0] in done.stderr.decode() and f"pid {holder.pid}" in done.stderr.decode()
    waiter = inst.start(sys.executable, "-c", "from cudawrap.cli import main; main()", "drain", "0", "--wait")
    time.sleep(1.0)
    assert waiter.poll() is None  # still held: still waiting
    holder.terminate()
    holder.wait()
    assert waiter.wait(timeout=20) == 0
    assert b"none of them is held" in waiter.stdout.read()


@pytest.mark.parametrize("args, words", [
    (["drain"], "no device given"),
    (["drain", "7"], "no GPU with that index"),
    (["drain", "0-3"], "not a GPU index"),
    (["drain", "GPU-zzzz"], "no such device"),
    (["drain", "GPU-"], "not a GPU index"),
    (["drain", "0", "--wait", "-5"], "--wait"),
    (["resume", "99"], "no GPU with that index"),
    (["resume"], "no device given"),
])
def test_bad_device_arguments_are_one_line_and_change_nothing(installed, args, words) -> None:  # type: ignore[no-untyped-def]
    inst = installed("four-gpus")
    before = sorted(os.listdir(inst.layout.state_dir))
    done = inst.cli(*args)
    assert done.returncode == 64, (args, done.stderr)
    lines = done.stderr.decode().splitlines()
    assert words in lines[0] and len(lines) <= 2 and "Traceback" not in done.stderr.decode(), lines
    assert sorted(os.listdir(inst.layout.state_dir)) == before


def test_an_ambiguous_prefix_is_refused(installed) -> None:  # type: ignore[no-untyped-def]
    inst = installed("four-gpus")
    done = inst.cli("drain", "GPU-")
    assert done.returncode == 64
    common = os.path.commonprefix(inst.machine.gpu_uuids())
    if len(common) > 4:
        done = inst.cli("drain", common)
        assert done.returncode == 64 and "matches 4 devices" in done.stderr.decode()


def test_a_drains_file_anyone_could_have_written_is_ignored(installed) -> None:  # type: ignore[no-untyped-def]
    inst = installed("four-gpus")
    assert inst.cli("drain", "0").returncode == 0
    path = inst.layout.state_dir / "drains"
    assert len(drained(str(inst.layout.root))) == 1
    os.chmod(path, 0o666)
    assert drained(str(inst.layout.root)) == {}
    os.chmod(path, 0o644)
    os.chown(path, 12345, -1)
    assert drained(str(inst.layout.root)) == {}


def test_mig_instance_of_a_drained_gpu_is_resumed_through_its_gpu(both) -> None:  # type: ignore[no-untyped-def]
    way = both("a100-mig7")
    inst = way.inst
    gpu = inst.machine.gpu_uuids()[0]
    mig = inst.machine.leaf_uuids()[0]
    assert inst.cli("drain", gpu).returncode == 0
    recon = inst.bindir / "recon"
    done = inst.run(str(recon), timeout=20)
    assert done.returncode == 75 and "drained" in done.stderr.decode(), way
    done = inst.cli("resume", mig)
    assert done.returncode == 65 and f"cudawrap resume {gpu}" in done.stderr.decode()
    assert inst.cli("resume", gpu).returncode == 0
    assert inst.run(str(recon)).returncode == 0, way

