"""The waiter (shims/cudawrap-wait.c): a run the service tells to wait goes on waiting in a
small C process, so that its hand-over is not an exec from the interpreter; everything it
cannot finish itself goes back to the shim, which finishes it as it always has.

Real accounts (alice, bob) and a root service, as in test_service.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from cudawrap.install.waiter import build_waiter, compiler
from cudawrap.paths import Layout
from support.installed import ready_line
from support.procs import cli_code, open_files, root_only, wait_for
from test_enforce_shares import _environment, configure, serving  # noqa: F401 - a fixture
from test_mps import control_dir, mu_mps  # noqa: F401 - a fixture
from test_service import Served, _locks_of, _status
from support.users import MuInstall

pytestmark = [pytest.mark.root, root_only]

ENVDUMP = """#!/bin/sh
# The environment the program was given, as NAME=VALUE lines, then hold a while.
env > "$1"
sleep "${2:-0}"
"""


@pytest.fixture
def served(mu) -> Iterator[Served]:
    s = Served(mu("four-gpus"))
    yield s
    if s.proc.poll() is None:
        s.proc.terminate()
    s.proc.wait(timeout=10)


def _exe(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


def _in_waiter(served: Served, run: subprocess.Popen) -> bool:
    return _exe(run.pid) == str(served.inst.layout.waiter)


def _catches(pid: int, signum: int) -> bool:
    """Whether PID has a handler for SIGNUM yet (an exec'd program sets its own a moment later)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _kill(procs: List[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def _envdump(served: Served) -> None:
    inst = served.inst
    script = inst.dir / "envdump.sh"
    script.write_text(ENVDUMP)
    inst.wrap("envdump", program=script)


def _environ(path: Path) -> Dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep:
            out[name] = value
    return out


def test_a_run_told_to_wait_waits_in_the_waiter_and_starts_as_a_run_granted_at_once(served: Served) -> None:
    inst = served.inst
    _envdump(served)
    holders = served.fill()
    waited_env, at_once_env = inst.dir / "waited.env", inst.dir / "at-once.env"
    for p in (waited_env, at_once_env):
        p.touch()
        os.chown(p, inst.world.alice.uid, -1)
    waiter = inst.start(inst.world.alice, "envdump", str(waited_env), CUDAWRAP_WAIT="60")
    assert "waiting for a device" in waiter.stderr.readline().decode()
    wait_for(lambda: _in_waiter(served, waiter))
    holders[1].kill()
    assert waiter.wait(timeout=30) == 0, waiter.stderr.read().decode()
    at_once = inst.run(inst.world.alice, "envdump", str(at_once_env), CUDAWRAP_WAIT="60")
    assert at_once.returncode == 0, at_once.stderr.decode()
    waited, direct = _environ(waited_env), _environ(at_once_env)
    # The device and the lease's descriptors are the grant's; everything else is the same.
    for env in (waited, direct):
        fd, _, uuid = env.pop("CUDAWRAP_LEASE").partition(":")
        assert fd.isdigit() and uuid == env.pop("CUDA_VISIBLE_DEVICES"), env
        assert env["CUDAWRAP_PROGRAM"] == "envdump"
    assert waited == direct
    assert "CUDAWRAP_RESUME" not in waited
    _kill(holders)


def test_a_run_granted_in_the_waiter_holds_its_device_by_its_own_lock(served: Served) -> None:
    inst = served.inst
    holders = served.fill()
    waiter = inst.start(inst.world.bob, "recon", "--hold", "30", CUDAWRAP_WAIT="60")
    assert "waiting for a device" in waiter.stderr.readline().decode()
    wait_for(lambda: _in_waiter(served, waiter))
    holders[0].kill()
    hello = ready_line(waiter)
    ino = os.stat(inst.layout.lease_dir / hello["cvd"]).st_ino
    assert any(line.split()[5].endswith(f":{ino}") for line in _locks_of(waiter.pid))
    # The connection to the service is the waiter's, not the program's.
    assert not [link for link in open_files(waiter.pid) if link.startswith("socket:")]
    _kill(holders + [waiter])


def test_verbose_says_the_device_as_the_shim_says_it(served: Served) -> None:
    inst = served.inst
    holders = served.fill()
    waiter = inst.start(inst.world.alice, "recon", CUDAWRAP_WAIT="60", CUDAWRAP_VERBOSE="1")
    assert "waiting for a device" in waiter.stderr.readline().decode()
    wait_for(lambda: _in_waiter(served, waiter))
    holders[0].kill()
    uuid = ready_line(waiter)["cvd"]
    assert waiter.stderr.readline().decode().startswith(f"recon: got {uuid} after ")  # as a run deciding for itself
    assert waiter.stderr.readline().decode() == f"recon: CUDA_VISIBLE_DEVICES={uuid} -> {inst.bindir}/CUDAWRAP_recon\n"
    holders[0].wait()
    assert waiter.wait(timeout=10) == 0  # its device free again (the run after it raced its exit)
    at_once = inst.run(inst.world.alice, "recon", CUDAWRAP_WAIT="0", CUDAWRAP_VERBOSE="1")
    assert at_once.stderr.decode() == f"recon: CUDA_VISIBLE_DEVICES={uuid} -> {inst.bindir}/CUDAWRAP_recon\n"
    _kill(holders[1:] + [waiter])


def _cancelled(served: Served) -> "tuple[int, str]":
    inst = served.inst
    holders = served.fill()
    waiter = served.waiting(inst.world.alice)
    done = inst.cli(None, "cancel", str(waiter.pid))
    assert done.returncode == 0, done.stderr.decode()
    code = waiter.wait(timeout=10)
    _kill(holders)
    return code, waiter.stderr.read().decode()


def test_a_refusal_reaches_a_run_in_the_waiter_as_the_shim_reports_it(served: Served) -> None:
    """Cancel: the waiter hands the refusal back to the shim, which says it as it does waiting itself."""
    from_waiter = _cancelled(served)
    served.inst.layout.waiter.unlink()
    from_shim = _cancelled(served)
    assert from_waiter == from_shim
    assert from_waiter[0] == os.EX_TEMPFAIL and from_waiter[1].startswith("recon: cancelled by root"), from_waiter


def test_ctrl_c_in_the_waiter_exits_130_and_leaves_no_waiter(served: Served) -> None:
    inst = served.inst
    holders = served.fill()
    waiter = served.waiting(inst.world.alice)
    wait_for(lambda: _in_waiter(served, waiter) and _catches(waiter.pid, signal.SIGINT))
    os.kill(waiter.pid, signal.SIGINT)
    assert waiter.wait(timeout=10) == 130
    wait_for(lambda: _status(inst, None)["waiting"] == [])
    _kill(holders)


def test_a_service_that_goes_away_hands_the_run_back_to_the_shim(served: Served) -> None:
    """kill -9 of the service: the waiter execs the shim, which goes the general way. The
    service made the directories root's (the only arbiter, however started), so the run waits
    for it (connect_retry_s) with its ticket, and is granted by the next one once a device is free."""
    inst = served.inst
    holders = served.fill()
    waiter = served.waiting(inst.world.alice)
    wait_for(lambda: _in_waiter(served, waiter))
    served.proc.kill()
    served.proc.wait()
    wait_for(lambda: not _in_waiter(served, waiter) and _exe(waiter.pid) != "")  # the shim's general way
    assert os.listdir(inst.layout.queue_dir) == []  # not a queue entry: it cannot decide for itself
    code = cli_code(inst.path)
    again = inst.start(None, inst.world.python, "-I", "-c", code, "serve")
    try:
        assert b"listening on" in again.stdout.readline()
        holders[3].kill()
        assert len(ready_line(waiter)["devices"]) == 1
    finally:
        again.terminate()
        again.wait(timeout=10)
    _kill(holders + [waiter])


def test_an_exec_that_fails_after_the_wait_is_reported_as_the_shim_reports_it(served: Served) -> None:
    inst = served.inst
    holders = served.fill()
    waiter = served.waiting(inst.world.alice)
    wait_for(lambda: _in_waiter(served, waiter))
    real = inst.bindir / "CUDAWRAP_recon"
    real.unlink()
    holders[0].kill()
    code = waiter.wait(timeout=30)
    err = waiter.stderr.read().decode()
    # The general way, given the lease, looks for the program (an unwrap may have put it back).
    got, _, err = err.partition("\n")
    assert code == 127 and got.startswith("recon: got ") and err.startswith(
        f"recon: the real program {real} is missing\n"), (code, got, err)
    assert err.count("\n") == 2 and "hint: " in err
    _kill(holders)


def test_an_mps_share_granted_in_the_waiter_gets_what_one_granted_at_once_gets(
        mu_mps: MuInstall, tmp_path: Path, serving) -> None:  # noqa: F811 - the fixture
    """A share waits for DONE (the service opens the MPS pipe directory to its user then)
    and gets the MPS variables of its slot, in the waiter as in the shim."""
    inst = mu_mps
    (d0,) = configure(inst, '[sharing]\nmode = "mps"\nslots = 2\n')
    started = inst.cli(None, "mps", "start", PATH=f"{control_dir(tmp_path / 'mpsbin')}:/usr/bin:/bin")
    assert started.returncode == 0, started.stderr
    served = Served(inst)
    serving.append(served)
    at_once, waited = inst.dir / "at-once.env", inst.dir / "waited.env"
    for path in (at_once, waited):
        path.touch()
        path.chmod(0o666)
    alice = inst.world.alice
    first = inst.run(alice, "recon", "--hold", "0", "--env-out", str(at_once), CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="60")
    assert first.returncode == 0, first.stderr
    holders = [inst.start(alice, "recon", "--hold", "600", CUDAWRAP_SHARE="1") for _ in range(2)]
    for h in holders:
        ready_line(h)
    run = inst.start(alice, "recon", "--hold", "0", "--env-out", str(waited), CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="60")
    assert "waiting" in run.stderr.readline().decode()
    wait_for(lambda: _in_waiter(served, run))
    holders[0].kill()
    hello = ready_line(run)
    assert hello["devices"] == [d0] and hello["mps_server"] is not None, hello
    assert run.wait(timeout=30) == 0
    assert _environment(waited) == _environment(at_once)
    _kill(holders)


@pytest.mark.parametrize("how", ["absent", "another owner's", "group-writable"])
def test_the_shim_waits_itself_where_the_waiter_is_not_the_installs_own(served: Served, how: str) -> None:
    inst = served.inst
    waiter_file = inst.layout.waiter
    if how == "absent":
        waiter_file.unlink()
    elif how == "another owner's":
        os.chown(waiter_file, inst.world.alice.uid, -1)
    else:
        waiter_file.chmod(0o775)
    holders = served.fill()
    waiter = served.waiting(inst.world.bob)
    assert "python" in os.path.basename(_exe(waiter.pid))
    holders[2].kill()
    assert len(ready_line(waiter)["devices"]) == 1
    _kill(holders + [waiter])


def test_the_waiter_refuses_to_be_started_by_anything_but_the_shim(served: Served) -> None:
    done = subprocess.run([str(served.inst.layout.waiter), "3", "recon"], capture_output=True)
    assert done.returncode == os.EX_USAGE
    assert done.stderr.decode().count("\n") == 1 and "cudawrap shim" in done.stderr.decode()


def test_an_install_without_a_compiler_has_no_waiter_and_says_so(tmp_path: Path, monkeypatch) -> None:
    layout = Layout(tmp_path)
    said: List[str] = []
    assert build_waiter(layout, said.append)
    assert layout.waiter.stat().st_mode & 0o777 == 0o755
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.delenv("CC", raising=False)
    assert compiler() is None
    assert not build_waiter(layout, said.append)
    assert not layout.waiter.exists()  # an earlier build's waiter is not left to a newer shim
    assert "no C compiler" in said[-1] and "apt-get install gcc" in said[-1]


def test_the_waiters_constants_are_the_shims_and_the_wires() -> None:
    """The C side of the protocol keeps its own copies: they must not drift from wire.py and
    the shim's (a waiter with another lock retry or message bound would grant differently)."""
    import re

    import cudawrap
    from cudawrap import locations as loc, wire
    from cudawrap.install.waiter import source

    text = source().read_text()
    defines = dict(re.findall(r"^#define (\w+) (.+?)\s*(?:/\*.*)?$", text, re.M))
    assert defines["LAYOUT"] == f'"{cudawrap._WAITER_LAYOUT}"'
    assert defines["MAGIC"] == f'"{wire.MAGIC.decode()}"'
    assert eval(defines["MAX_MESSAGE"]) == wire.MAX_MESSAGE
    assert int(defines["MAX_FDS"]) == wire.MAX_FDS
    assert int(defines["LOCK_TRIES"]) == wire.LOCK_TRIES
    assert int(defines["LOCK_GAP_NS"].rstrip("L")) == round(wire.LOCK_GAP_S * 1e9)
    mps = re.search(r"MPS_VARIABLES\[\] = \{(.*?)\};", text, re.S)
    assert mps and tuple(re.findall(r'"(\w+)"', mps.group(1))) == tuple(v.decode() for v in cudawrap.MPS_VARIABLES)
    for name in (loc.LEASE_ENV, loc.PROGRAM_ENV, cudawrap._RESUME.decode(), "CUDA_VISIBLE_DEVICES"):
        assert f'"{name}"' in text, name
    for verb in (wire.WAIT, wire.ERROR, wire.GRANT, wire.DONE, wire.HELD, wire.LOST):
        assert f'"{verb}"' in text, verb
