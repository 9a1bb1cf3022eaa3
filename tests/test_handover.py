"""The fast hand-over: a watcher takes a freed device on its last look, amended by events.

A full look reads /proc/locks, which costs ~8 ms when nobody read it a moment before; a
waiter whose turn it is takes a device its holder released without that read. What it
trusts instead is tested here: only a holder that is really gone frees a lease (any process
closes every lease file it looked at), the kernel's flock decides every take, and anything
the events cannot amend (a newcomer, a lease file opened, a cancel) means a full look.
"""
import fcntl
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, List

import pytest

from cudawrap.sched.request import Request
from support.sched import make_waiter
from cudawrap.sched.run import acquire
from cudawrap.sched.decision import UNKNOWN_HOLDER, WATCHERS, Decision
from cudawrap.sched import queue as waitqueue
from cudawrap.base import inotify
from cudawrap.sched.acquirer import Acquirer
from cudawrap.sched.machine import ViewOptions
from cudawrap.sched.handover import after_release, amend, amendments, hand_over
from cudawrap.devices.model import Device
from cudawrap.install.installation import prepare_runtime
from cudawrap.lease.files import LeaseFiles
from cudawrap.paths import Layout
from cudawrap.base.proc import exiting
from cudawrap.ops.sync import sync_lease_files
from cudawrap.sched.queue import WaitQueue
from support.procs import Spawned, wait_for

UUIDS = [f"GPU-00000000-aaaa-bbbb-cccc-00000000000{i}" for i in (1, 2)]
HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


# The holders, probes and bystanders a test starts: reaped when it ends, passed or failed.
started = Spawned()


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[Layout]:
    layout = Layout(tmp_path)
    prepare_runtime(layout)
    sync_lease_files(str(layout.lease_dir), UUIDS)
    try:
        yield layout
    finally:
        started.close()


