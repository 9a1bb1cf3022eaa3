"""Shared runs under [service] enforce = true, with real accounts: the service grants shares.

A share is sent as two descriptors, the device's lease file (the client locks it shared) and
one of its slot files (locked exclusively), so the kernel's lock table shows each share as
a run deciding for itself holds it; users cannot open slot files themselves. Who holds what
is read from the lock table and the ledger, not from anything the runs say.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Iterator, List

import pytest

from cudawrap.base import posixacl
from support.installed import ready_line, waiting_line
from support.procs import cli_code, wait_for
from test_enforce import ENFORCE, runs_with_the_service
from test_mps import control_dir, mu_mps, share_beside_a_stranger  # noqa: F401 - a fixture

from test_service import Served, _ledger, run_nested, run_spawner
from test_sharing import share_pids
from support.procs import root_only
from support.users import MuInstall

pytestmark = [pytest.mark.root, root_only]


def configure(inst: MuInstall, text: str, devices: int = 1) -> List[str]:
    """Enforce, TEXT and an allow-list of the first DEVICES devices (returned), synced."""
    allowed = inst.machine.leaf_uuids()[:devices]
    allow = ", ".join(f'"{u}"' for u in allowed)
    inst.layout.config_file.write_text(ENFORCE.format(retry=2) + text + f"\n[devices]\nallow = [{allow}]\n")
    inst.layout.config_file.chmod(0o644)
    runs_with_the_service(inst)
    inst.sync()
    return allowed


@pytest.fixture
def serving() -> Iterator[List[Served]]:
    """The services a test starts, stopped after it."""
    started: List[Served] = []
    yield started
    for served in started:
        served.proc.terminate()
        served.proc.wait(timeout=10)


def slot_holders(inst: MuInstall, uuid: str, slots: int) -> Dict[int, List[int]]:
    """slot -> the pid that took each lock on UUID's slot file now (from /proc/locks)."""
    from cudawrap.lease.files import lock_table

    table = lock_table()
    out = {}
    for k in range(1, slots + 1):
        st = os.stat(inst.layout.share_dir / f"{uuid}.{k}")
        out[k] = [pid for pid, exclusive in table.get((st.st_dev, st.st_ino), []) if exclusive]
    return out


def test_two_users_share_a_device_through_the_service_and_a_third_waits_for_a_slot(mu, serving) -> None:
    inst = mu("four-gpus")
    alice, bob, carol = inst.world.alice, inst.world.bob, inst.world.carol
    (d0,) = configure(inst, "[sharing]\nslots = 2\n")
    serving.append(Served(inst))
    a = inst.start(alice, "recon", "--hold", "600", CUDAWRAP_SHARE="1")
    b = inst.start(bob, "recon", "--hold", "600", CUDAWRAP_SHARE="1")
    assert ready_line(a)["cvd"] == ready_line(b)["cvd"] == d0
    # Each holds the lease file shared and a slot file of its own, by its own process's locks.
    assert sorted(share_pids(inst.layout.lease_dir)[d0]) == sorted([a.pid, b.pid])
    assert sorted(pid for pids in slot_holders(inst, d0, 2).values() for pid in pids) == sorted([a.pid, b.pid])
    # Status shows them as it shows shares taken without the service, to another user too.
    (device,) = [d for d in inst.status(carol)["devices"] if d["uuid"] == d0]
    assert device["shares"]["used"] == 2, device
    assert sorted((h["user"], h["pid"]) for h in device["shares"]["holders"]) == \
        sorted([(alice.name, a.pid), (bob.name, b.pid)])
    c = inst.start(carol, "recon", "--hold", "0", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="60")
    assert "every device it may share is full" in waiting_line(c)
    a.kill()
    a.wait()
    assert ready_line(c)["cvd"] == d0
    assert c.wait(timeout=30) == 0, c.stderr.read()
    b.kill()


