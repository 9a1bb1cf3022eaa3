"""Sharing between real users: time slicing mixes users on a device, MPS never does.

Run as root with real accounts (tests/support/users.py) on the simulated machine. Who holds which
share is read from the kernel's lock table, not from anything the runs say about themselves.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

from support.installed import ready_line, waiting_line
from test_sharing import share_pids
from support.procs import root_only

pytestmark = root_only




def wrap_without_mps(inst) -> None:  # type: ignore[no-untyped-def]
    """`recon`: the stand-in CUDA program, minus the MPS connection.

    These tests check where cudawrap puts each user's shares (read from the lock table and the
    programs' own records); MPS daemons cannot run here, as the test install's paths exceed
    the 108 bytes of a unix socket's address (tests/test_mps.py runs them from a short path).
    """
    inst.wrap("realcuda")
    program = inst.dir / "recon-no-mps"
    program.write_text(f"#!/bin/sh\nunset CUDA_MPS_PIPE_DIRECTORY\nexec {inst.bindir}/CUDAWRAP_realcuda \"$@\"\n")
    program.chmod(0o755)
    inst.wrap("recon", program)


def share_users(inst) -> Dict[str, List[int]]:  # type: ignore[no-untyped-def]
    """uuid -> uid of each share held on it now."""
    return {uuid: sorted(os.stat(f"/proc/{pid}").st_uid for pid in pids)
            for uuid, pids in share_pids(inst.layout.lease_dir).items()}


def test_time_slicing_puts_two_users_on_one_device(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    d0, d1 = inst.machine.leaf_uuids()[:2]
    inst.configure("[sharing]\nslots = 2\n", d0, d1)
    a = inst.start(alice, "recon", "--hold", "600", CUDAWRAP_SHARE="1")
    b = inst.start(bob, "recon", "--hold", "600", CUDAWRAP_SHARE="1")
    assert ready_line(a)["devices"] == ready_line(b)["devices"]  # fill-first, whoever the user
    assert list(share_users(inst).values()) == [sorted([alice.uid, bob.uid])]
    seen = inst.status(bob)
    device = next(d for d in seen["devices"] if d["shares"])
    assert device["shares"]["used"] == 2  # bob sees alice's share counted (her pid may be hidden)


def test_mps_gives_each_device_to_one_user_at_a_time(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    wrap_without_mps(inst)
    d0, d1 = inst.machine.leaf_uuids()[:2]
    inst.configure('[sharing]\nslots = 4\nmode = "mps"\n', d0, d1)
    a1 = inst.start(alice, "recon", "--hold", "600", CUDAWRAP_SHARE="1")
    a_dev = ready_line(a1)["devices"]
    b1 = inst.start(bob, "recon", "--hold", "600", CUDAWRAP_SHARE="1")
    b_dev = ready_line(b1)["devices"]
    assert a_dev != b_dev  # bob is placed on the other device, not behind alice's MPS server
    a2 = inst.start(alice, "recon", "--hold", "600", CUDAWRAP_SHARE="1")
    assert ready_line(a2)["devices"] == a_dev  # alice's second run joins her own device
    # Both devices serve a user now: carol's shared run waits, though six slots are free ...
    carol = inst.world.carol
    c = inst.start(carol, "recon", "--hold", "0", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="60")
    assert "another user's runs (MPS" in waiting_line(c)
    for uuid, uids in share_users(inst).items():
        assert len(set(uids)) == 1, (uuid, uids)
    # ... until one user's runs have all left a device.
    b1.kill()
    b1.wait()
    assert c.wait(timeout=30) == 0
    for p in (a1, a2):
        p.kill()
        p.wait()


def test_a_burst_of_two_users_shares_under_mps_never_mixes_them(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    wrap_without_mps(inst)
    d0, d1 = inst.machine.leaf_uuids()[:2]
    inst.configure('[sharing]\nslots = 3\nmode = "mps"\n', d0, d1)
    procs, user_of = [], {}
    for i in range(16):
        user = alice if i % 2 else bob
        procs.append(inst.start(user, "recon", "--hold", "0.2", "--log", str(inst.log), CUDAWRAP_SHARE="1"))
        user_of[procs[-1].pid] = user.uid  # the shim execs the program: same pid
    assert [p.wait(timeout=120) for p in procs] == [0] * len(procs)
    # From the programs' own start and end records (a run that lost a race for a lock and
    # backed off never started): per device, never two users at once, never over 3 slots.
    records = [json.loads(line) for line in inst.log.read_text().splitlines()]
    assert len(records) == 2 * len(procs)
    events = []
    for r in records:
        for uuid in r["devices"]:
            events.append((r["time"], r["event"] == "start", uuid, user_of[r["pid"]]))
    on: Dict[str, List[int]] = {}
    for _t, starting, uuid, uid in sorted(events, key=lambda e: (e[0], e[1])):
        if starting:
            on.setdefault(uuid, []).append(uid)
            assert len(on[uuid]) <= 3 and len(set(on[uuid])) == 1, (uuid, on[uuid])
        else:
            on[uuid].remove(uid)


HOLD_FILES = """
import fcntl, os, signal, sys
fds = [os.open(path, os.O_RDONLY) for path in sys.argv[1:]]
for fd in fds:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
signal.pause()
"""


def test_slots_locked_without_the_lease_are_shares_of_their_holder(mu) -> None:  # type: ignore[no-untyped-def]
    """A user who flocks every slot file of a device and not its lease file holds its shares:
    others' shared runs wait for them (not "given" a device they cannot take), status names
    the holder, the shares count towards the holder's limit, and doctor reports them."""
    inst = mu("four-gpus")
    bob, carol = inst.world.bob, inst.world.carol
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    inst.configure("[sharing]\nslots = 2\n\n[limits]\nmax_devices_per_user = 1\n", d0)
    slots = [str(inst.layout.share_dir / f"{d0}.{k}") for k in (1, 2)]
    squatter = inst.start(carol, inst.world.python, "-I", "-c", HOLD_FILES, *slots)
    assert squatter.stdout.readline() == b"held\n", squatter.stderr.read()

    seen = inst.status(None)
    (device,) = [d for d in seen["devices"] if d["uuid"] == d0]
    assert device["shares"] and device["shares"]["used"] == 2, device
    assert [(h["pid"], h["user"], h["lease"]) for h in device["shares"]["holders"]] == \
        [(squatter.pid, carol.name, False)] * 2
    text = inst.cli(None, "status").stdout.decode()
    assert f"2/2 shared: {carol.name} pid {squatter.pid} (slot only)" in text, text

    waiter = inst.start(bob, "recon", "--hold", "0", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="60")
    assert "every device it may share is full" in waiting_line(waiter)
    (entry,) = inst.status(bob)["waiting"]
    assert entry["pid"] == waiter.pid and "full" in entry["reason"], entry

    report = inst.cli(None, "doctor")
    out = report.stdout.decode() + report.stderr.decode()
    assert f"2 slot(s) locked without the lease" in out and f"pid {squatter.pid} of {carol.name}" in out, out

    # Carol's two shares (1/2 each) fill her limit of 1, with a device she could share free.
    d1 = inst.machine.leaf_uuids()[1]
    inst.configure("[sharing]\nslots = 2\n\n[limits]\nmax_devices_per_user = 1\n", d0, d1)
    done = inst.run(carol, "recon", CUDAWRAP_WAIT="0", CUDAWRAP_SHARE="1")
    assert done.returncode == 75 and b"your limit is 1" in done.stderr, done.stderr
    squatter.kill()
    assert waiter.wait(timeout=30) == 0, waiter.stderr.read()  # bob's run: on d0, once carol let go
