"""Real unprivileged users against cudawrap and against each other (run as root; skipped otherwise).

Two throwaway accounts (tests/support/users.py) try what a local user could try on a shared
server: change wraps, the registry, the config or the lease files; take, forge or release
another user's lease; plant files in the one directory they may write (the queue) for the
shim, `cudawrap status` or root to trip over. What they can legitimately do to others
(hold a device or a place in the queue) is shown too, with what root sees of it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from support.installed import ready_line, waiting_line
from support.admin import diff, snapshot
from support.procs import one_line, root_only, sh_program
from support.users import MuInstall, User

pytestmark = [pytest.mark.root, root_only]

# A user-side probe: try each operation, report "ok" or the errno name.
PROBE = r"""
import errno, fcntl, json, os, sys
out = {}
for name, op, *args in json.load(sys.stdin):
    try:
        if op == "open":
            flags = 0
            for flag in args[1]:
                flags |= getattr(os, flag)
            os.close(os.open(args[0], flags, 0o644))
        elif op == "flock":
            fd = os.open(args[0], os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)
        elif op == "chmod":
            os.chmod(args[0], args[1])
        elif op == "mkfifo":
            os.mkfifo(args[0])
        else:
            getattr(os, op)(*args)
        out[name] = "ok"
    except OSError as exc:
        out[name] = errno.errorcode.get(exc.errno, str(exc.errno))