def test_shares_count_towards_their_users_limit_through_the_service(mu, serving) -> None:
    """Two shares of 1/2 fill a limit of 1: alice's third waits on her limit though a
    device has room, while bob's share is granted there."""
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    d0, d1 = configure(inst, "[sharing]\nslots = 2\n\n[limits]\nmax_devices_per_user = 1\n", devices=2)
    serving.append(Served(inst))
    held = [inst.start(alice, "recon", "--hold", "600", CUDAWRAP_SHARE="1") for _ in range(2)]
    assert {ready_line(p)["cvd"] for p in held} == {d0}  # fullest first
    third = inst.run(alice, "recon", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="0")
    assert third.returncode == 75 and b"your limit is 1" in third.stderr, third.stderr
    other = inst.run(bob, "recon", "--hold", "0", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="0")
    assert other.returncode == 0, other.stderr
    assert json.loads(other.stdout.splitlines()[0])["cvd"] == d1
    for p in held:
        p.kill()


HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
"""


def test_a_user_cannot_take_a_slot_file_past_the_service(mu, serving) -> None:
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    (d0,) = configure(inst, "[sharing]\nslots = 2\n")
    serving.append(Served(inst))
    a = inst.start(alice, "recon", "--hold", "600", CUDAWRAP_SHARE="1")
    assert ready_line(a)["cvd"] == d0
    taken = [k for k, pids in slot_holders(inst, d0, 2).items() if pids == [a.pid]]
    assert len(taken) == 1
    free = inst.layout.share_dir / f"{d0}.{3 - taken[0]}"
    for user in (alice, bob):  # the free slot, and alice's own
        for slot in (free, inst.layout.share_dir / f"{d0}.{taken[0]}"):
            tried = inst.py(user, HOLD, str(slot))
            assert tried.returncode != 0 and b"PermissionError" in tried.stderr, tried.stderr
    # The one free slot is still the service's to give.
    b = inst.run(bob, "recon", "--hold", "0", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="0")
    assert b.returncode == 0, b.stderr
    a.kill()


def test_a_shared_runs_child_keeps_its_share(mu, serving) -> None:
    """[policy] share = true (the service's own reading of the policy): the wrapped `outer`
    execs the wrapped `inner`, which runs in its parent's share, granted once. Bob's share
    keeps the lease file locked throughout, so the end is seen by the slot."""
    inst = mu("four-gpus")
    (d0,) = configure(inst, "[policy]\nshare = true\n\n[sharing]\nslots = 2\n")
    serving.append(Served(inst))
    bob = inst.start(inst.world.bob, "recon", "--hold", "600")
    assert ready_line(bob)["cvd"] == d0
    done = run_nested(inst)
    assert json.loads(done.stdout.decode().splitlines()[0])["cvd"] == d0
    alice = inst.world.alice.uid
    wait_for(lambda: [r["uid"] for r in _ledger(inst, "end")] == [alice])
    (grant,) = [r for r in _ledger(inst, "grant") if r["uid"] == alice]
    assert (grant["program"], grant["shared"], grant["devices_held"]) == ("outer", True, 0.5), grant
    bob.kill()


def test_a_share_passed_to_a_background_child_ends_when_the_child_lets_go(mu, serving) -> None:
    inst = mu("four-gpus")
    (d0,) = configure(inst, "[sharing]\nslots = 2\n")
    serving.append(Served(inst))
    bob = inst.start(inst.world.bob, "recon", "--hold", "600", CUDAWRAP_SHARE="1")
    assert ready_line(bob)["cvd"] == d0
    end = run_spawner(inst, CUDAWRAP_SHARE="1")  # bob's share keeps the lease file locked meanwhile
    assert end["uid"] == inst.world.alice.uid and end["shared"], end
    bob.kill()


def _environment(path: Path) -> Dict[str, str]:
    """What fakecuda --env-out wrote, less the lease marker (descriptor numbers)."""
    pairs = (item.partition(b"=") for item in path.read_bytes().split(b"\0") if item)
    env = {k.decode(): v.decode() for k, _sep, v in pairs}
    marker = env.pop("CUDAWRAP_LEASE")
    assert len(marker.split(":")) == 3, marker  # a share: lease descriptor, device, slot descriptor
    return env


def test_an_mps_share_through_the_service_gets_what_a_share_deciding_for_itself_gets(
        mu_mps: MuInstall, tmp_path: Path, serving) -> None:  # noqa: F811 - the fixture
    inst = mu_mps
    (d0,) = configure(inst, '[sharing]\nmode = "mps"\nslots = 2\n')
    started = inst.cli(None, "mps", "start", PATH=f"{control_dir(tmp_path / 'mpsbin')}:/usr/bin:/bin")
    assert started.returncode == 0, started.stderr
    serving.append(Served(inst))
    own, via = inst.dir / "own.env", inst.dir / "via.env"
    for path in (own, via):
        path.touch()
        path.chmod(0o666)
    # Root decides for itself under enforce; alice's run is served.
    alone = inst.run(None, "recon", "--hold", "0", "--env-out", str(own), CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="30")
    assert alone.returncode == 0, alone.stderr
    served = inst.run(inst.world.alice, "recon", "--hold", "0", "--env-out", str(via), CUDAWRAP_SHARE="1",
                      CUDAWRAP_WAIT="30")
    assert served.returncode == 0, served.stderr
    hello = json.loads(served.stdout.splitlines()[0])
    assert hello["devices"] == [d0] and hello["mps_server"] is not None, hello
    assert hello["mps"]["CUDA_MPS_PIPE_DIRECTORY"] == str(inst.layout.mps_dir / d0), hello
    env = _environment(via)
    assert env == _environment(own)
    assert {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            "XLA_PYTHON_CLIENT_MEM_FRACTION"} <= set(env), env


def test_a_restarted_service_follows_a_share_its_predecessor_granted_to_its_end(mu, serving) -> None:
    """kill -9 of the service: alice's share runs on (its locks are hers); the restarted
    service finds her slot in the lock table and records her end, though bob's share keeps
    the device's lease file locked."""
    inst = mu("four-gpus")
    (d0,) = configure(inst, "[sharing]\nslots = 2\n")
    first = Served(inst)
    held = {user.uid: inst.start(user, "recon", "--hold", "600", CUDAWRAP_SHARE="1")
            for user in (inst.world.alice, inst.world.bob)}
    assert {ready_line(p)["cvd"] for p in held.values()} == {d0}
    first.proc.kill()
    first.proc.wait()
    serving.append(Served.__new__(Served))
    again = serving[0]
    again.inst, again.link, again.sock = inst, first.link, first.sock

    again.proc = inst.start(None, inst.world.python, "-I", "-c",
                            cli_code(inst.path), "serve")
    assert b"listening on" in again.proc.stdout.readline()
    alice = inst.world.alice.uid
    held[alice].kill()
    held[alice].wait()
    wait_for(lambda: [(r["uid"], r["seen_by"]) for r in _ledger(inst, "end")] == [(alice, "service")])
    held[inst.world.bob.uid].kill()


def test_an_mps_client_without_a_share_keeps_the_services_shares_off_its_device(
        mu_mps: MuInstall, tmp_path: Path, serving) -> None:  # noqa: F811 - the fixture
    """Carol connects to the device's MPS daemon without a share while alice holds one there:
    the service reads NVML again before it adds alice's next share (MPS would make it wait
    behind carol's client), as a share deciding for itself does; once carol's client is gone
    it grants it. The pipe directory keeps carol out (test_mps_access.py): here root lets her
    in, as a client connected before enforce was turned on stays connected."""
    inst = mu_mps
    alice = inst.world.alice
    (d0,) = configure(inst, '[sharing]\nmode = "mps"\nslots = 2\n')
    started = inst.cli(None, "mps", "start", PATH=f"{control_dir(tmp_path / 'mpsbin')}:/usr/bin:/bin")
    assert started.returncode == 0, started.stderr
    serving.append(Served(inst))
    pipe = inst.layout.mps_dir / d0
    share, stranger, _hello = share_beside_a_stranger(inst, d0, admit=lambda: os.setxattr(
        pipe, posixacl.XATTR, posixacl.owner_and_users(posixacl.RWX, [alice.uid, inst.world.carol.uid])))
    done = inst.run(alice, "recon", "--hold", "0", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="0", timeout=20)
    assert done.returncode == 75 and b"no free device" in done.stderr, (done.stdout, done.stderr)
    stranger.kill()
    stranger.wait()
    done = inst.run(alice, "recon", "--hold", "0", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="30", timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["devices"] == [d0]
    share.kill()
