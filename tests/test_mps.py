"""`cudawrap mps start|stop|status`, the cudawrap-mps unit, and the stand-in MPS they drive.

The daemons are tests/fakemps/nvidia-cuda-mps-control, put on PATH for the CLI; its clients
are tests/support/fakecuda.py with CUDA_MPS_PIPE_DIRECTORY set. Both are real processes: a daemon
per device, clients that connect, wait and die. The two-user rule of MPS is shown with two
real accounts (tests/support/users.py), run as root only.
"""
from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import pytest

from support.installed import Installed, ready_line
from support.procs import root_only, wait_for
from cudawrap.install import installation
from cudawrap.install.installation import MPS_UNIT, MONITOR_UNIT, SERVICE_UNIT, UNIT_NAME, render_mps_unit, unit_file, unit_wants_link
from cudawrap.paths import Layout
from support.machine import FAKECUDA, shutdown_nvml
from support.users import MuInstall, World

HERE = Path(__file__).resolve().parent
FAKEMPS = HERE / "fakemps" / "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"

# h100-a100mig-a6000: the first H100 whole, and one of the A100's MIG instances.
H100 = "GPU-7b2e4d10-3c5a-4f8e-9d21-0a6b8c4e2f11"
MIG0 = "MIG-0e1f2a3b-4c5d-5e6f-8a9b-0c1d2e3f4a01"
MPS_CONFIG = f"""\
[sharing]
mode = "mps"

[sharing.devices."{H100[:12]}"]
slots = 4

[sharing.devices."{MIG0}"]
slots = 2
"""


def control_dir(where: Path) -> Path:
    """A directory holding nvidia-cuda-mps-control: the stand-in, run by this interpreter."""
    where.mkdir(parents=True, exist_ok=True)
    where.chmod(0o755)
    script = where / "nvidia-cuda-mps-control"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKEMPS} "$@"\n')
    script.chmod(0o755)
    return where


