"""A lease descriptor hidden from every process (issue 51, items 13-15), with real accounts.

mallory (an ordinary account) keeps what the service sent her past its grant: in flight in a
socketpair (SCM_RIGHTS) that only a sleeping child keeps, with the run that took it gone; or
unlocked, after declining the grant or letting it lapse; or opened before the service made
the directories root's. The service counts a lease it granted to its user from its own books
until it sees the lock free, root can revoke it, and a descriptor whose grant is void, or
that was opened before the service took the directories over, guards nothing.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Iterator, List

import pytest

from support.installed import ready_line
from support.procs import one_line, root_only, wait_for
from support.users import MuInstall, User
from test_enforce import ENFORCE, runs_with_the_service
from test_service import Served, _ledger

pytestmark = [pytest.mark.root, root_only]

LIMIT_ONE = "\n[limits]\nmax_devices_per_user = 1\n"

# mallory's client: asks for one device (VISIBLE= narrows it), and then:
# hide: locks it, sends the descriptor into a socketpair that a sleeping child keeps (the
#       child never has it in its table), closes her own, and exits; "lie" says "lost" instead
#       of "held" first;
# lost: says "lost" (or, with "lapse", nothing: the grant lapses) and keeps the unlocked
#       descriptor; on SIGUSR1 leaves the line and locks it.
MALLORY = r"""
import fcntl, os, signal, socket, sys, time
sys.path[:0] = @PATH@
from cudawrap import wire
from cudawrap.launch.client import Connection
mode, visible, share = sys.argv[1], sys.argv[2], sys.argv[3:] == ["share"]
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
if mode in ("hide", "lie"):
    keep, send = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    child = os.fork()
    if child == 0:
        send.close()
        for fd in (0, 1, 2):
            os.close(fd)
        signal.sigwait([signal.SIGUSR1])
        os._exit(0)
    keep.close()
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(@SOCK@)
conn = Connection(sock)
conn.send(wire.REQUEST, {"count": "1", "wait": "0", **({"visible": visible} if visible else {}),
                         **({"share": "1"} if share else {})})
verb, reply = conn.receive()
if verb != wire.GRANT:
    print("refused", reply.get("text", ""), flush=True)
    sys.exit(0)
kinds = [fcntl.LOCK_SH if d.endswith(":sh") else fcntl.LOCK_EX for d in reply["fds"].split(",")]
fds = conn.take_fds(len(kinds))
fd = fds[0]
if mode in ("hide", "lie"):
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    conn.send(wire.HELD if mode == "hide" else wire.LOST, {"devices": reply["devices"]})
    send.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, sys.byteorder))])
    os.close(fd)
    print("hidden", reply["devices"], child, flush=True)
    os._exit(0)
if mode == "lost":
    conn.send(wire.LOST, {"devices": reply["devices"]})
print("kept", reply["devices"], flush=True)
signal.sigwait([signal.SIGUSR1])
sock.close()  # out of line: nothing is granted to her again
try:
    for fd, kind in zip(fds, kinds):
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    print("locked", flush=True)
except OSError:
    print("held", flush=True)
