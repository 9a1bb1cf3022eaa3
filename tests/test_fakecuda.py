"""The stand-in CUDA program: device selection, registration, logging, environment."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from support import fakecuda
from support.machine import FAKECUDA, FakeMachine, TOPOLOGIES, pid_alive, read_environ_file
from support.procs import Spawned, root_only


def symbols(topo: fakecuda.Topology) -> Dict[str, str]:
    """G0, G1, ... for GPUs by NVML index; G2.4 for the MIG instance in slot 4 of GPU 2."""
    out: Dict[str, str] = {}
    for index, gpu in enumerate(topo.gpus):
        out[f"G{index}"] = gpu.uuid
        for mig in gpu.instances:
            out[f"G{index}.{mig.slot}"] = mig.uuid
    return out


def ready(name: str, *extra: str, driver: Optional[str] = None) -> fakecuda.Topology:
    text = (TOPOLOGIES / f"{name}.topo").read_text()
    if driver:
        text = "\n".join(f"driver {driver}" if line.startswith("driver ") else line for line in text.splitlines())
    return fakecuda.parse_topology(text + "\n" + "\n".join(extra) + "\n")


FOUR = ready("four-gpus")
MIG7 = ready("a100-mig7")  # R550: one MIG device per process
MIXED = ready("mixed")  # R570: several
MIXED_R550 = ready("mixed", driver="550.54.15")

# (topology, CUDA_VISIBLE_DEVICES with {symbols}, devices expected as symbols)
CASES = {
    "unset": (FOUR, None, "G0 G1 G2 G3"),
    "empty": (FOUR, "", ""),
    "blank": (FOUR, "  ", ""),
    "indices": (FOUR, "2,0", "G2 G0"),
    "indices-with-blanks": (FOUR, " 3 , 1", "G3 G1"),
    "gpu-uuid": (FOUR, "{G3}", "G3"),
    "unique-prefix": (FOUR, "GPU-5e7f6,GPU-a", "G0 G2"),
    "ambiguous-prefix": (FOUR, "3,GPU-5e7f,0", "G3"),
    "bare-gpu-prefix": (FOUR, "GPU-", ""),
    "mig-uuid": (MIG7, "{G0.3}", "G0.3"),
    "legacy-mig-spelling": (MIG7, "MIG-{G0}/9/0", "G0.2"),
    "invalid-entry-stops-list": (FOUR, "0,2,-1,1", "G0 G2"),
    "index-out-of-range": (FOUR, "1,4,0", "G1"),
    "garbage-entry": (FOUR, "1,cuda0,0", "G1"),
    "empty-entry": (FOUR, "1,,0", "G1"),
    "duplicate-stops-list": (FOUR, "1,{G1},2", "G1"),
    "unknown-uuid": (FOUR, "2,GPU-ffffffff-0000-0000-0000-000000000000,0", "G2"),
    "pre-r570-single-mig": (MIG7, "{G0.4},{G0.1}", "G0.4"),
    "pre-r570-unset": (MIG7, None, "G0.0"),
    "pre-r570-index-of-mig-gpu": (MIG7, "0", "G0.0"),
    "pre-r570-whole-gpus-unaffected": (MIXED_R550, "{G2.2},0,{G2.4},1", "G2.2 G0 G1"),
    "r570-multiple-mig": (MIXED, "{G2.4},{G2.0}", "G2.4 G2.0"),
    "r570-unset": (MIXED, None, "G0 G1 G2.0 G2.2 G2.4"),
    "r570-index-of-mig-gpu": (MIXED, "2", "G2.0 G2.2 G2.4"),
    "r570-gpu-uuid-of-mig-gpu": (MIXED, "{G2}", "G2.0 G2.2 G2.4"),
    "mig-gpu-without-instances": (MIXED, "3,1", "G1"),
    "driver-not-loaded": (ready("four-gpus", "fault driver_not_loaded"), None, ""),
}
# A MIG UUID must be given in full; an abbreviation is not a device.
CASES["mig-uuid-abbreviated"] = (MIG7, "{G0.5},MIG-" + symbols(MIG7)["G0.3"][4:12], "G0.5")


@pytest.mark.parametrize(("topo", "cvd", "expected"), list(CASES.values()), ids=list(CASES))
def test_cuda_visible_devices(topo: fakecuda.Topology, cvd: Optional[str], expected: str) -> None:
    names = symbols(topo)
    value = None if cvd is None else re.sub(r"\{([^}]+)\}", lambda m: names[m.group(1)], cvd)

    got = fakecuda.visible_devices(topo, value)

    assert got == [names[s] for s in expected.split()]


def test_lost_gpus_are_not_cuda_devices() -> None:
    g = symbols(FOUR)
    topo = ready("four-gpus", f"fault gpu_lost {g['G1']}")

    assert fakecuda.visible_devices(topo, None) == [g["G0"], g["G2"], g["G3"]]
    assert fakecuda.visible_devices(topo, "0,1,2") == [g["G0"]]


# ---- the program, end to end -------------------------------------------------------


def run(fake: FakeMachine, *args: str, cvd: Optional[str] = None, exe: Optional[List[str]] = None, **kw: Any) -> Any:
    cmd = (exe or [sys.executable, str(FAKECUDA)]) + list(args)
    return subprocess.run(cmd, env=fake.environ(CUDA_VISIBLE_DEVICES=cvd), capture_output=True, text=True, **kw)


def hello(done: Any) -> Dict[str, Any]:
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0])


def stop(proc: "subprocess.Popen[str]") -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    if proc.stdout:
        proc.stdout.close()


def test_prints_one_json_line_with_what_it_got(machine: Any) -> None:
    fake = machine("mixed")

    done = run(fake, "--exit", "3", cvd="2,0")

    assert done.returncode == 3
    out = hello(done)
    leaves = fake.leaf_uuids()
    assert out["devices"] == [leaves[2], leaves[3], leaves[4], leaves[0]]
    assert out["cvd"] == "2,0" and out["driver"] == "570.124.06" and out["pid"] > 0
    assert out["argv"] == [str(FAKECUDA), "--exit", "3"]
    assert list(fake.procs_dir.iterdir()) == []


def test_unset_cuda_visible_devices_is_null(machine: Any) -> None:
    fake = machine("four-gpus")

    out = hello(run(fake, cvd=None))

    assert out["cvd"] is None and out["devices"] == fake.leaf_uuids()


def test_require_fails_like_cuda_without_registering(machine: Any, tmp_path: Path) -> None:
    fake = machine("four-gpus")
    log = tmp_path / "log"

    done = run(fake, "--require", "2", "--log", str(log), "--hold", "30", cvd="3")

    assert done.returncode == 100
    assert "no CUDA-capable device is detected" in done.stderr
    assert hello(done)["devices"] == [fake.gpu_uuids()[3]]
    assert not log.exists() and list(fake.procs_dir.iterdir()) == []


def test_works_through_a_symlink_and_a_renamed_copy(machine: Any, tmp_path: Path) -> None:
    fake = machine("four-gpus")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    link = bindir / "train"
    link.symlink_to(FAKECUDA)
    renamed = bindir / "CUDAWRAP_train"
    shutil.copy2(FAKECUDA, renamed)
    # Straight through the shebang: python3 from PATH, the one running the tests first.
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"

    for exe in (link, renamed):
        done = subprocess.run(
            [str(exe), "--exit", "7"],
            env=fake.environ(CUDA_VISIBLE_DEVICES="1", PATH=path),
            capture_output=True,
            text=True,
        )
        assert done.returncode == 7, done.stderr
        out = hello(done)
        assert out["argv"] == [str(exe), "--exit", "7"]
        assert out["devices"] == [fake.gpu_uuids()[1]]


def test_registers_while_running_and_cleans_up_on_sigterm(machine: Any, tmp_path: Path) -> None:
    fake = machine("a100-mig7")
    mig = fake.leaf_uuids()[5]
    log = tmp_path / "log"
    proc = subprocess.Popen(
        [sys.executable, str(FAKECUDA), "--hold", "60", "--mem", "300", "--log", str(log)],
        env=fake.environ(CUDA_VISIBLE_DEVICES=mig),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        out = json.loads(proc.stdout.readline())
        registration = fake.procs_dir / str(proc.pid)
        assert out["pid"] == proc.pid
        assert registration.read_text() == f"{mig} {300 + fakecuda.CONTEXT_MIB}\n"  # with its context
        assert fake.compute_pids()[mig] == [proc.pid]

        proc.send_signal(signal.SIGTERM)

        assert proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        stop(proc)
    assert not registration.exists()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["event"] for r in records] == ["start", "end"]
    assert records[1]["signal"] == signal.SIGTERM and records[1]["devices"] == [mig]
    assert records[0]["time"] <= records[1]["time"]


def test_sigint_also_cleans_up(machine: Any) -> None:
    fake = machine("four-gpus")
    proc = subprocess.Popen(
        [sys.executable, str(FAKECUDA), "--hold", "60"],
        env=fake.environ(CUDA_VISIBLE_DEVICES="0"),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        assert (fake.procs_dir / str(proc.pid)).exists()

        proc.send_signal(signal.SIGINT)

        assert proc.wait(timeout=10) == -signal.SIGINT
    finally:
        stop(proc)
    assert list(fake.procs_dir.iterdir()) == []


def test_concurrent_log_appends_never_interleave(machine: Any, tmp_path: Path, spawned: Spawned) -> None:
    fake = machine("dgx-a100-mig56")
    # Many devices make long lines, which is where torn writes would show.
    fake.write(fake.read().replace("driver 535.161.08", "driver 570.124.06"))
    log = tmp_path / "log"
    procs = [
        spawned(
            [sys.executable, str(FAKECUDA), "--log", str(log), "--hold", "0.2"],
            env=fake.environ(CUDA_VISIBLE_DEVICES=None),
            stdout=subprocess.DEVNULL,
        )
        for _ in range(16)
    ]
    assert [p.wait(timeout=30) for p in procs] == [0] * 16

    lines = log.read_text().splitlines()

    records = [json.loads(line) for line in lines]
    assert len(records) == 32
    assert all(len(r["devices"]) == 56 for r in records)
    for p in procs:
        assert sorted(r["event"] for r in records if r["pid"] == p.pid) == ["end", "start"]


def test_env_out_is_the_exact_environment(machine: Any, tmp_path: Path) -> None:
    fake = machine("four-gpus")
    out = tmp_path / "env"
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "FAKENVML_TOPOLOGY": str(fake.topology),
        "ODD": "a=b=c \t \u00e9\u00e8",
        "EMPTY": "",
        "LANG": "C",  # Python then adds LC_CTYPE to os.environ (PEP 538), not to what it was given
    }

    done = subprocess.run([str(FAKECUDA), "--env-out", str(out)], env=env, capture_output=True)

    assert done.returncode == 0, done.stderr
    assert read_environ_file(out) == {k.encode(): v.encode() for k, v in env.items()}


def test_malformed_topology_is_reported(machine: Any) -> None:
    fake = machine("four-gpus")
    fake.write("driver 550.54.15\nfrobnicate\n")

    done = run(fake)

    assert done.returncode == 2 and "unknown keyword" in done.stderr


@root_only
def test_a_stand_in_of_another_user_is_alive_to_everybody(machine: Any, fakenvml_lib: Path, tmp_path: Path) -> None:
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' account")
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if system_python is None:
        pytest.skip("no system python3 that another user can run")
    # Everything the other user touches must be reachable by it: not under tmp_path (0700).
    shared = Path(os.environ.get("TMPDIR", "/tmp")) / f"fakecuda-{os.getpid()}-{time.monotonic_ns()}"
    shared.mkdir(mode=0o755)
    try:
        lib = shared / "lib"
        shutil.copytree(fakenvml_lib, lib)
        fake = FakeMachine(shared / "machine", lib).without_costs()
        fake.load("four-gpus")
        for path in (shared, lib, fake.root, fake.state_dir, fake.topology):
            path.chmod(0o755)
        script = shared / "fakecuda.py"
        shutil.copy2(FAKECUDA, script)
        script.chmod(0o755)
        env = fake.environ(CUDA_VISIBLE_DEVICES="2", PATH="/usr/bin:/bin")

        proc = subprocess.Popen(
            [system_python, str(script), "--hold", "60"], env=env, stdout=subprocess.PIPE, text=True, user=nobody.pw_uid
        )
        try:
            assert proc.stdout is not None
            json.loads(proc.stdout.readline())
            assert (fake.procs_dir / str(proc.pid)).stat().st_uid == nobody.pw_uid
            assert fake.compute_pids()[fake.gpu_uuids()[2]] == [proc.pid]
            # And a root-owned stand-in is alive to an unprivileged reader (kill() says EPERM).
            mine = subprocess.Popen(
                [system_python, str(script), "--hold", "60"],
                env=fake.environ(CUDA_VISIBLE_DEVICES="3", PATH="/usr/bin:/bin"),
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert mine.stdout is not None
                json.loads(mine.stdout.readline())
                check = subprocess.run(
                    [system_python, "-c", COUNT_PROCESSES, fake.gpu_uuids()[3]],
                    env=env,
                    capture_output=True,
                    text=True,
                    user=nobody.pw_uid,
                )
                assert check.stdout.split() == [str(mine.pid)], check.stderr
            finally:
                stop(mine)
        finally:
            stop(proc)
        assert not pid_alive(proc.pid)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# Bare ctypes, so that it runs under any python3 without pynvml.
COUNT_PROCESSES = """
import ctypes, sys
lib = ctypes.CDLL("libnvidia-ml.so.1")
class Info(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("mem", ctypes.c_ulonglong), ("gi", ctypes.c_uint), ("ci", ctypes.c_uint)]
assert lib.nvmlInit_v2() == 0
handle = ctypes.c_void_p()
assert lib.nvmlDeviceGetHandleByUUID(sys.argv[1].encode(), ctypes.byref(handle)) == 0
count = ctypes.c_uint(8)
infos = (Info * 8)()
assert lib.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(count), infos) == 0
print(" ".join(str(infos[i].pid) for i in range(count.value)))
"""