def kill_daemons(*pipe_dirs: Path) -> None:
    """SIGTERM the daemons of PIPE_DIRS (and their servers): whatever a failed test left."""
    for pipe in pipe_dirs:
        try:
            pid = int((pipe / PID_FILE).read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        wait_for(lambda: not (pipe / PID_FILE).exists(), timeout=10)


class Mps:
    """An install on the mixed machine with the stand-in on PATH."""

    def __init__(self, inst: Installed, path: Path) -> None:
        self.inst = inst
        self.path = f"{path}:{os.environ.get('PATH', '/usr/bin:/bin')}"

    @property
    def layout(self) -> Layout:
        return self.inst.layout

    def cli(self, *args: str, **extra: Optional[str]) -> subprocess.CompletedProcess:
        extra.setdefault("PATH", self.path)
        return self.inst.cli(*args, **extra)

    def pipe(self, uuid: str) -> Path:
        return self.layout.mps_dir / uuid

    def control_log(self, uuid: str) -> str:
        return (self.layout.mps_log_dir / uuid / "control.log").read_text()

    def status(self) -> Dict[str, Dict]:
        r = self.cli("mps", "status", "--json")
        assert r.returncode == 0, r.stderr
        return {d["uuid"]: d for d in json.loads(r.stdout)["devices"]}

    def client(self, uuid: str, *args: str, **extra: Optional[str]) -> subprocess.Popen:
        return self.inst.start(sys.executable, str(FAKECUDA), *args, CUDA_MPS_PIPE_DIRECTORY=str(self.pipe(uuid)),
                               CUDA_VISIBLE_DEVICES=uuid, **extra)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """Short, for these tests and the fixtures they use: a daemon's socket is a file in its
    pipe directory, and a unix socket's address holds 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="cw", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def mps(installed: Callable[..., Installed], tmp_path: Path) -> Iterator[Mps]:
    inst = installed("h100-a100mig-a6000")
    inst.write_config(MPS_CONFIG)
    made = Mps(inst, control_dir(tmp_path / "mpsbin"))
    yield made
    if made.layout.mps_dir.is_dir():
        kill_daemons(*made.layout.mps_dir.iterdir())


def lines_of(r: subprocess.CompletedProcess) -> List[str]:
    return r.stdout.decode().splitlines()


def error_of(r: subprocess.CompletedProcess, code: int) -> List[str]:
    """The refusal's lines: one line saying what, and a hint."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.decode().splitlines()
    assert len(lines) == 2 and lines[1].startswith("hint: "), lines
    return lines


# ---- cudawrap mps ---------------------------------------------------------------------------


def test_start_status_stop(mps: Mps) -> None:
    """One daemon per shared device, seeing that device only; again is a no-op; stop ends all."""
    r = mps.cli("mps", "start")
    assert r.returncode == 0, r.stderr
    assert lines_of(r) == [f"{H100}: started", f"{MIG0}: started"]
    assert sorted(os.listdir(mps.layout.mps_dir)) == sorted([H100, MIG0])
    for uuid in (H100, MIG0):
        assert stat.S_IMODE(mps.pipe(uuid).stat().st_mode) == 0o755
        # NVIDIA's daemon leaves its pid file writable by everyone; start takes that away.
        assert stat.S_IMODE((mps.pipe(uuid) / PID_FILE).stat().st_mode) == 0o644
        assert f"CUDA_VISIBLE_DEVICES={uuid} devices={uuid}\n" in mps.control_log(uuid)
    pids = {uuid: (mps.pipe(uuid) / PID_FILE).read_text() for uuid in (H100, MIG0)}

    r = mps.cli("mps", "start")
    assert r.returncode == 0, r.stderr
    assert lines_of(r) == [f"{H100}: already running", f"{MIG0}: already running"]
    assert {uuid: (mps.pipe(uuid) / PID_FILE).read_text() for uuid in (H100, MIG0)} == pids

    devices = mps.status()
    assert set(devices) == {H100, MIG0}
    assert devices[H100]["slots"] == 4 and devices[MIG0]["slots"] == 2
    assert all(d["running"] and d["managed"] and d["servers"] == [] for d in devices.values())
    assert devices[H100]["pid"] == int(pids[H100])
    text = lines_of(mps.cli("mps", "status"))
    assert text[0].endswith('[sharing] mode = "mps" (' + str(mps.layout.config_file) + ":2); "
                            "2 device(s) shared through MPS, 2 control daemon(s) running"), text[0]
    assert re.match(rf"{H100}\s+4\s+pid {pids[H100].strip()}\s+-\s+-\s+0$", text[2]), text

    r = mps.cli("mps", "stop")
    assert r.returncode == 0, r.stderr
    assert lines_of(r) == [f"{H100}: stopped", f"{MIG0}: stopped"]
    assert os.listdir(mps.layout.mps_dir) == []
    assert "Control daemon exiting" in mps.control_log(H100)
    r = mps.cli("mps", "stop")
    assert r.returncode == 0 and lines_of(r) == ["no MPS control daemon to stop"], r.stderr
    devices = mps.status()
    assert not any(d["running"] for d in devices.values())


def test_clients_share_their_device_daemon_and_stop_waits_for_them(mps: Mps) -> None:
    assert mps.cli("mps", "start").returncode == 0
    clients = [mps.client(H100, "--hold", "3") for _ in range(2)]
    hellos = [ready_line(c) for c in clients]
    assert [h["devices"] for h in hellos] == [[H100], [H100]]
    assert hellos[0]["mps_server"] == hellos[1]["mps_server"]
    (server,) = mps.status()[H100]["servers"]
    assert (server["pid"], server["user"]) == (hellos[0]["mps_server"], "root")
    assert sorted(server["clients"]) == sorted(h["pid"] for h in hellos)

    r = mps.cli("mps", "stop")
    assert r.returncode == 0, r.stderr
    out = lines_of(r)
    assert out[0].startswith(f"{H100}: waiting for 2 running MPS client(s) to finish"), out
    assert out[1:] == [f"{H100}: stopped", f"{MIG0}: stopped"]
    assert [c.poll() for c in clients] == [0, 0]  # it returned once they had finished
    for c in clients:
        c.communicate()
    log = mps.control_log(H100)
    assert "PEAK clients=2" in log and "BLOCKED" not in log


def test_stop_also_ends_the_daemons_of_devices_shared_no_more(mps: Mps) -> None:
    assert mps.cli("mps", "start").returncode == 0
    mps.inst.write_config(MPS_CONFIG.split("[sharing.devices")[0])  # no device has 2 slots now
    devices = mps.status()
    assert {u: (d["managed"], d["running"]) for u, d in devices.items()} == {H100: (False, True),
                                                                           MIG0: (False, True)}
    assert "not shared now" in mps.cli("mps", "status").stdout.decode()
    r = mps.cli("mps", "start")
    assert r.returncode == 0 and "no MPS control daemon to start" in r.stdout.decode()

    mps.inst.write_config("")  # not even mps mode: stop still ends them
    r = mps.cli("mps", "stop")
    assert r.returncode == 0, r.stderr
    assert lines_of(r) == [f"{H100}: stopped", f"{MIG0}: stopped"]


def test_start_refuses_unless_mode_is_mps(mps: Mps) -> None:
    mps.inst.write_config("[sharing]\nslots = 2\n")
    what, hint = error_of(mps.cli("mps", "start"), 78)
    assert what == ('cudawrap: [sharing] mode is "time-slicing" (default), so no device is shared through MPS')
    assert f'set mode = "mps" under [sharing] in {mps.layout.config_file}' in hint
    assert not mps.layout.mps_dir.exists()
    r = mps.cli("mps", "status")
    assert r.returncode == 0 and '[sharing] mode = "time-slicing" (default)' in r.stdout.decode()


def test_missing_control_program(mps: Mps) -> None:
    what, hint = error_of(mps.cli("mps", "start", PATH="/usr/bin:/bin"), 69)
    assert what.startswith("cudawrap: nvidia-cuda-mps-control is not on PATH (")
    assert "nvidia-compute-utils" in hint


def test_a_daemon_that_does_not_start_is_reported_and_the_others_start(mps: Mps) -> None:
    # A stale daemon of another kind holds the lock of one pipe directory: -d fails there.
    import fcntl

    mps.pipe(H100).mkdir(parents=True)
    lock = os.open(mps.pipe(H100) / "control_lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        r = mps.cli("mps", "start")
    finally:
        os.close(lock)
    assert r.returncode == 69, r.stderr
    assert lines_of(r) == [f"{MIG0}: started"]
    assert r.stderr.decode().splitlines()[:2] == [
        f"{H100}: nvidia-cuda-mps-control -d failed: An instance of this daemon is already running",
        "cudawrap: 1 of 2 MPS control daemon(s) did not start"]


@pytest.mark.root
@root_only
def test_start_and_stop_need_root(mu: Callable[..., MuInstall]) -> None:
    inst = mu("h100-a100mig-a6000")
    alice = inst.world.alice
    for action in ("start", "stop"):
        r = inst.cli(alice, "mps", action)
        assert r.returncode == 77, r.stderr
        assert f"may {action} MPS control daemons; you are {alice.name}" in r.stderr.decode()
    r = inst.cli(alice, "mps", "status")
    assert r.returncode == 0, r.stderr


# ---- the cudawrap-mps unit --------------------------------------------------------------------


def test_mps_unit() -> None:
    unit = render_mps_unit(Layout(Path("/")))
    for line in ("Type=oneshot", "RemainAfterExit=yes", "After=cudawrap-sync.service",
                 "ExecStart=/opt/cudawrap/venv/bin/cudawrap mps start",
                 "ExecStop=/opt/cudawrap/venv/bin/cudawrap mps stop", "WantedBy=multi-user.target"):
        assert f"\n{line}\n" in unit, line
    assert (HERE.parent / "packaging" / MPS_UNIT).read_text() == unit, "packaging/ is stale: run `make packaging`"


def test_install_enables_the_mps_unit_only_in_mps_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """install.sh's Python half as under systemd: the unit is written always, enabled in mps mode."""
    layout = Layout(tmp_path / "root")
    layout.venv_dir.mkdir(parents=True)
    calls: List[List[str]] = []
    monkeypatch.setattr(installation, "systemd_running", lambda _layout: True)
    monkeypatch.setattr(installation, "systemctl", lambda *args: calls.append(list(args)))

    def install() -> List[str]:
        said: List[str] = []
        calls.clear()
        installation.install(layout, sys.executable, None, [], say=said.append, man_pages={}, refresh=lambda _: (),
                             way="service")  # as a root install runs
        return said

    said = install()
    assert unit_file(layout, MPS_UNIT).read_text() == render_mps_unit(layout)
    assert ["enable", UNIT_NAME] in calls and ["enable", "--now", SERVICE_UNIT] in calls
    assert not any(MONITOR_UNIT in call for call in calls)  # the service runs the monitor's loop
    assert not any(MPS_UNIT in call for call in calls)
    assert f'==> {MPS_UNIT} not enabled: [sharing] mode is not "mps" (once it is: ' \
           f"`systemctl enable --now {MPS_UNIT}`)" in said

    layout.config_file.write_text('[sharing]\nmode = "mps"\nslots = 2\n')
    said = install()
    assert ["enable", MPS_UNIT] in calls  # started by install.sh after `cudawrap sync`
    assert f"==> enabled {MPS_UNIT}: an MPS control daemon runs for each shared device" in said

    layout.config_file.write_text("")  # back to time-slicing, the unit still enabled
    unit_wants_link(layout, MPS_UNIT).parent.mkdir(parents=True, exist_ok=True)
    unit_wants_link(layout, MPS_UNIT).symlink_to(unit_file(layout, MPS_UNIT))
    said = install()
    assert not any(MPS_UNIT in call for call in calls)
    assert f'install.sh: warning: {MPS_UNIT} is enabled but [sharing] mode is not "mps": ' \
           f"`systemctl disable --now {MPS_UNIT}` stops its daemons" in said


# ---- the stand-ins -----------------------------------------------------------------------------


def fake(pipe: Path, *args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(pipe.parent / "log"),
                   **env)
    return subprocess.run([sys.executable, str(FAKEMPS), *args], input=stdin, env=environ, capture_output=True,
                          text=True, timeout=30)


def ready_within(proc: subprocess.Popen, seconds: float) -> Optional[dict]:
    """The client's ready line if it comes within SECONDS, else None (it still waits)."""
    if not select.select([proc.stdout], [], [], seconds)[0]:
        return None
    return json.loads(proc.stdout.readline())


def test_stand_in_daemon(machine: Callable, tmp_path: Path) -> None:
    fakemachine = machine("four-gpus")
    gpu = fakemachine.gpu_uuids()[2]
    pipe = tmp_path / "pipe"
    env = fakemachine.environ(CUDA_VISIBLE_DEVICES=gpu, CUDA_MPS_PIPE_DIRECTORY=str(pipe),
                              CUDA_MPS_LOG_DIRECTORY=str(tmp_path / "log"))
    try:
        r = subprocess.run([sys.executable, str(FAKEMPS), "-d"], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        r = subprocess.run([sys.executable, str(FAKEMPS), "-d"], env=env, capture_output=True, text=True)
        assert (r.returncode, r.stdout) == (1, "An instance of this daemon is already running\n")
        assert fake(pipe, stdin="get_server_list\n").stdout == ""
        daemon = int((pipe / PID_FILE).read_text())
        assert stat.S_IMODE((pipe / PID_FILE).stat().st_mode) == 0o666  # as NVIDIA's leaves it
        assert Path(f"/proc/{daemon}/comm").read_text() == "nvidia-cuda-mps\n"

        # A client: CUDA's device 0 is the daemon's device; it stays connected while it runs.
        client = subprocess.Popen([sys.executable, str(FAKECUDA), "--hold", "60"], stdout=subprocess.PIPE,
                                  env=dict(env, CUDA_VISIBLE_DEVICES="0", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25",
                                           CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=1000M"))
        hello = ready_line(client)
        assert hello["devices"] == [gpu] and hello["cvd"] == "0"
        assert hello["mps"] == {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(tmp_path / "log"),
                                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1000M"}
        server = hello["mps_server"]
        assert fake(pipe, stdin="get_server_list\n").stdout == f"{server}\n"
        assert fake(pipe, stdin=f"get_client_list {server}\n").stdout == f"{client.pid}\n"
        assert Path(f"/proc/{server}/comm").read_text() == "nvidia-cuda-mps\n"
        wait_for(lambda: fakemachine.compute_pids()[gpu] == sorted([server, client.pid]))  # NVML lists both

        # kill -9: the daemon notices; the idle server stays, as NVIDIA's does.
        client.kill()
        client.wait()
        client.stdout.close()
        wait_for(lambda: fake(pipe, stdin=f"get_client_list {server}\n").stdout == "")
        assert fake(pipe, stdin="get_server_list\n").stdout == f"{server}\n"

        # quit -t: the running client is cut off after the time; the server and the daemon
        # go, and so do the daemon's files.
        late = subprocess.Popen([sys.executable, str(FAKECUDA), "--hold", "60"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env)
        assert ready_line(late)["mps_server"] == server
        r = fake(pipe, stdin="quit -t 0.5\n")
        assert r.returncode == 0, r.stderr
        assert late.wait(timeout=10) == 1
        assert "cudaErrorMpsClientTerminated" in late.communicate()[1].decode()
        assert os.listdir(pipe) == []
        assert not Path(f"/proc/{server}").exists()
        r = fake(pipe, stdin="get_server_list\n")
        assert (r.returncode, r.stderr) == (1, "Cannot find MPS control daemon process\n")
        log = (tmp_path / "log" / "control.log").read_text()
        assert "PEAK clients=1" in log and f"CLIENT pid={client.pid} uid=0 disconnected" in log
    finally:
        kill_daemons(pipe)

    # No daemon there: the client fails as CUDA on an EXCLUSIVE_PROCESS device, registering nothing.
    done = subprocess.run([sys.executable, str(FAKECUDA), "--hold", "30"], env=env, capture_output=True, text=True)
    assert done.returncode == 46
    assert json.loads(done.stdout)["error"] == "cudaErrorDevicesUnavailable"
    assert "cannot connect to the MPS control daemon" in done.stderr
    assert fakemachine.registrations() == []

    # And without CUDA_MPS_* it is no MPS client at all.
    plain = fakemachine.environ(CUDA_VISIBLE_DEVICES=gpu)
    hello = json.loads(subprocess.run([sys.executable, str(FAKECUDA)], env=plain, capture_output=True,
                                      text=True).stdout)
    assert hello["mps"] is None and hello["mps_server"] is None and hello["devices"] == [gpu]


@pytest.mark.root
@root_only
def test_stand_in_serves_one_user_at_a_time(mu: Callable[..., MuInstall]) -> None:
    """A second user's client waits until the first user's clients are gone, kill -9 included."""
    inst = mu("four-gpus")
    gpu = inst.machine.gpu_uuids()[0]
    alice, bob = inst.world.alice, inst.world.bob
    program = str(inst.wrap("recon").parent / "CUDAWRAP_recon")
    pipe = inst.dir / "pipe"
    daemon_env = dict(inst.environ(CUDA_VISIBLE_DEVICES=gpu, CUDA_MPS_PIPE_DIRECTORY=str(pipe),
                                   CUDA_MPS_LOG_DIRECTORY=str(inst.dir / "log")))
    r = subprocess.run([sys.executable, str(FAKEMPS), "-d"], env=daemon_env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        first = inst.start(alice, program, "--hold", "60", CUDA_MPS_PIPE_DIRECTORY=str(pipe))
        hello = ready_line(first)
        assert hello["devices"] == [gpu]
        assert os.stat(f"/proc/{hello['mps_server']}").st_uid == alice.uid  # the server is alice's
        second = inst.start(alice, program, "--hold", "60", CUDA_MPS_PIPE_DIRECTORY=str(pipe))
        assert ready_within(second, 10)["mps_server"] == hello["mps_server"]  # same user: shares it

        waiting = inst.start(bob, program, "--hold", "60", CUDA_MPS_PIPE_DIRECTORY=str(pipe))
        assert ready_within(waiting, 1.0) is None
        log = inst.dir / "log" / "control.log"
        assert f"BLOCKED uid={bob.uid} pid={waiting.pid} behind uid={alice.uid}" in log.read_text()
        first.kill()
        assert ready_within(waiting, 1.0) is None  # alice's second client still runs
        second.kill()
        hello_bob = ready_within(waiting, 10)
        assert hello_bob is not None and hello_bob["devices"] == [gpu]
        assert os.stat(f"/proc/{hello_bob['mps_server']}").st_uid == bob.uid
        assert not Path(f"/proc/{hello['mps_server']}").exists()
        assert "PEAK clients=2" in log.read_text()
    finally:
        kill_daemons(pipe)


# ---- which MPS server is cudawrap's --------------------------------------------------------------


def test_an_idle_server_of_cudawraps_daemon_leaves_the_device_free(mps: Mps) -> None:
    """The server a daemon of `cudawrap mps start` keeps after its clients end is not work."""
    mps.inst.write_config(MPS_CONFIG + f'\n[devices]\nallow = ["{H100}"]\n')
    assert mps.cli("mps", "start").returncode == 0
    client = mps.client(H100, "--hold", "0")
    server = ready_line(client)["mps_server"]
    assert client.wait(timeout=30) == 0
    client.stdout.close()
    wait_for(lambda: mps.inst.machine.compute_pids().get(H100) == [server])  # idle, on the device
    mps.inst.wrap("recon")
    done = mps.inst.run("recon", CUDAWRAP_WAIT="0", PATH=mps.path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["devices"] == [H100]


def test_a_pid_file_naming_another_root_process_names_no_daemon(mps: Mps) -> None:
    """The pid file names the daemon only if that process runs nvidia-cuda-mps-control: one
    rewritten to name another process of root's (here the test's own) does not make that
    process's children MPS servers."""
    mps.inst.write_config(MPS_CONFIG + f'\n[devices]\nallow = ["{H100}"]\n')
    assert mps.cli("mps", "start").returncode == 0
    daemon = (mps.pipe(H100) / PID_FILE).read_text()
    (mps.pipe(H100) / PID_FILE).write_text(f"{os.getpid()}\n")  # root's, as NVIDIA's 0666 file allows
    mps.inst.wrap("recon")
    named = mps.inst.bindir / "nvidia-cuda-mps-server"
    named.symlink_to(mps.inst.bindir / "CUDAWRAP_recon")
    job = mps.inst.start(str(named), "--hold", "600", CUDA_VISIBLE_DEVICES=H100)
    pid = ready_line(job)["pid"]
    assert os.getppid() != pid and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1] == \
        str(os.getpid())  # its parent is the pid the file names
    wait_for(lambda: mps.inst.machine.compute_pids().get(H100) == [pid])
    done = mps.inst.run("recon", CUDAWRAP_WAIT="0", PATH=mps.path)
    (mps.pipe(H100) / PID_FILE).write_text(daemon)  # for the fixture, which stops the daemon it names
    assert done.returncode == 75 and b"no free device" in done.stderr, (done.stdout, done.stderr)
    job.kill()
    job.wait()


@pytest.mark.root
@root_only
@pytest.mark.parametrize("mode", ["time-slicing", "mps"])
def test_a_job_named_like_the_mps_server_is_another_users_work(mu: Callable[..., MuInstall], mode: str) -> None:
    """A program run through a link named nvidia-cuda-mps-server (its /proc comm says so) is not
    cudawrap's MPS server: only a child of the daemon cudawrap started for the device is."""
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    d0 = inst.machine.leaf_uuids()[0]
    inst.wrap("recon")
    inst.layout.config_file.write_text(f'[sharing]\nslots = 2\nmode = "{mode}"\n\n[devices]\nallow = ["{d0}"]\n')
    inst.layout.config_file.chmod(0o644)
    inst.sync()
    named = inst.dir / "nvidia-cuda-mps-server"
    named.symlink_to(inst.bindir / "CUDAWRAP_recon")
    job = inst.start(alice, str(named), "--hold", "600", CUDA_VISIBLE_DEVICES=d0)
    pid = ready_line(job)["pid"]
    assert Path(f"/proc/{pid}/comm").read_text() == "nvidia-cuda-mps\n"
    wait_for(lambda: inst.machine.compute_pids().get(d0) == [pid])
    for share in (None, "1"):
        done = inst.run(bob, "recon", CUDAWRAP_WAIT="0", CUDAWRAP_SHARE=share)
        assert done.returncode == 75, (share, done.stdout, done.stderr)
        assert b"no free device" in done.stderr, done.stderr


# ---- MPS clients that hold no share --------------------------------------------------------------


@pytest.fixture
def mu_mps(mu_world: World, monkeypatch: pytest.MonkeyPatch) -> Iterator[MuInstall]:
    """An install for real accounts at a path short enough for MPS's sockets."""
    directory = Path(tempfile.mkdtemp(prefix="cw", dir="/tmp"))
    directory.chmod(0o755)
    inst = MuInstall(mu_world, directory, "four-gpus", monkeypatch)
    yield inst
    if inst.layout.mps_dir.is_dir():
        kill_daemons(*inst.layout.mps_dir.iterdir())
    inst.close()
    shutil.rmtree(directory, ignore_errors=True)
    shutdown_nvml()


def share_beside_a_stranger(inst: MuInstall, uuid: str, admit: Callable[[], None] = lambda: None) -> tuple:
    """Alice holds a share of UUID whose program has not reached CUDA (yet), and carol an MPS
    client of UUID's daemon without a share: (alice's run, carol's, carol's ready line), once
    NVML shows carol's client on the device. ADMIT: what lets carol reach the daemon first."""
    idle = inst.dir / "idle"
    idle.write_text("#!/bin/sh\necho ready\nexec sleep 600\n")
    inst.wrap("idle", idle)
    share = inst.start(inst.world.alice, "idle", CUDAWRAP_SHARE="1")
    assert share.stdout.readline() == b"ready\n", share.stderr.read()
    admit()
    stranger = inst.start(inst.world.carol, str(inst.bindir / "CUDAWRAP_recon"), "--hold", "600",
                          CUDA_MPS_PIPE_DIRECTORY=str(inst.layout.mps_dir / uuid))
    hello = ready_line(stranger)
    wait_for(lambda: hello["pid"] in inst.machine.compute_pids().get(uuid, []))
    return share, stranger, hello


@pytest.mark.root
@root_only
def test_an_mps_client_without_a_share_is_shown_and_keeps_new_shares_off(mu_mps: MuInstall, tmp_path: Path) -> None:
    """Carol connects to a device's MPS daemon without a lease while alice holds a share there:
    status names carol's client, and alice's next share is not placed behind it (MPS would
    make it wait for carol's clients to end), until carol's client is gone."""
    inst = mu_mps
    alice, carol = inst.world.alice, inst.world.carol
    d0 = inst.machine.leaf_uuids()[0]
    inst.layout.config_file.write_text(f'[sharing]\nmode = "mps"\nslots = 2\n\n[devices]\nallow = ["{d0}"]\n')
    inst.layout.config_file.chmod(0o644)
    inst.sync()
    r = inst.cli(None, "mps", "start", PATH=f"{control_dir(tmp_path / 'mpsbin')}:/usr/bin:/bin")
    assert r.returncode == 0, r.stderr
    pipe = inst.layout.mps_dir / d0
    r = inst.run(carol, "sh", "-c", f"echo 1 > {pipe}/{PID_FILE}")  # naming another parent
    assert r.returncode != 0 and b"Permission denied" in r.stderr, r.stderr
    inst.wrap("recon")
    _share, stranger, hello = share_beside_a_stranger(inst, d0)
    assert os.stat(f"/proc/{hello['mps_server']}").st_uid == carol.uid

    for viewer in (None, alice):
        seen = inst.status(viewer)
        (device,) = [d for d in seen["devices"] if d["uuid"] == d0]
        assert [(p["pid"], p["user"]) for p in device["mps_without_share"]] == [(hello["pid"], carol.name)]
    text = inst.cli(alice, "status").stdout.decode()
    assert f"{d0}: MPS client(s) holding no share: {carol.name} pid {hello['pid']}" in text, text

    done = inst.run(alice, "recon", "--hold", "0", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="0", timeout=20)
    assert done.returncode == 75, (done.stdout, done.stderr)

    stranger.kill()
    stranger.wait()
    done = inst.run(alice, "recon", "--hold", "0", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="30", timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["devices"] == [d0]
    assert f"BLOCKED uid={alice.uid}" not in (inst.layout.mps_log_dir / d0 / "control.log").read_text()