def hold(path: str) -> subprocess.Popen:
    """A process holding PATH's lease until its stdin closes."""
    proc = started([sys.executable, "-c", HOLD, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"held\n"
    return proc


def end(proc: subprocess.Popen) -> float:
    proc.stdin.close()
    proc.wait()
    return time.monotonic()


class Reads:
    """Every look at /proc/locks a waiter makes, timed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.at: List[float] = []
        real = waitqueue.lock_table

        def counted():  # type: ignore[no-untyped-def]
            self.at.append(time.monotonic())
            return real()

        monkeypatch.setattr(waitqueue, "lock_table", counted)


def devices() -> List[Device]:
    return [Device(u, "H100", u, i, None, 80000, 0, ()) for i, u in enumerate(UUIDS)]


class Waiting(threading.Thread):
    """A run waiting in this process; LOOKS: each full look it made (its decision observer)."""

    def __init__(self, runtime: Layout, out: list) -> None:
        super().__init__()
        self.looks: List[Decision] = []
        self.acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), WaitQueue(str(runtime.queue_dir)), devices(),
                                 devices(), Request(1), ViewOptions(refresh=lambda d: d), observe=self._seen)
        self.out = out

    def _seen(self, decision: Decision) -> None:
        if decision.cause == Decision.LOOK:
            self.looks.append(decision)

    def run(self) -> None:
        lease = acquire(self.acquirer, 10.0, b"pid=1\n")
        self.out.append((time.monotonic(), lease))


def waiter(runtime: Layout, out: list) -> Waiting:
    thread = Waiting(runtime, out)
    thread.start()
    return thread


def queued(thread: Waiting) -> None:
    """Until THREAD has made a full look from its place in line (its watches are set first)."""
    wait_for(lambda: thread.looks, 5, "the waiter's first look")


def test_a_released_device_is_taken_without_reading_the_lock_table(runtime: Layout,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    holders = [hold(f"{runtime.lease_dir}/{u}") for u in UUIDS]
    reads = Reads(monkeypatch)
    got: list = []
    thread = waiter(runtime, got)
    queued(thread)
    freed = end(holders[1])
    thread.join(5)
    taken, lease = got[0]
    assert lease.uuids == [UUIDS[1]]
    # Its last look came before the release; none between the release and the grant.
    assert not [t for t in reads.at if freed <= t <= taken]
    lease.release()
    end(holders[0])


def test_a_lease_let_go_by_a_process_that_lives_on_is_taken_without_reading_the_lock_table(
        runtime: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """The API's Lease.release closes the lease file and the process goes on: the waiter's
    flock finds it free on the close, with no full look."""
    holders = [hold(f"{runtime.lease_dir}/{u}") for u in UUIDS]
    let_go = started([sys.executable, "-c", HOLD.replace("sys.stdin.read()", "sys.stdin.readline(); "
                                                         "os.close(fd); print('closed', flush=True); "
                                                         "sys.stdin.read()"),
                      f"{runtime.lease_dir}/{UUIDS[1]}"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    end(holders.pop())
    assert let_go.stdout.readline() == b"held\n"
    reads = Reads(monkeypatch)
    got: list = []
    thread = waiter(runtime, got)
    queued(thread)
    let_go.stdin.write(b"\n")
    let_go.stdin.flush()
    assert let_go.stdout.readline() == b"closed\n"
    freed = time.monotonic()
    thread.join(5)
    assert let_go.poll() is None  # it lives on
    taken, lease = got[0]
    assert lease.uuids == [UUIDS[1]]
    assert not [t for t in reads.at if freed <= t <= taken]
    lease.release()
    end(let_go)
    end(holders[0])


def test_devices_taken_since_the_look_are_counted_for_the_runs_that_left_and_still_live(
        runtime: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two users, a turn rests on how many devices each holds. Since the last look
    a1 and b1 left the queue, each having taken a device; a1's job has ended since (its
    device is free again) and b1's holds the other. The device b1 holds is b1's, not the
    dead a1's (which would count one device for a1's user and none for b1's)."""
    dead = started(["true"])
    dead.wait()
    b1 = hold(f"{runtime.lease_dir}/{UUIDS[1]}")
    files = LeaseFiles(str(runtime.lease_dir))
    idents = [files.ident(u) for u in UUIDS]
    acquirer = Acquirer(files, WaitQueue(str(runtime.queue_dir)), devices(), devices(), Request(1), ViewOptions(refresh=lambda d: d))

    def waiter(key: str, pid: int):  # type: ignore[no-untyped-def]
        return make_waiter(key, os.geteuid(), pid, 1, None, "spread", 300.0, time.time(), "?", 0, 100, False)

    me = waiter("a3", os.getpid())
    # The last look: both devices held by jobs that have ended since (dead pids).
    look = waitqueue.Scan([waiter("a1", dead.pid), waiter("b1", b1.pid), me],
                          {idents[0]: [(dead.pid, True)], idents[1]: [(dead.pid, True)]}, {})
    seen: list = []
    decide = acquirer.decide

    def recorded(scan, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(dict(scan.table))
        return decide(scan, *args, **kwargs)

    monkeypatch.setattr(acquirer, "decide", recorded)
    amended = amend(acquirer, look, set(UUIDS), {"a1", "b1"}, {})
    _verdicts, lease = after_release(acquirer, amended, me, "a3", set(UUIDS))
    assert lease is not None and lease.uuids == [UUIDS[0]]  # the free one, ours
    assert seen[0] == {idents[1]: [(b1.pid, True)]}
    lease.release()
    end(b1)


ACQUIRE = sys.modules["cudawrap.sched.acquirer"]
WAITING = importlib.import_module("cudawrap.sched.waiting")
PROBE = HOLD.replace("fcntl.LOCK_EX", "fcntl.LOCK_SH")  # another watcher's probe, caught mid-probe


def probe(path: str) -> subprocess.Popen:
    """A process holding a shared lock on PATH, as a watcher's probe does for microseconds
    (longer when it is preempted meanwhile), until its stdin closes."""
    proc = started([sys.executable, "-c", PROBE, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == b"held\n"
    return proc


def test_probes_of_a_lease_do_not_meet_and_a_holder_is_seen(runtime: Layout) -> None:
    """Every watcher probes a freed lease on the same event: a probe must not read another's
    as a taker. An exclusive probe (free_now) does; a shared one (LOCK_SH) does not, and
    still sees a real holder."""
    files = LeaseFiles(str(runtime.lease_dir))
    other = probe(f"{runtime.lease_dir}/{UUIDS[0]}")
    assert files.free_now(UUIDS[0], fcntl.LOCK_SH)
    assert not files.free_now(UUIDS[0])  # what the watchers used to ask: read as taken
    end(other)
    holder = hold(f"{runtime.lease_dir}/{UUIDS[0]}")
    assert not files.free_now(UUIDS[0], fcntl.LOCK_SH)
    end(holder)
    assert files.free_now(UUIDS[0], fcntl.LOCK_SH) and files.free_now(UUIDS[0])


def amend_case(runtime: Layout, slots: int = 1):  # type: ignore[no-untyped-def]
    """An acquirer, its lease files' idents, and a helper making Waiters."""
    files = LeaseFiles(str(runtime.lease_dir))
    acquirer = Acquirer(files, WaitQueue(str(runtime.queue_dir)), devices(), devices(), Request(1), ViewOptions(refresh=lambda d: d))
    acquirer.slots = {u: slots for u in UUIDS}

    def waiter(key: str, pid: int):  # type: ignore[no-untyped-def]
        return make_waiter(key, os.geteuid(), pid, 1, None, "spread", 300.0, time.time(), "?", 0, 100, False)

    return acquirer, [files.ident(u) for u in UUIDS], waiter


def test_a_lease_freed_while_another_watcher_probes_it_counts_free(runtime: Layout) -> None:
    """The job on device 0 has ended; as this watcher amends its look, another watcher's
    probe holds the lease. Read as a taker, that probe cost the run whose turn it was its
    turn until the next full look (~100 ms in the benchmark burst): it counts free."""
    acquirer, idents, waiter = amend_case(runtime)
    dead = started(["true"])
    dead.wait()
    b1 = hold(f"{runtime.lease_dir}/{UUIDS[1]}")
    look = waitqueue.Scan([waiter("a3", os.getpid())],
                          {idents[0]: [(dead.pid, True)], idents[1]: [(b1.pid, True)]}, {})
    other = probe(f"{runtime.lease_dir}/{UUIDS[0]}")
    assert amend(acquirer, look, {UUIDS[0]}, set(), {}).table == {idents[1]: [(b1.pid, True)]}
    end(other)
    # Taken since by a real taker (an exclusive lock): held, by someone the look cannot name.
    taker = hold(f"{runtime.lease_dir}/{UUIDS[0]}")
    assert amend(acquirer, look, {UUIDS[0]}, set(), {}).table[idents[0]] == [UNKNOWN_HOLDER]
    end(taker)
    end(b1)


@pytest.mark.parametrize("slots", [1, 2])
def test_a_device_a_run_that_left_may_have_taken_is_probed_as_its_locks_allow(runtime: Layout, slots: int) -> None:
    """a1 left the queue; device 0 was free at the look. Only a shared lock on it: another
    watcher's probe on a device of one slot (free), a sharer's share on a device of two
    (a1 took a share: held)."""
    acquirer, idents, waiter = amend_case(runtime, slots)
    b1 = hold(f"{runtime.lease_dir}/{UUIDS[1]}")
    a1 = started(["sleep", "30"])
    look = waitqueue.Scan([waiter("a1", a1.pid), waiter("a3", os.getpid())], {idents[1]: [(b1.pid, True)]}, {})
    shared = probe(f"{runtime.lease_dir}/{UUIDS[0]}")
    table = amend(acquirer, look, set(), {"a1"}, {}).table
    assert table.get(idents[0]) == (None if slots == 1 else [(a1.pid, True)])
    end(shared)
    a1.kill()
    a1.wait()
    end(b1)


def test_a_taker_that_meets_a_probe_tries_again(runtime: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run whose turn it is takes the lease just as the other watchers probe it: a lock
    found held for a moment is tried again, and only one held throughout is lost. A run the
    service granted tries its locks by the same rule (wire.LOCK_TRIES, the shim's fast path)."""
    from cudawrap import wire

    assert (ACQUIRE.PROBE_TRIES, ACQUIRE.PROBE_GAP_S) == (wire.LOCK_TRIES, wire.LOCK_GAP_S)
    acquirer, _idents, _waiter = amend_case(runtime)
    files = acquirer.leases
    real = files.try_lock
    tries: List[str] = []

    def probed_meanwhile(uuid: str, *args):  # type: ignore[no-untyped-def]
        tries.append(uuid)
        return len(tries) >= ACQUIRE.PROBE_TRIES and real(uuid, *args)

    monkeypatch.setattr(files, "try_lock", probed_meanwhile)
    lease = acquirer.take_exactly([UUIDS[0]])
    assert lease is not None and lease.uuids == [UUIDS[0]] and len(tries) == ACQUIRE.PROBE_TRIES
    lease.release()
    tries.clear()
    monkeypatch.setattr(files, "try_lock", lambda uuid, *args: tries.append(uuid) and False)
    assert acquirer.take_exactly([UUIDS[0]]) is None and len(tries) == ACQUIRE.PROBE_TRIES


def test_events_that_change_nothing_are_not_decided_on(runtime: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that took its device closes every other lease file (held by running jobs): each
    watcher amends its look on that and finds it unchanged. Deciding again on it anyway, the
    eight watchers kept the CPU from the one whose turn it was."""
    holders = [hold(f"{runtime.lease_dir}/{u}") for u in UUIDS]
    lookers = [os.open(f"{runtime.lease_dir}/{u}", os.O_RDONLY) for _ in range(20) for u in UUIDS]
    decided: List[float] = []
    real = Acquirer.decide

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        decided.append(time.monotonic())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Acquirer, "decide", counted)
    got: list = []
    thread = waiter(runtime, got)
    queued(thread)
    wait_for(lambda: not decided or time.monotonic() - decided[-1] >= 0.3, 5)  # its first looks are over
    before = len(decided)
    for fd in lookers:  # closed, not opened: an open means a full look
        os.close(fd)
        time.sleep(0.005)
    time.sleep(0.1)
    # 40 closes; a full look or two meanwhile at most (the head looks again every WATCH_S).
    assert len(decided) - before <= 2 and got == []
    end(holders[0])
    thread.join(5)
    assert got[0][1].uuids == [UUIDS[0]]
    got[0][1].release()
    end(holders[1])


def test_closing_a_held_lease_file_frees_nothing(runtime: Layout) -> None:
    """Every process that looked closes the lease files: only the holder's going frees one."""
    holders = [hold(f"{runtime.lease_dir}/{u}") for u in UUIDS]
    got: list = []
    thread = waiter(runtime, got)
    queued(thread)
    for _ in range(20):  # others' looks ending
        for uuid in UUIDS:
            os.close(os.open(f"{runtime.lease_dir}/{uuid}", os.O_RDONLY))
        time.sleep(0.01)
    time.sleep(0.2)
    assert got == [] and all(p.poll() is None for p in holders)
    end(holders[0])
    thread.join(5)
    assert got[0][1].uuids == [UUIDS[0]]
    got[0][1].release()
    end(holders[1])


def test_a_lease_whose_taker_left_a_child_with_it_stays_held(runtime: Layout) -> None:
    """The process that took the lock has exited, a child keeps the descriptor: the taker
    being gone frees nothing; the child's end does."""
    path = f"{runtime.lease_dir}/{UUIDS[0]}"
    other = hold(f"{runtime.lease_dir}/{UUIDS[1]}")
    # The parent exits at once (fork() is true there); the child keeps the lock until EOF.
    child = started([sys.executable, "-c", HOLD.replace("sys.stdin.read()", "os.fork() or sys.stdin.read()"),
                     path], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"held\n"
    child.wait()
    got: list = []
    thread = waiter(runtime, got)
    queued(thread)
    for _ in range(5):
        os.close(os.open(path, os.O_RDONLY))
        time.sleep(0.05)
    assert got == []
    child.stdin.close()  # the child sees EOF and exits
    thread.join(5)
    assert got and got[0][1].uuids == [UUIDS[0]]
    got[0][1].release()
    end(other)


def test_exiting_is_true_only_for_processes_on_their_way_out() -> None:
    alive = subprocess.Popen(["sleep", "30"])
    try:
        assert not exiting(alive.pid)
        os.kill(alive.pid, signal.SIGSTOP)
        assert not exiting(alive.pid)  # stopped, not leaving
        os.kill(alive.pid, signal.SIGKILL)
        wait_for(lambda: exiting(alive.pid), 5)  # a zombie until reaped
    finally:
        alive.kill()
        alive.wait()
    assert exiting(alive.pid)  # reaped: gone


LEASES, QUEUE, OWN = 2, 3, 1
CLOSE = inotify.IN_CLOSE_NOWRITE


@pytest.mark.parametrize("events, expected", [
    ([(LEASES, CLOSE, "GPU-a")], ({"GPU-a"}, set(), False, False)),
    ([(LEASES, inotify.IN_CLOSE_WRITE, "GPU-a"), (QUEUE, inotify.IN_DELETE, "1.2.1sa.300.wait")],
     ({"GPU-a"}, {"1.2.1sa.300.wait"}, False, False)),
    ([(QUEUE, inotify.IN_CLOSE_WRITE, "1.2.1sa.300.wait"), (OWN, inotify.IN_OPEN, "")], (set(), set(), True, False)),
    # The lease directory listed (the monitor, a newcomer): no lock taken, none freed.
    ([(LEASES, inotify.IN_OPEN, ""), (LEASES, CLOSE, "")], (set(), set(), False, False)),
    ([(LEASES, inotify.IN_OPEN, ""), (LEASES, CLOSE, "GPU-a"), (LEASES, CLOSE, "")], ({"GPU-a"}, set(), False, False)),
    # What may outdate the look, but makes it nobody's turn: it is kept, not amended.
    ([(QUEUE, inotify.IN_DELETE, ".new-12-34")], (set(), set(), False, True)),  # a newcomer's temporary file
    ([(LEASES, CLOSE, "GPU-a"), (LEASES, inotify.IN_OPEN, "GPU-b")], ({"GPU-a"}, set(), False, True)),  # a lock may be taken
    ([(QUEUE, inotify.IN_CREATE, ".new-12-34")], (set(), set(), False, True)),  # a newcomer
    ([(QUEUE, inotify.IN_MOVED_TO, "1.2.1sa.300.wait")], (set(), set(), False, True)),
    ([(OWN, inotify.IN_MODIFY, "")], None),  # a cancel
    ([(-1, inotify.IN_Q_OVERFLOW, "")], None),  # events lost
])
def test_what_events_can_amend_a_look(events, expected) -> None:  # type: ignore[no-untyped-def]
    assert amendments(events, [LEASES, QUEUE]) == expected


def test_without_its_watches_a_waiter_amends_nothing() -> None:
    assert amendments([(LEASES, CLOSE, "GPU-a")], []) is None


def test_a_run_leaving_wakes_everyone_it_moves_into_the_watching_places(
        runtime: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven runs given devices at once leave together: the seven behind the watchers all
    move into the watching places. Each leaver wakes them all (its view of the line may be
    older than the others'), not only the next in line: one left unwoken would sleep through
    its turn (IDLE_S) if nobody looked meanwhile, as the last run of a benchmark burst did."""
    module = sys.modules["cudawrap.sched.handover"]
    from cudawrap.sched.schedule import BUSY, GRANTED, Verdict

    keys = [f"w{i:02d}" for i in range(20)]
    verdicts = {k: Verdict(GRANTED if i < 7 else BUSY, i, "") for i, k in enumerate(keys)}
    look = waitqueue.Scan([], {}, {k: f"/queue/{k}" for k in keys})
    poked: list = []
    monkeypatch.setattr(module, "poke", poked.append)
    acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), WaitQueue(str(runtime.queue_dir)), devices(),
                        devices(), Request(1), ViewOptions(refresh=lambda d: d))
    hand_over(acquirer, verdicts, look, "w00")
    assert sorted(poked) == [f"/queue/w{i:02d}" for i in range(module.WATCHERS, module.WATCHERS + 7)]
    # Alone in its turn, it wakes the next in line only.
    poked.clear()
    alone = {k: Verdict(GRANTED if i == 0 else BUSY, i, "") for i, k in enumerate(keys)}
    hand_over(acquirer, alone, look, "w00")
    assert poked == [f"/queue/w{module.WATCHERS:02d}"]


def test_a_storm_of_opens_of_a_held_lease_file_makes_no_looks(runtime: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anyone may open a lease file in a loop: an open alone cannot free a device, so the
    watcher does not look again at each (it did: a core for a dozen waiters), only within
    REFRESH_LOOKS (to have a fresh look for the release that follows), and misses nothing."""
    holders = [hold(f"{runtime.lease_dir}/{u}") for u in UUIDS]
    reads = Reads(monkeypatch)
    got: list = []
    thread = waiter(runtime, got)
    queued(thread)
    before = len(reads.at)
    started = time.monotonic()
    path = f"{runtime.lease_dir}/{UUIDS[0]}"
    for _ in range(500):
        os.close(os.open(path, os.O_RDONLY))
        time.sleep(0.001)
    took = time.monotonic() - started
    rate, burst = getattr(WAITING, "REFRESH_LOOKS", (2.0, 3))
    # Those looks, and the head's once a second (WATCH_S): a handful, not one per open.
    assert len(reads.at) - before <= burst + 1 + (rate + 1 / WAITING.WATCH_S) * took and got == []
    end(holders[0])
    thread.join(5)
    assert got and got[0][1].uuids == [UUIDS[0]]
    got[0][1].release()
    end(holders[1])


def test_pokes_that_cannot_be_true_make_a_waiter_behind_the_watchers_look_no_more(
        runtime: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Anyone may open a waiter's entry (a poke) in a loop. Behind the watchers, a run woken so
    looks only if the queue changed or a device it may use is free: with every device held
    and the line unchanged, 300 pokes make no look; once the runs ahead leave, one does."""
    holders = [hold(f"{runtime.lease_dir}/{u}") for u in UUIDS]
    ahead = []
    for i in range(WATCHERS):  # this process's own entries: alive, and first in line
        path = f"{runtime.queue_dir}/{time.time_ns():020d}.{os.getpid()}.1sa.300.wait"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        ahead.append((fd, path))
    reads = Reads(monkeypatch)
    got: list = []
    thread = waiter(runtime, got)
    queued(thread)  # it has looked: 9th in line, not a watcher
    (mine,) = set(os.listdir(runtime.queue_dir)) - {os.path.basename(p) for _fd, p in ahead}
    before = len(reads.at)
    for _ in range(300):
        waitqueue.poke(f"{runtime.queue_dir}/{mine}")
        time.sleep(0.001)
    time.sleep(0.1)
    assert len(reads.at) == before and got == []
    for fd, path in ahead:  # the runs ahead leave: now a poke is worth a look
        os.unlink(path)
        os.close(fd)
    waitqueue.poke(f"{runtime.queue_dir}/{mine}")
    wait_for(lambda: len(reads.at) != before, 5)
    end(holders[0])  # first in line now, and watching: it takes the device freed
    thread.join(5)
    assert got and got[0][1].uuids == [UUIDS[0]]
    got[0][1].release()
    end(holders[1])
