"""Reconnect tickets: a waiting run keeps its place across a kill -9 of the service.

The ticket itself (service/tickets.py) is checked on its own first: what restores an arrival
and what does not, the key file, the census a restarted service reads. Then with real
accounts under [service] enforce: a burst of 100 runs with the service killed in the
middle, a waiter stopped across the restart that still goes before a newcomer, and
tickets that are forged, lapsed, or another's, which change nobody's place.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from support.installed import ready_line
from support.procs import cli_code, root_only, wait_for
from cudawrap.service import tickets
from cudawrap.service.tickets import Census, Refused, Tickets
from test_enforce import _enforced
from test_service import Served, _ledger
from support.users import MuInstall

KEY = bytes(range(32))
UID, PID, START, ARRIVAL = 1001, 4242, 777, 1_000_000_000_123_456_789


def _given(now: float = 1000.0) -> str:
    """A ticket a service that started at 900 gave at NOW."""
    return Tickets(KEY, 900.0, boot="b").issue(UID, PID, START, ARRIVAL, now)


def test_a_ticket_restores_its_arrival_once_for_its_own_process_after_a_restart() -> None:
    restarted = Tickets(KEY, 1005.0, boot="b")
    ticket = _given()
    assert restarted.check(ticket, UID, PID, START, 1006.0) == ARRIVAL
    with pytest.raises(Refused, match="restored a place already"):
        restarted.check(ticket, UID, PID, START, 1007.0)


@pytest.mark.parametrize("change, reason", [
    (dict(uid=UID + 1), "given to uid 1001"),
    (dict(pid=PID + 1), "another process"),
    (dict(start=START + 1), "another process"),  # the pid reused by a later process
    (dict(start=None), "another process"),  # the process is gone
    (dict(now=1000.0 + tickets.TTL_S), "lapsed"),
    (dict(started=999.0), "given by this service"),  # no restart since: no place to restore
    (dict(now=1005.0 + tickets.RECONNECT_S), "after the restart"),
    (dict(key=bytes(32)), "signature"),
    (dict(boot="c"), "signature"),  # a ticket from before a reboot
], ids=["uid", "pid", "start", "gone", "lapsed", "same-service", "late", "key", "boot"])
def test_a_ticket_restores_nothing_for_anyone_or_anything_else(change: Dict, reason: str) -> None:
    judge = Tickets(change.get("key", KEY), change.get("started", 1005.0), boot=change.get("boot", "b"))
    with pytest.raises(Refused, match=reason):
        judge.check(_given(), change.get("uid", UID), change.get("pid", PID), change.get("start", START),
                    change.get("now", 1006.0))


@pytest.mark.parametrize("edit", [
    lambda t: t.replace(f".{ARRIVAL}.", f".{ARRIVAL - 10**12}."),  # an earlier arrival
    lambda t: t.rsplit(".", 1)[0] + "." + "0" * tickets.MAC_HEX,
    lambda t: t[:-1],
    lambda t: t + ".1",
    lambda t: "2" + t[1:],
    lambda t: "",
    lambda t: "x" * 1000,
], ids=["arrival", "mac", "short", "extra", "version", "empty", "huge"])
def test_an_altered_or_malformed_ticket_restores_nothing(edit) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(Refused):
        Tickets(KEY, 1005.0, boot="b").check(edit(_given()), UID, PID, START, 1006.0)


def _mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o777


def test_the_key_is_made_once_private_and_replaced_when_it_cannot_be_trusted(tmp_path: Path) -> None:
    path = tmp_path / "service.key"
    key, why = tickets.load_key(path)
    assert (len(key), why, _mode(path)) == (32, "missing", 0o600)
    assert tickets.load_key(path) == (key, "")
    path.chmod(0o640)  # readable by a group: anyone there could sign
    again, why = tickets.load_key(path)
    assert again != key and "mode 0640" in why and _mode(path) == 0o600
    path.write_bytes(b"short")
    assert tickets.load_key(path)[1] == "5 bytes long"
    path.unlink()
    (tmp_path / "elsewhere").write_bytes(bytes(32))
    path.symlink_to(tmp_path / "elsewhere")
    made, why = tickets.load_key(path)
    assert "cannot be read" in why and made != bytes(32) and not path.is_symlink()
    os.link(path, tmp_path / "second-name")
    assert "2 names" in tickets.load_key(path)[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "second-name", "service.key"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")
def test_a_key_of_another_user_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "service.key"
    path.write_bytes(bytes(32))
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    key, why = tickets.load_key(path)
    assert key != bytes(32) and "uid 65534" in why and os.stat(path).st_uid == 0


def test_the_census_tells_a_successor_how_many_hold_tickets_while_they_may_be_live(tmp_path: Path) -> None:
    path = tmp_path / "service.waiters"
    census = Census(path)
    assert census.previous(time.time()) == 0  # nothing said
    census.note(3, 100.0)
    assert Census(path).previous(time.time()) == 3
    census.note(5, 100.1)  # a rise: at once
    assert Census(path).previous(time.time()) == 5
    census.note(1, 100.2)  # a fall: not within a second of the last word
    assert Census(path).previous(time.time()) == 5
    census.note(1, 101.2)
    assert Census(path).previous(time.time()) == 1
    census.note(0, 101.3, exact=True)  # the service's last word as it stops: now
    assert Census(path).previous(time.time()) == 0
    census.note(4, 101.4)  # a rise: at once, whenever the last word was
    assert Census(path).previous(time.time()) == 4
    assert Census(path).previous(time.time() + tickets.TTL_S + 1) == 0  # their tickets have lapsed
    path.chmod(0o666)  # writable by others: not the service's word
    assert Census(path).previous(time.time()) == 0


def test_the_census_is_rewritten_in_place_whole_and_anew_once_removed(tmp_path: Path) -> None:
    """One record of one length over the last through one descriptor (no file renamed over
    it: ~2.4 ms on ext4, paid between hand-overs); an older, longer record is cut; a census
    removed meanwhile is written anew; a link planted in its place is not followed."""
    path = tmp_path / "service.waiters"
    path.write_bytes(b"7 1700000000.123\n" + b" " * 80)  # an older version's record, and more
    path.chmod(0o644)
    census = Census(path)
    census.note(12, 100.0)
    inode, size = path.stat().st_ino, path.stat().st_size
    census.note(1234, 100.1)
    census.note(2, 300.0)
    assert (path.stat().st_ino, path.stat().st_size) == (inode, size)
    assert Census(path).previous(time.time()) == 2 and len(path.read_bytes().split()) == 2
    path.unlink()
    census.note(3, 500.0)
    assert Census(path).previous(time.time()) == 3 and path.stat().st_mode & 0o777 == 0o644
    path.unlink()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    path.symlink_to(target)
    census.note(9, 700.0)
    assert target.read_bytes() == b"" and Census(path).previous(time.time()) == 0


# --- with real accounts, under [service] enforce -------------------------------------------

# A shell job: its own pid (the run's: the shim execs it), devices and times, in one write
# per line (O_APPEND), so the log says who held what when.
JOB = """#!/bin/sh
echo "$$ start $(date +%s.%N) $CUDA_VISIBLE_DEVICES" >> {log}
sleep {hold}
echo "$$ end $(date +%s.%N) $CUDA_VISIBLE_DEVICES" >> {log}
"""


def _job(inst: MuInstall, hold: float) -> str:
    real = inst.bindir / "CUDAWRAP_job"
    real.write_text(JOB.format(log=inst.log, hold=hold))
    real.chmod(0o755)
    (inst.bindir / "job").symlink_to(inst.layout.shim)
    return "job"


def _serve(inst: MuInstall, out: Path) -> subprocess.Popen:
    """The service as root, its log in OUT; returns once it listens."""
    code = cli_code(inst.path)
    proc = subprocess.Popen([inst.world.python, "-I", "-c", code, "serve"], env=inst.environ(),
                            stdout=out.open("w"), stderr=subprocess.STDOUT, cwd=inst.dir)
    inst.spawned.add(proc)
    wait_for(lambda: "listening on" in out.read_text() or proc.poll() is not None)
    assert proc.poll() is None, out.read_text()
    return proc


def _said(out: Path, what: str) -> List[str]:
    return [line for line in out.read_text().splitlines() if what in line]


def _granted_pids(out: Path) -> List[int]:
    """The pids the service granted, in its order ("granted DEV to uid U pid P (prog)")."""
    return [int(line.split(" pid ")[1].split()[0]) for line in _said(out, ": granted ")]


def _spans(log: Path) -> Dict[int, Dict[str, object]]:
    spans: Dict[int, Dict[str, object]] = {}
    for line in log.read_text().splitlines():
        pid, event, when, devices = line.split(" ", 3)
        spans.setdefault(int(pid), {})[event] = float(when)
        spans[int(pid)]["devices"] = devices
    return spans


def _overlapping(spans: Dict[int, Dict[str, object]]) -> List[str]:
    by_device: Dict[str, list] = {}
    for pid, span in spans.items():
        for uuid in str(span["devices"]).split(","):
            by_device.setdefault(uuid, []).append((span["start"], span.get("end", float("inf")), pid))
    bad = []
    for uuid, intervals in by_device.items():
        intervals.sort()
        bad += [f"{uuid}: {a} and {b}" for a, b in zip(intervals, intervals[1:]) if b[0] < a[1]]
    return bad


class Runs:
    """Wrapped runs started as users, their stderr in files (a burst has too many pipes)."""

    def __init__(self, inst: MuInstall) -> None:
        self.inst = inst
        self.procs: Dict[int, subprocess.Popen] = {}
        self.uid: Dict[int, int] = {}
        self.err: Dict[int, Path] = {}

    def start(self, user, program: str, **extra: str) -> int:  # type: ignore[no-untyped-def]
        err = self.inst.dir / f"err-{len(self.procs)}"
        with err.open("w") as f:
            proc = subprocess.Popen(user.argv([program]), env=self.inst.environ(**extra), stdout=subprocess.DEVNULL,
                                    stderr=f, cwd=self.inst.dir)
        self.inst.spawned.add(proc)
        self.procs[proc.pid], self.uid[proc.pid], self.err[proc.pid] = proc, user.uid, err
        return proc.pid

    def saying(self, what: str) -> List[int]:
        return [pid for pid, err in self.err.items() if what in err.read_text()]


@pytest.mark.root
@root_only
def test_a_burst_of_100_runs_across_a_kill_9_loses_none_and_waiters_keep_their_place(mu) -> None:
    inst = _enforced(mu, retry=30)
    # One device per user at a time: each decision grants a user at most one run, so the
    # order of the ledger's grants is the order of a user's turns (runs granted in one
    # decision take their grants in any order).
    with inst.layout.config_file.open("a") as f:
        f.write("[limits]\nmax_devices_per_user = 1\n")
    inst.cli(None, "sync")
    job = _job(inst, 0.2)
    first = _serve(inst, inst.dir / "service-1.log")
    runs = Runs(inst)
    for i in range(100):
        runs.start([inst.world.alice, inst.world.bob][i % 2], job, CUDAWRAP_WAIT="120")

    def begun() -> int:
        return len(_spans(inst.log))

    # In the middle: runs done, runs holding devices, and runs waiting in the service's line.
    wait_for(lambda: begun() >= 20 and len(runs.saying("waiting for a device")) - begun() >= 20, timeout=60)
    first.kill()
    first.wait()
    waited = set(runs.saying("waiting for a device"))
    # Newcomers while it is down: they try again, as the waiters do, and race them back in.
    newcomers = {runs.start([inst.world.alice, inst.world.bob][i % 2], job, CUDAWRAP_WAIT="120") for i in range(10)}
    wait_for(lambda: newcomers <= set(runs.saying("trying again")), timeout=30)
    out = inst.dir / "service-2.log"
    restarted = time.time()
    second = _serve(inst, out)
    try:
        for pid, proc in runs.procs.items():
            assert proc.wait(timeout=120) == 0, runs.err[pid].read_text()
        spans = _spans(inst.log)
        assert len(spans) == 110 and all("end" in s for s in spans.values())
        assert _overlapping(spans) == []
        # The order of the grants as the service made them: its ledger's (each grant is written
        # before its descriptors are sent; its log says "granted" once the lock is taken). An
        # offer left untaken past its deadline is made again: the one taken counts.
        made = {r["pid"]: i for i, r in enumerate(_ledger(inst, "grant")) if r["start"] >= restarted}
        order = sorted(set(_granted_pids(out)), key=made.__getitem__)
        back = {int(line.split(" pid ")[1].split()[0]): float(line.rsplit(" ", 1)[1])
                for line in _said(out, "is back in line")}
        resumed = waited & set(order)  # waiting at the kill, granted by the restarted service
        assert len(resumed) >= 20 and resumed <= set(back), (resumed - set(back), _said(out, "restores nothing"))
        assert newcomers <= set(order) and not newcomers & set(back)
        # A user's own runs go in arrival order: each user's waiters in their old order, and
        # before the newcomers that raced them back.
        for uid in {inst.world.alice.uid, inst.world.bob.uid}:
            mine = [p for p in order if runs.uid[p] == uid and (p in resumed or p in newcomers)]
            kinds = ["newcomer" if p in newcomers else "waiter" for p in mine]
            assert kinds == sorted(kinds, key=lambda k: k == "newcomer"), (uid, kinds)
            arrivals = [back[p] for p in mine if p in resumed]
            assert arrivals == sorted(arrivals), (uid, arrivals)
    finally:
        second.terminate()
        second.wait(timeout=10)


@pytest.mark.root
@root_only
def test_a_waiter_stopped_across_the_restart_goes_before_a_newcomer_of_the_grace(mu) -> None:
    """The waiter comes back only after the newcomer asked, with a device free all along:
    nothing is granted until the waiter is back in line, and then it goes first."""
    inst = _enforced(mu, retry=30)
    served = Served(inst)
    holders = served.fill()
    waiter = inst.start(inst.world.alice, "recon", "--hold", "60", CUDAWRAP_WAIT="120")
    assert b"waiting for a device" in waiter.stderr.readline()
    os.kill(waiter.pid, signal.SIGSTOP)
    served.proc.kill()
    served.proc.wait()
    holders[0].kill()  # a device free before the service is back
    holders[0].wait()
    out = inst.dir / "service-2.log"
    second = _serve(inst, out)
    try:
        wait_for(lambda: bool(_said(out, "runs that waited before the restart: 1;")))
        newcomer = inst.start(inst.world.alice, "recon", "--hold", "60", CUDAWRAP_WAIT="120")
        assert b"the service has just restarted" in newcomer.stderr.readline()
        hasty = inst.start(inst.world.alice, "recon", CUDAWRAP_WAIT="0")  # answered once it is over
        assert b"the service has just restarted" in hasty.stderr.readline()
        os.kill(waiter.pid, signal.SIGCONT)
        assert len(ready_line(waiter)["devices"]) == 1
        assert hasty.wait(timeout=30) == 75 and b"no free device" in hasty.stderr.read()
        assert _said(out, f"pid {waiter.pid} (uid {inst.world.alice.uid}) is back in line")
        wait_for(lambda: _granted_pids(out) == [waiter.pid])
        assert newcomer.poll() is None
        holders[1].kill()
        assert len(ready_line(newcomer)["devices"]) == 1
        wait_for(lambda: _granted_pids(out) == [waiter.pid, newcomer.pid])
    finally:
        second.terminate()
        second.wait(timeout=10)


@pytest.mark.root
@root_only
def test_a_service_stopped_cleanly_leaves_its_successor_no_grace_for_runs_that_left_the_line(mu) -> None:
    """The census's falls are written at most once a second, so the runs granted in the last
    one still count there; a clean stop writes the count of that moment, and the next
    service answers at once instead of waiting out its grace for runs that are not coming."""
    inst = _enforced(mu, retry=30)
    served = Served(inst)
    holders = served.fill()
    census = Census(inst.layout.service_waiters)
    waiters = [inst.start(inst.world.alice, "recon", "--hold", "60", CUDAWRAP_WAIT="120") for _ in range(2)]
    second: Optional[subprocess.Popen] = None
    try:
        for waiter in waiters:
            assert b"waiting for a device" in waiter.stderr.readline()
        assert census.previous(time.time()) == 2  # a rise is written at once
        for holder in holders[:2]:
            holder.kill()
            holder.wait()
        for waiter in waiters:
            assert len(ready_line(waiter)["devices"]) == 1
        served.proc.terminate()
        assert served.proc.wait(timeout=10) == 0
        assert census.previous(time.time()) == 0
        out = inst.dir / "service-2.log"
        second = _serve(inst, out)
        hasty = inst.start(inst.world.bob, "recon", CUDAWRAP_WAIT="0")
        assert hasty.wait(timeout=30) == 75
        said = hasty.stderr.read()
        assert b"no free device" in said and b"just restarted" not in said, said
        assert not _said(out, "runs that waited before the restart")
    finally:
        if second is not None:
            second.terminate()
            second.wait(timeout=10)
        for proc in holders[2:] + waiters:
            proc.kill()
            proc.wait()


# A raw client: prints its pid, then opens one connection per line of stdin (a ticket, or
# "-" for none), each asking for a device, and prints every message each one receives.
RAW = r"""
import os, socket, sys, threading
def talk(n, ticket):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sys.argv[1])
    extra = "" if ticket == "-" else "ticket=%s\n" % ticket
    s.sendall(("cudawrap/1 request\ncount=1\nwait=120\n%s\n" % extra).encode())
    buf = b""
    while True:
        data = s.recv(65536)
        if not data:
            print(n, "eof", flush=True)
            return
        buf += data
        while b"\n\n" in buf:
            msg, buf = buf.split(b"\n\n", 1)
            print(n, msg.decode().replace("\n", " "), flush=True)
