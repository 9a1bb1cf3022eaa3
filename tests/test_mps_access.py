"""Who reaches a device's MPS daemon under [service] enforce, with real accounts and the
stand-in MPS: the device's pipe directory is open to the users holding a share of it
through the service alone (an ACL the service sets at the grant and takes away at the
end), and a restarted service gives it back to the shares it follows. Read as the kernel
says: a user's own process tries the directory and the daemon's socket."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import List

import pytest

from cudawrap.base import posixacl
from support.installed import ready_line
from support.procs import cli_code, root_only, wait_for
from support.users import MuInstall, User
from test_enforce_shares import configure, serving  # noqa: F401 - a fixture
from test_mps import control_dir, mu_mps  # noqa: F401 - a fixture
from test_service import Served, _ledger

pytestmark = [pytest.mark.root, root_only]

MPS_SHARES = '[sharing]\nmode = "mps"\nslots = 2\n'
# As a user: list the pipe directory and ask its daemon through the socket; what stopped it.
REACH = """
import os, socket, sys
pipe = sys.argv[1]
try:
    os.listdir(pipe)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.path.join(pipe, "control"))
    s.sendall(b"CMD get_server_list\\n")
    s.shutdown(socket.SHUT_WR)
    s.recv(100)
    s.close()
    print("reached")
except PermissionError as exc:
    print("denied", exc.filename)
"""


def reach(inst: MuInstall, user: User, pipe: Path) -> str:
    done = inst.py(user, REACH, str(pipe))
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode().split()[0]


def named(pipe: Path) -> List[int]:
    """The uids the pipe directory's ACL names (none without one)."""
    try:
        return posixacl.users(os.getxattr(pipe, posixacl.XATTR))
    except OSError:
        return []


def _mps_started(inst: MuInstall, tmp_path: Path, config: str = MPS_SHARES) -> Path:
    """Enforce with MPS shares on the first device, its daemon started: its pipe directory."""
    (d0,) = configure(inst, config)
    started = inst.cli(None, "mps", "start", PATH=f"{control_dir(tmp_path / 'mpsbin')}:/usr/bin:/bin")
    assert started.returncode == 0, started.stderr
    return inst.layout.mps_dir / d0


def _share(inst: MuInstall, user: User, pipe: Path):  # type: ignore[no-untyped-def]
    """USER's MPS share of the device, running (its client connected): the process."""
    proc = inst.start(user, "recon", "--hold", "600", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="30")
    hello = ready_line(proc)
    assert hello["mps_server"] is not None and hello["mps"]["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe), hello
    return proc


def test_only_the_users_sharing_a_device_reach_its_mps_daemon(mu_mps: MuInstall, tmp_path: Path,
                                                               serving) -> None:  # noqa: F811
    inst = mu_mps
    alice, bob = inst.world.alice, inst.world.bob
    pipe = _mps_started(inst, tmp_path)
    serving.append(Served(inst))
    assert stat.S_IMODE(os.stat(pipe).st_mode) == 0o700 and os.stat(pipe).st_uid == 0
    assert reach(inst, alice, pipe) == "denied"  # no share yet
    share = _share(inst, alice, pipe)
    assert named(pipe) == [alice.uid]
    assert reach(inst, alice, pipe) == "reached"
    assert reach(inst, bob, pipe) == "denied"
    share.kill()
    share.wait()
    wait_for(lambda: named(pipe) == [], what="alice's name gone from the ACL")
    assert reach(inst, alice, pipe) == "denied"
    assert stat.S_IMODE(os.stat(pipe).st_mode) == 0o700


def test_a_users_access_lasts_until_her_last_share_of_the_device_ends(mu_mps: MuInstall, tmp_path: Path,
                                                                      serving) -> None:  # noqa: F811
    inst = mu_mps
    alice = inst.world.alice
    pipe = _mps_started(inst, tmp_path)
    serving.append(Served(inst))
    first, second = _share(inst, alice, pipe), _share(inst, alice, pipe)
    first.kill()
    first.wait()
    # The service has seen the first end once the ledger says so; her second share goes on.
    wait_for(lambda: len(_ledger(inst, "end")) == 1, what="the first share's end")
    assert named(pipe) == [alice.uid] and reach(inst, alice, pipe) == "reached"
    second.kill()
    second.wait()
    wait_for(lambda: named(pipe) == [], what="alice's name gone from the ACL")


def test_a_restarted_service_gives_the_pipe_directory_back_to_the_shares_it_follows(
        mu_mps: MuInstall, tmp_path: Path, serving) -> None:  # noqa: F811
    """kill -9 of the service while alice shares the device; meanwhile the directory names
    bob (a share that ended while no service ran): the new service names alice alone."""
    inst = mu_mps
    alice, bob = inst.world.alice, inst.world.bob
    pipe = _mps_started(inst, tmp_path)
    first = Served(inst)
    share = _share(inst, alice, pipe)
    first.proc.kill()
    first.proc.wait()
    os.setxattr(pipe, posixacl.XATTR, posixacl.owner_and_users(posixacl.RWX, [bob.uid]))
    again = inst.start(None, inst.world.python, "-I", "-c", cli_code(inst.path), "serve")
    serving.append(Served.__new__(Served))
    serving[0].proc = again
    assert b"listening on" in again.stdout.readline()
    assert named(pipe) == [alice.uid]
    assert reach(inst, alice, pipe) == "reached" and reach(inst, bob, pipe) == "denied"
    share.kill()
    share.wait()
    wait_for(lambda: named(pipe) == [], what="alice's name gone from the ACL")


def test_switching_to_daemonless_opens_the_pipe_directories_again(mu_mps: MuInstall, tmp_path: Path,
                                                              serving) -> None:  # noqa: F811
    inst = mu_mps
    alice, bob = inst.world.alice, inst.world.bob
    pipe = _mps_started(inst, tmp_path)
    served = Served(inst)
    share = _share(inst, alice, pipe)
    assert named(pipe) == [alice.uid] and reach(inst, bob, pipe) == "denied"
    share.kill()
    share.wait()
    served.proc.terminate()
    served.proc.wait(timeout=10)
    os.setxattr(pipe, posixacl.XATTR, posixacl.owner_and_users(posixacl.RWX, [alice.uid]))  # as if still held
    switched = inst.cli(None, "way", "daemonless")
    assert switched.returncode == 0, switched.stderr
    assert stat.S_IMODE(os.stat(pipe).st_mode) == 0o755
    with pytest.raises(OSError):
        os.getxattr(pipe, posixacl.XATTR)
    assert reach(inst, bob, pipe) == "reached"