print(json.dumps(out))
"""

# Hold a flock on a file until killed: a lease taken by hand, or a queue entry that never moves.
HOLD = r"""
import fcntl, os, sys, time
path, create = sys.argv[1], sys.argv[2] == "create"
if create:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, sys.argv[3].encode())
else:
    fd = os.open(path, os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
time.sleep(120)
"""

# A waiter that never takes its turn: a well-formed entry (its own pid in the name) held by
# a process that sleeps. argv: queue directory, contents.
FAKE_WAITER = r"""
import fcntl, os, sys, time
name = "%020d.%d.1sa.300.wait" % (time.time_ns() - 10**9, os.getpid())
fd = os.open(os.path.join(sys.argv[1], name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, sys.argv[2].encode())
print("held", flush=True)
time.sleep(120)
"""

DENIED = {"EACCES", "EPERM"}


def probe(inst: MuInstall, user: User, ops: List[Tuple]) -> Dict[str, str]:
    done = inst.run(user, inst.world.python, "-I", "-c", PROBE, input=json.dumps(ops).encode())
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def hold_file(inst: MuInstall, user: User, path: Path, content: str = "") -> subprocess.Popen:
    proc = inst.py_start(user, HOLD, str(path), "create" if content else "open", content)
    assert proc.stdout.readline() == b"held\n", proc.stderr.read()
    return proc


# --- changing what only root may change ---------------------------------------------------------


def test_users_cannot_wrap_unwrap_or_repair(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice = inst.world.alice
    recon = sh_program(inst.bindir / "recon", 'echo "recon $*"\n')
    other = sh_program(inst.bindir / "other", 'echo "other $*"\n')
    done = inst.cli(None, "wrap", str(other))
    assert done.returncode == 0, done.stderr
    # Alice's own program in her own directory: still not hers to wrap (the shim is trusted by all).
    home = inst.dir / "home-alice"
    home.mkdir()
    os.chown(home, alice.uid, alice.gid)
    mine = sh_program(home / "mine", "echo mine\n")
    os.chown(mine, alice.uid, alice.gid)
    os.unlink(other)  # something for doctor --repair to do, if it were allowed to
    before = {**inst.snapshot(), **snapshot(home)}
    for args in (["wrap", str(recon)], ["wrap", "--gpus", "2", str(mine)], ["unwrap", str(other)],
                 ["unwrap", "--all"], ["unwrap", "--force", str(other)], ["doctor", "--repair"], ["sync"],
                 ["monitor", "--once"]):
        done = inst.cli(alice, *args)
        assert done.returncode == 77, (args, done.stderr)
        assert "only root" in one_line(done, hint=True), args
    done = inst.cli(alice, str(recon), prog="create-cudawrap")
    assert done.returncode == 77 and "only root" in one_line(done, hint=True)
    # Looking is allowed, and changes nothing either.
    assert inst.cli(alice, "list").returncode == 0
    assert inst.cli(alice, "doctor").returncode != 0  # the missing link is reported, not repaired
    assert {**inst.snapshot(), **snapshot(home)} == before, diff(before, {**inst.snapshot(), **snapshot(home)})
    assert inst.run(alice, str(recon), "x").stdout == b"recon x\n"


def test_users_cannot_write_registry_config_leases_or_runtime_files(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("a100-mig7")
    bob = inst.world.bob
    layout = inst.layout
    assert inst.cli(None, "wrap", str(sh_program(inst.bindir / "recon", ""))).returncode == 0
    leases = sorted(layout.lease_dir.iterdir())
    a, b = str(leases[0]), str(leases[1])
    ops = [
        ("registry-write", "open", str(layout.registry_file), ["O_WRONLY"]),
        ("registry-tmp", "open", f"{layout.registry_file}.tmp", ["O_WRONLY", "O_CREAT"]),
        ("registry-rename", "rename", str(layout.registry_file), f"{layout.registry_file}.old"),
        ("registry-symlink", "symlink", "/dev/null", f"{layout.registry_file}.tmp"),
        ("registry-lock-unlink", "unlink", str(layout.registry_lock)),
        ("config-create", "open", str(layout.config_file), ["O_WRONLY", "O_CREAT"]),
        ("config-dir", "mkdir", str(layout.etc_dir / "conf.d")),
        ("lease-write", "open", a, ["O_WRONLY"]),
        ("lease-create", "open", str(layout.lease_dir / "MIG-planted"), ["O_WRONLY", "O_CREAT"]),
        ("lease-unlink", "unlink", a),
        ("lease-replace", "rename", a, b),
        ("lease-symlink", "symlink", a, str(layout.lease_dir / "MIG-alias")),
        ("lease-hardlink", "link", a, str(layout.lease_dir / "MIG-alias2")),
        ("lease-chmod", "chmod", a, 0o666),
        ("lease-dir-chmod", "chmod", str(layout.lease_dir), 0o777),
        ("cache-create", "open", str(layout.launch_cache), ["O_WRONLY", "O_CREAT"]),
        ("snapshot-create", "open", str(layout.usage_snapshot), ["O_WRONLY", "O_CREAT"]),
        ("inventory-cache-create", "open", str(layout.inventory_cache), ["O_WRONLY", "O_CREAT"]),
        ("monitor-pid-create", "open", str(layout.runtime_dir / "monitor.pid"), ["O_WRONLY", "O_CREAT"]),
        ("queue-lock-write", "open", str(layout.queue_lock), ["O_WRONLY"]),
        ("queue-lock-unlink", "unlink", str(layout.queue_lock)),
        ("queue-dir-replace", "rename", str(layout.queue_dir), str(layout.runtime_dir / "q")),
        ("shim-write", "open", str(layout.shim), ["O_WRONLY"]),
        ("real-program-write", "open", str(inst.bindir / "CUDAWRAP_recon"), ["O_WRONLY"]),
        ("link-replace", "symlink", "/bin/true", str(inst.bindir / "recon2")),
    ]
    before = inst.snapshot()
    got = probe(inst, bob, ops)
    refused = {name: code for name, code in got.items() if code not in DENIED}
    assert not refused, refused
    assert inst.snapshot() == before, diff(before, inst.snapshot())
    # What users may do: read a lease file and flock it while nobody holds it. That is
    # taking that device as any launch would (see SECURITY.md), not stealing it.
    assert probe(inst, bob, [("flock-free", "flock", a)]) == {"flock-free": "ok"}


# --- leases: nobody takes, forges or releases another user's -------------------------------------


def test_a_held_lease_cannot_be_taken_forged_or_released_by_another_user(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("a100-mig7")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    device = inst.machine.leaf_uuids()[0]
    inst.allow(device)
    lease = inst.layout.lease_file(device)
    job = inst.start(alice, "recon", "--hold", "60", "--log", str(inst.log))
    assert ready_line(job)["devices"] == [device]
    environ = Path(f"/proc/{job.pid}/environ").read_bytes().split(b"\0")
    marker = [e for e in environ if e.startswith(b"CUDAWRAP_LEASE=")][0].split(b"=", 1)[1].decode()
    fd = marker.split(":")[0]
    assert marker == f"{fd}:{device}"

    before = inst.snapshot()
    other = inst.layout.lease_file(inst.machine.leaf_uuids()[1])
    swap = Path(f"/tmp/.cudawrap-test-swap-{os.getpid()}")
    try:
        got = probe(inst, bob, [
            ("flock-held", "flock", str(lease)),
            ("proc-fd", "open", f"/proc/{job.pid}/fd/{fd}", ["O_RDONLY"]),  # reopen alice's description
            ("unlink", "unlink", str(lease)),
            ("swap", "rename", str(other), str(lease)),
            ("make-link", "symlink", str(other), str(swap)),
            ("symlink-swap", "rename", str(swap), str(lease)),
        ])
    finally:
        swap.unlink(missing_ok=True)
    assert got.pop("flock-held") in ("EWOULDBLOCK", "EAGAIN"), got
    assert got.pop("make-link") == "ok"
    assert {k: v for k, v in got.items() if v not in DENIED} == {}, got
    # A forged marker, with or without a descriptor on the very lease file, gets nothing.
    forged = [
        ({"CUDAWRAP_LEASE": marker}, "recon"),
        ({"CUDAWRAP_LEASE": f"3:{device}"}, f'exec 3<"{lease}"; exec recon'),
        ({"CUDAWRAP_LEASE": f"3:{device}"}, f'exec 3<"{lease}"; flock -u 3; exec recon'),  # "release" it first
    ]
    for extra, script in forged:
        done = inst.run(bob, "sh", "-c", script, CUDAWRAP_WAIT="0", **extra)
        assert done.returncode == 75, (script, done.stdout, done.stderr)
        assert one_line(done, hint=True).startswith("recon: no free device")
    assert inst.snapshot() == before
    # Root sees who holds it; bob sees that it is held, and cannot check by whom (alice's
    # descriptors are closed to him), so no pid is named to him that might be someone else's.
    seen = {d["uuid"]: d["holder"] for d in inst.status(None)["devices"]}
    assert seen[device]["pid"] == job.pid and seen[device]["user"] == alice.name
    seen = {d["uuid"]: d for d in inst.status(bob)["devices"]}
    assert seen[device]["holder"] is not None and seen[device]["holder"]["pid"] is None
    assert seen[device]["foreign_pids"] is None  # alice's job is not shown as someone else's
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=10)
    done = inst.run(bob, "recon", CUDAWRAP_WAIT="0")
    assert done.returncode == 0 and json.loads(done.stdout.splitlines()[0])["devices"] == [device]


def test_a_lease_held_forever_blocks_only_that_device_and_shows_its_holder(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("a100-mig7")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    first, second = inst.machine.leaf_uuids()[:2]
    inst.allow(first, second)
    squatter = hold_file(inst, bob, inst.layout.lease_file(first))  # by hand, no program at all
    for _ in range(2):
        done = inst.run(alice, "recon", CUDAWRAP_WAIT="0")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.splitlines()[0])["devices"] == [second]
    seen = {d["uuid"]: d["holder"] for d in inst.status(None)["devices"]}
    assert seen[first]["pid"] == squatter.pid and seen[first]["user"] == bob.name
    assert seen[second] is None
    table = inst.cli(None, "status").stdout.decode()
    assert f"pid {squatter.pid} {bob.name}" in table
    seen = {d["uuid"]: d["holder"] for d in inst.status(alice)["devices"]}
    assert seen[first]["pid"] is None and seen[second] is None  # held, by someone alice cannot check
    inst.allow(first)
    assert inst.run(alice, "recon", CUDAWRAP_WAIT="0").returncode == 75
    squatter.kill()
    squatter.wait()
    assert inst.run(alice, "recon", CUDAWRAP_WAIT="0").returncode == 0  # the kernel released it at once


def test_running_the_real_program_directly_bypasses_cudawrap(mu) -> None:  # type: ignore[no-untyped-def]
    """Documented, not prevented (SECURITY.md): CUDAWRAP_<name> is an ordinary program."""
    inst = mu("a100-mig7")
    inst.wrap("recon")
    device = inst.machine.leaf_uuids()[0]
    inst.allow(device)
    job = inst.start(inst.world.alice, "recon", "--hold", "60")
    ready_line(job)
    done = inst.run(inst.world.bob, str(inst.bindir / "CUDAWRAP_recon"), CUDA_VISIBLE_DEVICES=device)
    assert done.returncode == 0 and json.loads(done.stdout.splitlines()[0])["devices"] == [device]


# --- the queue directory: the one place users can write ------------------------------------------


def _plant(inst: MuInstall, user: User, victim: Path) -> List[str]:
    """Symlinks and odd files named like what cudawrap reads and root creates in the queue."""
    queue = inst.layout.queue_dir
    links = ["00000000000000000001.1.wait", "99999999999999999999.2.wait", "00000000000000000002.1.wait.tmp",
             "launch.cache", "queue.lock", "usage.snapshot", "leases"]
    links += [f".new-{pid}-{key}" for pid in range(os.getpid(), os.getpid() + 400)
              for key in (100000000000000000000, 1)]
    ops = [(f"link-{n}", "symlink", str(victim), str(queue / n)) for n in links]
    ops += [("fifo", "mkfifo", str(queue / "00000000000000000003.3.wait")),
            ("dir", "mkdir", str(queue / "00000000000000000004.4.wait")),
            ("hardlink", "link", str(victim), str(queue / "00000000000000000005.5.wait"))]
    got = probe(inst, user, ops)
    assert got.pop("hardlink") in DENIED  # protected_hardlinks: not a file of hers
    assert set(got.values()) == {"ok"}, got
    # Dead entries with garbage inside, owned by her: others cannot remove them (sticky).
    junk = {"00000000000000000006.6.wait": b"\xff\xfe\x00binary",
            "00000000000000000007.7.wait": b"pid=abc\ncount=-1\nprogram=" + b"x" * 1_000_000,
            "00000000000000000008.8.wait": b"pid=99999999999999999999999\ncount=\xc2\xb2\n",
            "\u00b2" * 20 + ".9.wait": b"",
            "000000000000000000010.10.wait": b"",
            "00000000000000000011.11.wait": b"pid=1\n"}
    code = ("import json, os, sys\nfor name, data in json.load(sys.stdin).items():\n"
            "    fd = os.open(os.path.join(%r, name), os.O_WRONLY | os.O_CREAT, 0o644)\n"
            "    os.write(fd, bytes.fromhex(data)); os.close(fd)\n"
            "os.chmod(os.path.join(%r, '00000000000000000011.11.wait'), 0)\n") % (str(queue), str(queue))
    data = json.dumps({name: content.hex() for name, content in junk.items()}).encode()
    done = inst.run(user, inst.world.python, "-I", "-c", code, input=data)
    assert done.returncode == 0, done.stderr
    return links


def test_root_never_follows_links_planted_in_the_queue_directory(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("a100-mig7")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    victim = inst.dir / "victim"
    victim.write_bytes(b"precious\n")
    victim.chmod(0o644)
    victim_before = snapshot(victim)
    links = _plant(inst, bob, victim)
    # Everything root does that touches the queue: sync, repair, the monitor, status, and
    # a wrapped program run by root that has to wait (so it creates an entry there).
    device = inst.machine.leaf_uuids()[0]
    inst.allow(device)
    for args in (["sync"], ["doctor", "--repair"], ["monitor", "--once"], ["status"]):
        done = inst.cli(None, *args)
        assert b"Traceback" not in done.stderr and done.returncode in (0, 65), (args, done.stderr)
    holder = inst.start(alice, "recon", "--hold", "60")
    ready_line(holder)
    waiter = inst.start(None, "recon", "--log", str(inst.log), CUDAWRAP_WAIT="30")
    assert "position 1 in line" in waiting_line(waiter)
    holder.kill()
    assert waiter.wait(timeout=30) == 0, waiter.stderr.read()
    assert snapshot(victim) == victim_before
    for name in links:
        assert os.readlink(inst.layout.queue_dir / name) == str(victim), name


def test_files_planted_in_the_queue_break_nobody(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("a100-mig7")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    victim = inst.dir / "victim"
    victim.write_text("x")
    _plant(inst, bob, victim)
    done = inst.run(alice, "recon", CUDAWRAP_WAIT="0")
    assert done.returncode == 0 and done.stderr == b"", done.stderr
    # Waiting (entry, position, wake-up) works with the junk around, for users and root.
    device = inst.machine.leaf_uuids()[0]
    inst.allow(device)
    holder = inst.start(None, "recon", "--hold", "60")
    ready_line(holder)
    waiter = inst.start(alice, "recon", "--log", str(inst.log), CUDAWRAP_WAIT="30")
    assert "position 1 in line" in waiting_line(waiter)
    for user in (alice, bob, None):
        seen = inst.status(user)
        assert [w["user"] for w in seen["waiting"]] == [alice.name], seen["waiting"]
        assert seen["waiting"][0]["pid"] == waiter.pid
    holder.kill()
    assert waiter.wait(timeout=30) == 0, waiter.stderr.read()
    assert inst.cli(None, "sync").returncode == 0  # root clears the dead junk
    assert inst.cli(alice, "status").returncode == 0


def test_a_waiter_with_a_private_umask_keeps_its_place(mu) -> None:  # type: ignore[no-untyped-def]
    """An entry must be readable by others whatever its owner's umask, or they would not see
    it, think themselves first, and pass it."""
    inst = mu("a100-mig7")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    device = inst.machine.leaf_uuids()[0]
    inst.allow(device)
    holder = inst.start(None, "recon", "--hold", "60")
    ready_line(holder)
    first = inst.start(alice, "sh", "-c", f'umask 077; exec recon --log "{inst.log}"', CUDAWRAP_WAIT="30")
    assert "position 1 in line" in waiting_line(first)
    second = inst.start(bob, "recon", "--log", str(inst.log), CUDAWRAP_WAIT="30")
    assert "position 2 in line" in waiting_line(second)
    assert [w["user"] for w in inst.status(bob)["waiting"]] == [alice.name, bob.name]
    holder.kill()
    assert first.wait(timeout=30) == 0 and second.wait(timeout=30) == 0
    starts = [j["pid"] for j in map(json.loads, inst.log.read_text().splitlines()) if j["event"] == "start"]
    assert starts == [first.pid, second.pid]


def test_a_fake_queue_head_does_not_delay_others_and_root_sees_who(mu) -> None:  # type: ignore[no-untyped-def]
    """A user who holds a well-formed queue entry and never takes the device it is offered
    is passed over after GRACE_S: a free device still reaches the next user at once, even
    with CUDAWRAP_WAIT=0. Root sees the real owner and pid (not what the entry claims)."""
    inst = mu("a100-mig7")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    inst.allow(inst.machine.leaf_uuids()[0])
    fake = inst.py_start(bob, FAKE_WAITER, str(inst.layout.queue_dir),
                         "uid=0\npid=1\ncount=1\nprogram=\x1b]0;pwned\x07evil\n")
    assert fake.stdout.readline() == b"held\n", fake.stderr.read()
    (waiter,) = inst.status(None)["waiting"]
    assert (waiter["user"], waiter["pid"]) == (bob.name, fake.pid)
    assert "\x1b" not in waiter["program"] and "\x07" not in waiter["program"]  # no escapes to root's terminal
    table = inst.cli(None, "status").stdout.decode()
    assert f"{bob.name}  {fake.pid}" in table and "\x1b" not in table
    done = inst.run(alice, "recon", CUDAWRAP_WAIT="0")
    assert done.returncode == 0, done.stderr
    fake.kill()
    fake.wait()
    done = inst.run(alice, "recon", CUDAWRAP_WAIT="0")
    assert done.returncode == 0, done.stderr


def test_huge_values_in_ones_own_environment_fail_one_line_and_harm_no_one(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("a100-mig7")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    big = 120_000  # just under the kernel's limit for one environment string
    for extra in ({"CUDA_VISIBLE_DEVICES": ("0," * big)[:big]}, {"CUDA_VISIBLE_DEVICES": "x" * big},
                  {"CUDAWRAP_LEASE": ("3:MIG-x," * big)[:big]}, {"CUDAWRAP_LEASE": "9" * big + ":MIG-x"},
                  {"CUDAWRAP_WAIT": "9" * big}, {"CUDAWRAP_WAIT": "x" * big}, {"CUDAWRAP_VERBOSE": "1" * big}):
        done = inst.run(alice, "recon", **extra)
        if done.returncode != 0:
            assert done.returncode in (64, 75), (list(extra), done.returncode, done.stderr[:300])
            assert len(one_line(done, hint=True)) < 300
        other = inst.run(bob, "recon", CUDAWRAP_WAIT="0")
        assert other.returncode == 0 and other.stderr == b"", other.stderr
    assert os.listdir(inst.layout.queue_dir) == []


def test_no_lock_a_user_can_take_stalls_a_launch(mu) -> None:  # type: ignore[no-untyped-def]
    """There is no queue mutex any more: a user who flocks every file of the runtime area he
    can open (the old queue.lock, the queue directory itself) delays nobody, whether the
    launch waits or not."""
    inst = mu("a100-mig7")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    squatters = [hold_file(inst, bob, path) for path in (inst.layout.queue_lock, inst.layout.queue_dir)
                 if path.exists()]
    assert squatters
    done = inst.run(alice, "recon", CUDAWRAP_WAIT="0")
    assert done.returncode == 0, done.stderr
    inst.allow(inst.machine.leaf_uuids()[0])
    holder = inst.start(None, "recon", "--hold", "60")
    ready_line(holder)
    patient = inst.start(alice, "recon", CUDAWRAP_WAIT="forever")
    assert "position 1 in line" in waiting_line(patient)
    holder.kill()
    assert patient.wait(timeout=10) == 0


def test_root_refuses_to_wrap_in_a_users_directory(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice = inst.world.alice
    home = inst.dir / "home-alice"
    home.mkdir()
    os.chown(home, alice.uid, alice.gid)
    mine = sh_program(home / "mine", "echo mine\n")
    os.chown(mine, 0, 0)  # even a root-owned program: alice can rename her directory's entries
    before = snapshot(home)
    done = inst.cli(None, str(mine), prog="create-cudawrap")
    assert done.returncode == 65
    assert one_line(done, hint=True) == (
        f"create-cudawrap: {mine}: {home} is owned by {alice.name}, not root, so they could swap it for a "
        "symlink that root's commands would follow; put the program where only root can write (such as "
        "/opt/app/bin) and wrap it there")
    assert snapshot(home) == before
    # A program root's directory holds but a user may write is refused the same way.
    theirs = sh_program(inst.bindir / "theirs", "echo theirs\n")
    for mode, whom in ((0o757, "others"), (0o775, "its group"), (0o777, "its group and others")):
        theirs.chmod(mode)
        done = inst.cli(None, str(theirs), prog="create-cudawrap")
        assert done.returncode == 65 and one_line(done, hint=True) == (
            f"create-cudawrap: {theirs}: {theirs} is writable by {whom} (mode {mode:04o}), so they could swap it "
            "for a symlink that root's commands would follow; put the program where only root can write (such as "
            "/opt/app/bin) and wrap it there")


def test_a_service_accounts_program_in_roots_directory_is_wrapped_with_a_warning(mu) -> None:  # type: ignore[no-untyped-def]
    """/opt/app/bin is root's, the program its service account's: the account can change the
    program's contents but cannot rename or replace it, so root's renames act on what they checked."""
    inst = mu("four-gpus")
    svc = inst.world.alice
    prog = sh_program(inst.bindir / "nc", 'echo "nc $CUDA_VISIBLE_DEVICES"\n')
    os.chown(prog, svc.uid, svc.gid)
    done = inst.cli(None, str(prog), prog="create-cudawrap")
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode().startswith(f"wrapped {prog} (real program: {inst.bindir}/CUDAWRAP_nc, renamed)")
    assert one_line(done, hint=True) == (
        f"create-cudawrap: warning: {prog} is owned by {svc.name}, who can still change what it runs (its "
        f"contents), though not rename or replace it: only root can write in {inst.bindir}")
    real = inst.bindir / "CUDAWRAP_nc"
    assert os.readlink(prog) == str(inst.layout.program_shim(str(prog))) and real.stat().st_uid == svc.uid
    ran = inst.run(svc, str(prog))
    assert ran.returncode == 0 and ran.stdout.decode().startswith("nc GPU-"), ran.stderr
    checked = inst.cli(None, "doctor")
    assert checked.returncode == 0, checked.stdout + checked.stderr  # a wrap like any other
    # As the warning says: the owner changes what runs, but cannot move a name in root's directory.
    edited = inst.run(svc, "sh", "-c", 'printf "#!/bin/sh\\necho changed\\n" > "$1"', "sh", str(real))
    assert edited.returncode == 0, edited.stderr
    assert inst.run(None, str(prog)).stdout == b"changed\n"
    moved = inst.run(svc, "mv", str(real), str(inst.bindir / "elsewhere"))
    assert moved.returncode != 0 and real.exists()
    # The changed program is the owner's deploy: doctor says so, and unwrap puts it back as it is now.
    assert inst.cli(None, "unwrap", "--force", str(prog)).returncode == 0
    assert prog.stat().st_uid == svc.uid and prog.read_bytes() == b"#!/bin/sh\necho changed\n"


def test_a_user_swapping_a_wrapped_directory_for_a_symlink_redirects_nothing(mu) -> None:  # type: ignore[no-untyped-def]
    """A wrap made where a user now has control (~/bin handed over, or wrapped by an older
    version): alice swaps the directory for a symlink to a root-owned one; root's doctor
    --repair and unwrap must not follow it to wrap or move the program there."""
    inst = mu("four-gpus")
    alice = inst.world.alice
    home = inst.dir / "home-alice"
    (home / "bin").mkdir(parents=True)
    prog = sh_program(home / "bin" / "recon", 'echo "recon $*"\n')
    assert inst.cli(None, str(prog), prog="create-cudawrap").returncode == 0
    os.chown(home, alice.uid, alice.gid)  # handed over after it was wrapped
    os.chown(home / "bin", alice.uid, alice.gid)
    victim = inst.dir / "victim"
    victim.mkdir()
    sh_program(victim / "recon", 'echo "root\'s own recon $*"\n')
    done = inst.run(alice, "sh", "-c", 'mv "$1/bin" "$1/bin.old" && ln -s "$2" "$1/bin"', "sh", str(home),
                    str(victim))
    assert done.returncode == 0, done.stderr
    before = {**snapshot(victim), **inst.snapshot()}
    repaired = inst.cli(None, "doctor", "--repair")
    assert repaired.returncode == 65
    out = repaired.stdout.decode()
    assert f"error: {prog}: {home} is owned by {alice.name}, not root: cudawrap no longer acts there" in out, out
    assert "fixed:" not in out
    assert inst.cli(None, "unwrap", str(prog)).returncode == 65
    assert {**snapshot(victim), **inst.snapshot()} == before, diff(before, {**snapshot(victim), **inst.snapshot()})
    # --force lets go of the wrap without touching anything in alice's directory (or the victim's).
    done = inst.cli(None, "unwrap", "--force", str(prog))
    assert done.returncode == 0, done.stderr
    assert "its files were left as they are" in done.stdout.decode()
    assert snapshot(victim) == {k: v for k, v in before.items() if k.startswith(str(victim))}
    assert inst.cli(None, "list", "--json").stdout.strip() == b"[]"


def test_doctor_moves_no_file_a_user_planted_in_a_sticky_directory(mu) -> None:  # type: ignore[no-untyped-def]
    """bob names his own file CUDAWRAP_notes in a /tmp-like directory on root's PATH: doctor
    --repair must not take it for a program cudawrap renamed, and move it."""
    inst = mu("four-gpus")
    bob = inst.world.bob
    shared = inst.dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    done = inst.run(bob, "sh", "-c", 'printf "#!/bin/sh\\necho notes\\n" > "$1/CUDAWRAP_notes" && chmod 755 '
                    '"$1/CUDAWRAP_notes"', "sh", str(shared))
    assert done.returncode == 0, done.stderr
    before = snapshot(shared)
    repaired = inst.cli(None, "doctor", "--repair", PATH=f"{shared}:/usr/bin:/bin")
    assert "CUDAWRAP_notes" not in repaired.stdout.decode()
    assert snapshot(shared) == before, diff(before, snapshot(shared))


def test_claims_a_user_plants_keep_root_from_no_device(mu) -> None:  # type: ignore[no-untyped-def]
    """The machine-wide claims directory is writable by all (a user's prefix install claims
    there too); alice claims every GPU for a 'install' of her own, with lease files to look
    live. Root's sync takes no notice: the system install keeps its devices."""
    inst = mu("four-gpus")
    alice = inst.world.alice
    claims = inst.machine.claims_dir
    uuids = inst.machine.leaf_uuids()
    for uuid in uuids:  # as after a reboot: no claims yet
        (claims / uuid).unlink()
    fake_root = inst.dir / "alice-root"
    fake_root.mkdir()
    os.chown(fake_root, alice.uid, alice.gid)
    script = ('import os, sys\nroot, claims, *uuids = sys.argv[1:]\nos.makedirs(root + "/run/cudawrap/leases")\n'
              'for u in uuids:\n    open(root + "/run/cudawrap/leases/" + u, "w").close()\n'
              '    open(os.path.join(claims, u), "w").write(root + "\\n")\n')
    done = inst.py(alice, script, str(fake_root), str(claims), *uuids)
    assert done.returncode == 0, done.stderr
    done = inst.cli(None, "sync")
    assert done.returncode == 0, done.stderr
    assert b"managed by" not in done.stdout, done.stdout
    for uuid in uuids:
        assert (claims / uuid).read_text() == f"{inst.layout.root}\n" and (claims / uuid).stat().st_uid == 0
    inst.wrap("recon")
    r = inst.run(alice, str(inst.bindir / "recon"))
    assert r.returncode == 0, r.stderr


# alice's objects under device names in the claims directory: what each one is, made by her.
PLANT = r"""
import os, sys
claims, empty, full, plain, link, fifo = sys.argv[1:]
os.mkdir(os.path.join(claims, empty))
os.mkdir(os.path.join(claims, full))
open(os.path.join(claims, full, "keep"), "w").close()
open(os.path.join(claims, plain), "w").write("/nonexistent\n")
os.symlink("/etc/passwd", os.path.join(claims, link))
os.mkfifo(os.path.join(claims, fifo))
"""


def test_objects_a_user_plants_under_device_names_keep_root_from_no_device(mu) -> None:  # type: ignore[no-untyped-def]
    """alice makes a directory (empty, and one with a file in it), a file, a symlink and a
    FIFO under device names in the sticky claims directory before root's first sync. Root's
    sync succeeds, leases every device, claims each one it can and names the one it cannot
    (the directory it may not empty), with its owner; bob's own install leases none of those."""
    inst = mu("a100-mig7")
    alice, bob = inst.world.alice, inst.world.bob
    claims = inst.machine.claims_dir
    uuids = sorted(inst.machine.leaf_uuids())
    for uuid in uuids:  # as on a fresh machine: no claims, no lease files yet
        (claims / uuid).unlink()
        (inst.layout.lease_dir / uuid).unlink()
    empty, full, plain, link, fifo = uuids[:5]
    done = inst.py(alice, PLANT, str(claims), empty, full, plain, link, fifo)
    assert done.returncode == 0, done.stderr
    done = inst.cli(None, "sync")
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode() + out
    assert sorted(os.listdir(inst.layout.lease_dir)) == uuids  # every device leased by root's install
    for uuid in set(uuids) - {full}:
        assert (claims / uuid).read_text() == f"{inst.layout.root}\n" and (claims / uuid).stat().st_uid == 0
    assert (claims / full / "keep").exists() and not (claims / link).is_symlink()
    warned = [line for line in out.splitlines() if "not claimed" in line]
    assert warned == [f"warning: {full} not claimed: {claims}/{full} is a directory made by {alice.name}, not a "
                      "claim; leased here all the same; remove it to claim the device machine-wide"], out
    inst.wrap("recon")
    inst.allow(full)
    r = inst.run(bob, str(inst.bindir / "recon"), CUDAWRAP_WAIT="0")
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[0])["devices"] == [full], r.stderr
    # bob's own install cannot tell who manages the device under alice's directory: it leaves it.
    mine = inst.dir / "bob-prefix"
    mine.mkdir()
    os.chown(mine, bob.uid, bob.gid)
    code = (f"import json, sys; sys.path[:0] = {inst.world.path!r}\nfrom cudawrap.lease.claims import claim\n"
            "c = claim(sys.argv[1], sys.argv[2:]); print(json.dumps([c.mine, c.unclaimed]))")
    leased, unclaimed = json.loads(inst.py(bob, code, str(mine), full).stdout)
    assert leased == [] and f"a directory made by {alice.name}" in unclaimed[full]


def test_a_users_prefix_install_leaves_the_system_installs_devices_alone(mu) -> None:  # type: ignore[no-untyped-def]
    """alice's own prefix install, synced by her, honours the claims of root's install while
    it manages the devices; a device root's install no longer has is hers to lease."""
    inst = mu("four-gpus")
    alice = inst.world.alice
    uuids = sorted(inst.machine.leaf_uuids())
    (inst.layout.lease_dir / uuids[0]).unlink()  # root's install lost this one: its claim is stale
    mine = inst.dir / "alice-prefix"
    mine.mkdir()
    os.chown(mine, alice.uid, alice.gid)
    code = (f"import json, sys; sys.path[:0] = {inst.world.path!r}\nfrom cudawrap.lease.claims import claim\n"
            "c = claim(sys.argv[1], sys.argv[2:]); print(json.dumps([c.mine, c.others, c.warning]))")
    done = inst.py(alice, code, str(mine), *uuids)
    assert done.returncode == 0, done.stderr
    leased, others, warning = json.loads(done.stdout)
    assert leased == [uuids[0]] and warning is None
    assert others == {u: str(inst.layout.root) for u in uuids[1:]}
    # Her sync could not take over root's stale claim file (sticky directory), and took nothing else.
    claims = inst.machine.claims_dir
    assert all((claims / u).stat().st_uid == 0 for u in uuids)