print(os.getpid(), flush=True)
for n, line in enumerate(sys.stdin):
    threading.Thread(target=talk, args=(n, line.strip()), daemon=True).start()
"""


class Raw:
    def __init__(self, inst: MuInstall, user, sock: Path) -> None:  # type: ignore[no-untyped-def]
        self.proc = subprocess.Popen(user.argv([inst.world.python, "-I", "-c", RAW, str(sock)]),
                                     env=inst.environ(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, cwd=inst.dir)
        inst.spawned.add(self.proc)
        self.pid = int(self.proc.stdout.readline())
        self.asked = 0

    def ask(self, ticket: str = "-") -> str:
        """A new connection's request with TICKET; the first message it gets."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(ticket.encode() + b"\n")
        self.proc.stdin.flush()
        self.asked += 1
        while True:  # the connections before it may say more meanwhile
            line = self.proc.stdout.readline().decode()
            assert line, self.proc.stderr.read().decode()
            if line.startswith(f"{self.asked - 1} "):
                assert line.startswith(f"{self.asked - 1} cudawrap/1 wait"), line
                return line

    def ticket(self, message: str) -> Optional[str]:
        words = [w for w in message.split() if w.startswith("ticket=")]
        return words[0][len("ticket="):] if words else None


def _arrivals(inst: MuInstall) -> Dict[int, List[int]]:
    """pid -> the arrival (ns) of each of its waits in the service's line (root's status)."""
    import json

    done = inst.cli(None, "status", "--json")
    assert done.returncode == 0, done.stderr
    out: Dict[int, List[int]] = {}
    for w in json.loads(done.stdout)["waiting"]:
        out.setdefault(w["pid"], []).append(int(w["key"].split(".")[0]))
    return out