signal.sigwait([signal.SIGUSR1])
"""


def mallory_code(served: Served) -> str:
    return (MALLORY.replace("@PATH@", repr(list(served.inst.world.path)))
            .replace("@SOCK@", repr(str(served.sock))))


def configured(inst: MuInstall, extra: str = "") -> MuInstall:
    inst.layout.config_file.write_text(ENFORCE.format(retry=2) + extra)
    inst.layout.config_file.chmod(0o644)
    runs_with_the_service(inst)
    inst.sync()
    return inst


@pytest.fixture
def started() -> Iterator[List[subprocess.Popen]]:
    procs: List[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def hide(served: Served, user: User, kids: List[int], visible: str = "", mode: str = "hide") -> List[str]:
    """USER's client takes a lease, hides it in a socketpair of a sleeping child (whose pid
    goes to KIDS) and exits: its line, split."""
    done = served.inst.py(user, mallory_code(served), mode, visible)
    assert done.returncode == 0, done.stderr.decode()
    words = done.stdout.decode().split()
    if words and words[0] == "hidden":
        kids.append(int(words[2]))
    return words


def kill_all(pids: List[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_hidden_lease_counts_against_its_users_limit_and_root_revokes_it(mu) -> None:
    """mallory hides a lease in a socketpair and her run exits: no process has it in a table,
    nor is the pid that took the lock hers any more. The service counts it hers from its books
    (the grant's uid) while the lock is held: her next ask is refused on her limit of 1 with
    three devices free. Root's `cudawrap revoke` replaces the lease file: the descriptor she
    hid guards nothing, the ledger says who revoked it, status shows the device free, and
    the next run is granted it."""
    inst = configured(mu("four-gpus"), LIMIT_ONE)
    served = Served(inst)
    mallory, alice = inst.world.carol, inst.world.alice
    kids: List[int] = []
    try:
        first = hide(served, mallory, kids)
        assert first[0] == "hidden", first
        uuid = first[1]
        assert not any(_holds(p, inst, uuid) for p in kids)  # in flight: in no table
        again = hide(served, mallory, kids)
        assert again[0] == "refused" and "your limit is 1" in " ".join(again), again
        # alice is not counted for it (a pid of hers is not the holder).
        run = inst.run(alice, "recon", CUDAWRAP_WAIT="0")
        assert run.returncode == 0, run.stderr.decode()
        # Root revokes it: not root, 77; a bad device, one line.
        denied = inst.cli(alice, "revoke", uuid)
        assert denied.returncode == 77, denied.stderr.decode()
        bad = inst.cli(None, "revoke", "GPU-nonesuch")
        assert bad.returncode == 64 and "GPU-nonesuch" in one_line(bad, hint=True)
        done = inst.cli(None, "revoke", uuid)
        assert done.returncode == 0, done.stderr.decode()
        assert uuid in done.stdout.decode()
        (device,) = [d for d in inst.status(None)["devices"] if d["uuid"] == uuid]
        assert device["holder"] is None, device
        ended = [r for r in _ledger(inst, "end") if r["devices"] == [uuid] and r["uid"] == mallory.uid]
        assert ended and "revoked" in ended[-1]["how"], ended
        taker = inst.run(alice, "recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=uuid)
        assert taker.returncode == 0, taker.stderr.decode()
    finally:
        kill_all(kids)
        served.proc.terminate()
        served.proc.wait(timeout=10)


def test_a_grant_declined_with_its_lock_held_counts_for_its_user_until_replaced(mu) -> None:
    """mallory locks what she was sent and says "lost" all the same (void: its file cannot be
    replaced while she holds it), then hides the descriptor and exits: the lease still counts
    as hers (the void grant's client, in the books until its file is replaced)."""
    inst = configured(mu("four-gpus"), LIMIT_ONE)
    served = Served(inst)
    mallory = inst.world.carol
    kids: List[int] = []
    try:
        first = hide(served, mallory, kids, mode="lie")
        assert first[0] == "hidden", first
        again = hide(served, mallory, kids)
        assert again[0] == "refused" and "your limit is 1" in " ".join(again), again
    finally:
        kill_all(kids)
        served.proc.terminate()
        served.proc.wait(timeout=10)


def _holds(pid: int, inst: MuInstall, uuid: str) -> bool:
    """Whether PID has UUID's lease file in its descriptor table."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").endswith(uuid) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


@pytest.mark.parametrize("how", ["lost", "lapse"])
def test_a_descriptor_of_a_void_grant_guards_nothing(mu, how: str, started: List[subprocess.Popen]) -> None:
    """mallory asks for a device by name, keeps the descriptor unlocked and declines the grant
    ("lost") or lets it lapse (2 s): void, "not taken". Locking what she kept later takes
    nothing: the service replaced the lease file before letting go, so alice is granted the
    device, and status names nobody on it but her."""
    inst = configured(mu("four-gpus"))
    served = Served(inst)
    mallory, alice = inst.world.carol, inst.world.alice
    try:
        uuid = inst.machine.leaf_uuids()[0]
        client = inst.py_start(mallory, mallory_code(served), how, uuid)
        started.append(client)
        words = client.stdout.readline().decode().split()
        assert words == ["kept", uuid], (words, client.stderr.read().decode() if not words else "")
        wait_for(lambda: any(r["pid"] == client.pid and "not taken" in r["how"] for r in _ledger(inst, "end")),
                 timeout=10, what="the grant void")
        os.kill(client.pid, signal.SIGUSR1)
        assert client.stdout.readline().strip() == b"locked"  # what she kept, a file nobody reads
        run = inst.start(alice, "recon", "--hold", "30", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=uuid)
        started.append(run)
        assert ready_line(run)["cvd"] == uuid
        (device,) = [d for d in inst.status(None)["devices"] if d["uuid"] == uuid]
        assert device["holder"]["pid"] == run.pid, device
    finally:
        served.proc.terminate()
        served.proc.wait(timeout=10)


HOLD = r"""
import signal, sys
sys.path[:0] = @PATH@
import cudawrap
(uuid,) = cudawrap.acquire(1, wait=0)
print(uuid, flush=True)
signal.pause()
"""
EARLY = r"""
import fcntl, os, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
where = sys.argv[1]
fds = {n: os.open(os.path.join(where, n), os.O_RDONLY) for n in sorted(os.listdir(where))}
print("opened", flush=True)
while True:
    signal.sigwait([signal.SIGUSR1])
    got = []
    for name, fd in sorted(fds.items()):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            got.append(name)
        except OSError:
            pass
    for name in got:
        del fds[name]  # locked, and kept open
    print(" ".join(got) or "-", flush=True)
"""


def test_descriptors_opened_before_the_service_took_the_directories_over_are_worth_nothing(
        mu, started: List[subprocess.Popen]) -> None:
    """Without enforce, mallory opens every lease file, and alice's run holds one. Then root
    turns enforce on (the directories become root's) and starts the service: it replaces each
    lease file it finds free, and alice's once she lets it go; sync says meanwhile which is
    not replaced yet. What mallory locks through her old descriptors guards nothing."""
    inst = mu("four-gpus")
    mallory, alice, bob = inst.world.carol, inst.world.alice, inst.world.bob
    holder = inst.py_start(alice, HOLD.replace("@PATH@", repr(list(inst.world.path))))
    started.append(holder)
    held = holder.stdout.readline().decode().strip()
    assert held, holder.stderr.read().decode()
    early = inst.py_start(mallory, EARLY, str(inst.layout.lease_dir))
    started.append(early)
    assert early.stdout.readline().strip() == b"opened"
    configured(inst)
    served = Served(inst)
    try:
        said = inst.cli(None, "sync")
        assert said.returncode == 0 and f"by no grant of its own: {held}" in said.stdout.decode(), said.stdout
        doctor = inst.cli(None, "doctor")
        assert "warning: leases: 1 lease or slot file(s) held since before" in doctor.stdout.decode(), doctor.stdout
        os.kill(early.pid, signal.SIGUSR1)
        free = [u for u in inst.machine.leaf_uuids() if u != held]
        assert early.stdout.readline().split() == sorted(u.encode() for u in free)  # old files, all of them
        for uuid in free:
            run = inst.run(bob, "recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=uuid)
            assert run.returncode == 0, run.stderr.decode()
        holder.kill()
        holder.wait()
        wait_for(lambda: "by no grant" not in inst.cli(None, "sync").stdout.decode(), what="its file replaced")
        os.kill(early.pid, signal.SIGUSR1)
        assert early.stdout.readline().split() == [held.encode()]
        run = inst.run(bob, "recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=held)
        assert run.returncode == 0, run.stderr.decode()
    finally:
        served.proc.terminate()
        served.proc.wait(timeout=10)


@pytest.mark.parametrize("service", [False, True], ids=["daemonless", "service"])
def test_root_revokes_a_running_lease_both_ways(mu, service: bool, started: List[subprocess.Popen]) -> None:
    """alice's run holds a device; root's `cudawrap revoke` kills it, replaces the lease file,
    records the lease as revoked, and bob's next run is granted the device: with the service
    and without it, alike."""
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    served = Served(inst) if service else None
    if served is None:
        inst.wrap("recon")
    try:
        run = inst.start(alice, "recon", "--hold", "60")
        started.append(run)
        uuid = ready_line(run)["cvd"]
        before = os.stat(inst.layout.lease_dir / uuid).st_ino
        done = inst.cli(None, "revoke", "--", uuid[:12])
        assert done.returncode == 0, done.stderr.decode()
        assert f"revoked {uuid}" in done.stdout.decode()
        assert run.wait(timeout=10) == -signal.SIGKILL
        assert os.stat(inst.layout.lease_dir / uuid).st_ino != before
        wait_for(lambda: any(r["pid"] == run.pid and r["how"].startswith("revoked by") for r in _ledger(inst, "end")),
                 what="the revoke in the ledger", details=lambda: json.dumps(_ledger(inst, "end")))
        (device,) = [d for d in inst.status(None)["devices"] if d["uuid"] == uuid]
        assert device["holder"] is None, device
        nxt = inst.run(bob, "recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=uuid)
        assert nxt.returncode == 0, nxt.stderr.decode()
    finally:
        if served is not None:
            served.proc.terminate()
            served.proc.wait(timeout=10)


def _with_pid(pid: int, start) -> subprocess.Popen:  # type: ignore[no-untyped-def]
    """START() run until the process it starts gets PID (the kernel's next pid set first)."""
    for _ in range(50):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        proc = start()
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    raise AssertionError(f"pid {pid} did not come round again in 50 tries")


def test_a_pid_recycled_to_another_user_does_not_make_them_the_holder(
        mu, started: List[subprocess.Popen]) -> None:
    """mallory's run that took a lease (hidden in a socketpair since) exits, and its pid goes
    to alice's next process. The kernel's lock table still names that pid; the service's books
    say whose grant it was: alice, under a limit of 1, is granted a device, not told she holds
    one."""
    inst = configured(mu("four-gpus"), LIMIT_ONE)
    served = Served(inst)
    mallory, alice = inst.world.carol, inst.world.alice
    kids: List[int] = []
    try:
        taker = inst.py_start(mallory, mallory_code(served), "hide", "")
        words = taker.stdout.read().decode().split()
        assert taker.wait(timeout=10) == 0 and words[0] == "hidden", (words, taker.stderr.read().decode())
        kids.append(int(words[2]))
        started.append(_with_pid(taker.pid, lambda: inst.start(alice, "sleep", "60")))
        run = inst.run(alice, "recon", CUDAWRAP_WAIT="0")
        assert run.returncode == 0, run.stderr.decode()
        assert json.loads(run.stdout.splitlines()[0])["cvd"] != words[1]
        # Root's status names mallory as its holder, and no pid: the one the kernel names is alice's.
        (device,) = [d for d in inst.status(None)["devices"] if d["uuid"] == words[1]]
        assert (device["holder"]["user"], device["holder"]["pid"]) == (mallory.name, None), device["holder"]
        shown = inst.cli(None, "status").stdout.decode()
        assert f"{mallory.name} (not a w" in shown and "(its run exited)" in shown, shown
    finally:
        kill_all(kids)
        served.proc.terminate()
        served.proc.wait(timeout=10)


def test_a_share_declined_leaves_a_lease_and_slot_descriptor_that_guard_nothing(
        mu, started: List[subprocess.Popen]) -> None:
    """A share is sent as the lease file and a slot file: mallory declines it ("lost"),
    keeps both and locks them later as a share would. Both files were replaced: alice and
    bob each get a share of the device's two slots."""
    inst = mu("four-gpus")
    d0 = inst.machine.leaf_uuids()[0]
    configured(inst, f'[sharing]\nslots = 2\n\n[devices]\nallow = ["{d0}"]\n')
    served = Served(inst)
    mallory = inst.world.carol
    try:
        client = inst.py_start(mallory, mallory_code(served), "lost", d0, "share")
        started.append(client)
        assert client.stdout.readline().decode().split() == ["kept", d0], client.stderr.read().decode()
        wait_for(lambda: any(r["pid"] == client.pid and "not taken" in r["how"] for r in _ledger(inst, "end")),
                 timeout=10, what="the grant void")
        os.kill(client.pid, signal.SIGUSR1)
        assert client.stdout.readline().strip() == b"locked"
        for user in (inst.world.alice, inst.world.bob):
            run = inst.start(user, "recon", "--hold", "30", CUDAWRAP_WAIT="0", CUDAWRAP_SHARE="1")
            started.append(run)
            assert ready_line(run)["cvd"] == d0
    finally:
        served.proc.terminate()
        served.proc.wait(timeout=10)
