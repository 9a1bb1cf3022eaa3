"""Whose lease it is, when the process holding it is not the plain process that took it.

A user takes a lease and then execs a setuid program (its /proc/PID belongs to root), or
forks and lets the taker exit (the kernel's lock table names a dead pid). Limits, status
and metrics must count the lease for that user all the same. Real accounts (tests/support/users.py).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import List

import pytest

from support.procs import root_only
from support.users import MuInstall, User

pytestmark = [pytest.mark.root, root_only]

LIMIT_ONE = "[limits]\nmax_devices_per_user = 1\n"

# Waits for a signal, keeping every descriptor it was given: a setuid program such as su
# waiting for a password, small enough to build here.
SETUID_C = '#include <unistd.h>\nint main(void) { if (write(1, "up\\n", 3) != 3) return 1; pause(); return 0; }\n'

# argv: a program to exec once a device is leased (the lease's descriptor is inherited).
ACQUIRE_THEN_EXEC = r"""
import os, sys
sys.path[:0] = {path!r}
import cudawrap
cudawrap.acquire(1, wait=0)
os.execv(sys.argv[1], [sys.argv[1]])
"""

# Lease a device, hand it to a child and exit: the child holds the lease alone.
ACQUIRE_FORK_EXIT = r"""
import json, os, sys, time
sys.path[:0] = {path!r}
import cudawrap
from cudawrap.errors import NoDeviceError
try:
    devices = cudawrap.acquire(1, wait=0)
except NoDeviceError as exc:
    print(json.dumps({{"refused": str(exc)}}))
    sys.exit(75)
child = os.fork()
if child == 0:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    time.sleep(300)
    os._exit(0)
print(json.dumps({{"devices": devices, "child": child}}))
"""


def limit_one(inst: MuInstall) -> None:
    inst.layout.config_file.write_text(LIMIT_ONE)
    inst.layout.config_file.chmod(0o644)


def setuid_program(inst: MuInstall) -> Path:
    source = inst.dir / "waiter.c"
    source.write_text(SETUID_C)
    program = inst.dir / "waiter"
    subprocess.run(["cc", "-o", str(program), str(source)], check=True, capture_output=True)
    os.chown(program, 0, 0)
    program.chmod(0o4755)
    return program


def holder_users(inst: MuInstall) -> List[str]:
    done = inst.cli(None, "status", "--json")
    assert done.returncode == 0, done.stderr
    return [d["holder"]["user"] for d in json.loads(done.stdout)["devices"] if d["holder"]]


def test_a_lease_kept_by_a_setuid_program_counts_for_its_user_not_root(mu) -> None:  # type: ignore[no-untyped-def]
    """alice leases a device and execs a setuid-root program that keeps the descriptor
    (like su waiting for a password). Status and metrics name alice; root's own run is not
    refused by root's limit of 1, and alice's next run is refused by hers."""
    from cudawrap.monitor.metrics import device_rows

    inst = mu("four-gpus")
    alice: User = inst.world.alice
    limit_one(inst)
    inst.wrap("recon")
    program = setuid_program(inst)
    code = ACQUIRE_THEN_EXEC.format(path=inst.world.path)
    holder = inst.start(alice, inst.world.python, "-I", "-c", code, str(program))
    assert holder.stdout.readline() == b"up\n", holder.stderr.read()
    assert os.stat(f"/proc/{holder.pid}").st_uid == 0  # what the kernel shows as its owner

    assert holder_users(inst) == [alice.name]
    assert [row["user"] for row in device_rows(inst.layout, None) if row["user"]] == [alice.name]
    mine = inst.run(None, "recon", CUDAWRAP_WAIT="0")
    assert mine.returncode == 0, mine.stderr
    hers = inst.run(alice, "recon", CUDAWRAP_WAIT="0")
    assert hers.returncode == 75 and b"your limit is 1" in hers.stderr, hers.stderr


def test_a_lease_handed_to_a_child_whose_taker_exited_counts_against_the_limit(mu) -> None:  # type: ignore[no-untyped-def]
    """cudawrap.acquire(), fork, the parent exits: the kernel's lock table names a dead pid,
    the child holds the lease. alice's next acquire() is refused by her limit of 1 (it took a
    second device before), and bob, whose limit is his own, still gets one."""
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    limit_one(inst)
    code = ACQUIRE_FORK_EXIT.format(path=inst.world.path)
    children: List[int] = []
    try:
        first = inst.py(alice, code)
        assert first.returncode == 0, first.stderr
        children.append(json.loads(first.stdout)["child"])
        second = inst.py(alice, code)
        if second.returncode == 0:
            children.append(json.loads(second.stdout)["child"])
        assert second.returncode == 75, second.stdout
        assert "you hold 1 device, your limit is 1" in json.loads(second.stdout)["refused"]
        assert holder_users(inst) == [alice.name]
        note = inst.cli(alice, "config").stdout.decode()
        assert "# note: limits: " in note and "counts for nobody" in note, note
        theirs = inst.py(bob, code)
        assert theirs.returncode == 0, theirs.stdout + theirs.stderr
        children.append(json.loads(theirs.stdout)["child"])
    finally:
        for pid in children:
            os.kill(pid, signal.SIGKILL)