@pytest.mark.root
@root_only
def test_forged_lapsed_and_borrowed_tickets_jump_no_line(mu) -> None:
    from cudawrap.base.proc import start_time

    inst = _enforced(mu, retry=30)
    served = Served(inst)
    holders = served.fill()
    bob, alice = inst.world.bob, inst.world.alice
    owner = Raw(inst, bob, served.sock)
    real = owner.ticket(owner.ask())
    assert real is not None
    arrival = int(real.split(".")[4])
    borrower, other, forger, late = (Raw(inst, alice, served.sock), Raw(inst, bob, served.sock),
                                     Raw(inst, bob, served.sock), Raw(inst, bob, served.sock))
    served.proc.kill()
    served.proc.wait()
    assert owner.proc.stdout.readline().decode().split() == ["0", "eof"]
    out = inst.dir / "service-2.log"
    second = _serve(inst, out)
    restarted_ns = time.time_ns()
    try:
        key, _why = tickets.load_key(inst.layout.service_key)
        # Signed with the service's own key for its process, but lapsed: no other fault.
        lapsed = Tickets(key, 0.0).issue(bob.uid, late.pid, start_time(late.pid) or 0, arrival,
                                         time.time() - tickets.TTL_S - 1)
        own = f"1.{bob.uid}.{forger.pid}.{start_time(forger.pid)}.{arrival}.{int(time.time() * 1000) + 10**6}."
        owner.ask(real)
        for raw, ticket in ((owner, real), (borrower, real), (other, real), (forger, own + "0" * tickets.MAC_HEX),
                            (late, lapsed)):
            raw.ask(ticket)
        refused = {int(line.split("pid ")[1].split()[0]): line for line in _said(out, "restores nothing")}
        assert "restored a place already" in refused[owner.pid]
        assert f"given to uid {bob.uid}" in refused[borrower.pid]
        assert "given to another process" in refused[other.pid]
        assert "signature does not verify" in refused[forger.pid]
        assert "lapsed" in refused[late.pid]
        arrivals = _arrivals(inst)
        assert sorted(arrivals[owner.pid])[0] == arrival  # the owner's first reconnection
        assert all(a > restarted_ns for a in sorted(arrivals[owner.pid])[1:])
        for raw in (borrower, other, forger, late):
            assert all(a > restarted_ns for a in arrivals[raw.pid]), raw.pid
        for h in holders:
            h.kill()
    finally:
        second.terminate()
        second.wait(timeout=10)
