"""The acquisition algorithm on real lease files and a real queue, with NVML data injected."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cudawrap.sched.request import Request
from support.sched import make_waiter
from cudawrap.sched.run import acquire
from cudawrap.sched.acquirer import Acquirer
from cudawrap.sched.machine import ViewOptions
from cudawrap.devices.model import Device
from cudawrap.errors import NoDeviceError
from cudawrap.install.installation import prepare_runtime
from cudawrap.lease.files import LeaseFiles
from cudawrap.ops.sync import sync_lease_files
from cudawrap.paths import Layout
from cudawrap.sched.queue import WaitQueue
from support.procs import Spawned, wait_for

UUID = "GPU-00000000-aaaa-bbbb-cccc-000000000001"


@pytest.fixture
def runtime(tmp_path: Path) -> Layout:
    layout = Layout(tmp_path)
    prepare_runtime(layout)
    sync_lease_files(str(layout.lease_dir), [UUID])
    return layout


def test_a_waiter_rereads_what_aged_while_it_slept(runtime: Layout) -> None:
    """The job seen on the device when the waiter queued has ended by its turn: no stale wait."""
    queue = WaitQueue(str(runtime.queue_dir))
    ahead = queue.enqueue(Request(1), b"pid=1\n")  # someone queued before us
    # The job: a live process (a pidfd opens on it), which ends as the run ahead leaves.
    seen_busy = Device(UUID, "H100", UUID, 0, None, 80000, 4000, (os.getpid(),))
    now_free = Device(UUID, "H100", UUID, 0, None, 80000, 0, ())
    reads = []
    left = []

    def refresh(device: Device) -> Device:
        reads.append((device.uuid, bool(left)))
        return now_free if left else seen_busy

    acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), queue, [seen_busy], [seen_busy], Request(1),
                        ViewOptions(refresh=refresh))
    leave = threading.Timer(0.1, lambda: (left.append(1), queue.leave(ahead)))
    leave.start()
    # Well under FOREIGN_RECHECK_S: only an immediate re-read once the line moved grants it
    # (a read before that is the watcher's warm-up: Acquirer.warm).
    lease = acquire(acquirer, 0.5, b"pid=2\n")
    leave.join()
    assert lease.uuids == [UUID] and reads[-1] == (UUID, True) and len(reads) <= 2, reads
    lease.release()


def test_taking_several_is_all_or_nothing(runtime: Layout) -> None:
    other = "GPU-00000000-aaaa-bbbb-cccc-000000000002"
    sync_lease_files(str(runtime.lease_dir), [UUID, other])
    devices = [Device(u, "H100", u, i, None, 80000, 0, ()) for i, u in enumerate((UUID, other))]
    queue = WaitQueue(str(runtime.queue_dir))
    holder = LeaseFiles(str(runtime.lease_dir))
    assert holder.try_lock(other)
    acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), queue, devices, devices, Request(2))
    with pytest.raises(NoDeviceError, match="1 usable device free, 1 more needed"):
        acquire(acquirer, 0, b"pid=2\n")
    # The free one was not kept: someone else can take it now.
    assert LeaseFiles(str(runtime.lease_dir)).try_lock(UUID)
    holder.close()


def test_a_stale_lock_table_never_removes_a_live_entry(runtime: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scan whose /proc/locks read misses a newcomer's lock (read a moment too early) must
    not take it for dead: the kernel is asked (a lock attempt) before anything is removed."""
    import cudawrap.sched.queue as waitqueue

    queue = WaitQueue(str(runtime.queue_dir))
    entry = queue.enqueue(Request(1), b"pid=1\n")
    monkeypatch.setattr(waitqueue, "lock_table", lambda: {})
    assert WaitQueue(str(runtime.queue_dir)).scan().waiters == []  # unseen this time...
    assert os.path.exists(entry.path)  # ...but not removed
    monkeypatch.undo()
    assert [w.key for w in WaitQueue(str(runtime.queue_dir)).scan().waiters] == [entry.name]
    queue.leave(entry)
    dead = queue.enqueue(Request(1), b"pid=1\n")
    os.close(dead.fd)  # its owner died: no lock, the next scan removes it
    assert WaitQueue(str(runtime.queue_dir)).scan().waiters == [] and not os.path.exists(dead.path)


def test_each_user_may_have_a_bounded_number_of_waiting_runs(runtime: Layout) -> None:
    from cudawrap.sched.queue import MAX_ENTRIES_PER_USER

    queue = WaitQueue(str(runtime.queue_dir))
    with pytest.raises(NoDeviceError, match=f"you already have {MAX_ENTRIES_PER_USER} runs waiting"):
        queue.enqueue(Request(1), b"", mine=MAX_ENTRIES_PER_USER)
    assert os.listdir(runtime.queue_dir) == []


def test_a_stale_snapshot_listing_the_job_that_held_the_lease_does_not_keep_it_busy(runtime: Layout,
                                                                                     spawned: Spawned) -> None:
    """NVML data read while a job ran (a monitor snapshot) lists its pid after it ended: a
    pid seen holding the lease and now gone is no work. A gone pid never seen holding one
    still counts (in a container NVML names host pids, which look gone)."""
    queue = WaitQueue(str(runtime.queue_dir))
    path = LeaseFiles(str(runtime.lease_dir)).path(UUID)
    job = spawned([sys.executable, "-c", "import fcntl, os, sys, time\n"
                   f"fd = os.open({path!r}, os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX)\n"
                   "print(flush=True); sys.stdin.read()"],
                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    job.stdout.readline()
    snapshot = Device(UUID, "H100", UUID, 0, None, 80000, 4000, (job.pid,))
    acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), queue, [snapshot], [snapshot], Request(1),
                        ViewOptions(refresh=lambda device: snapshot))
    ends = threading.Timer(0.3, job.stdin.close)
    ends.start()
    lease = acquire(acquirer, 5.0, b"pid=2\n")
    ends.join()
    job.wait()
    assert lease.uuids == [UUID]
    lease.release()
    # The same snapshot to a run that never saw that pid hold the lease: busy.
    other = Acquirer(LeaseFiles(str(runtime.lease_dir)), queue, [snapshot], [snapshot], Request(1),
                     ViewOptions(refresh=lambda device: snapshot))
    with pytest.raises(NoDeviceError):
        acquire(other, 0.3, b"pid=3\n")


def test_an_observer_sees_each_decision_and_a_waiter_decides_again_when_the_line_moves(runtime: Layout) -> None:
    """The observer is handed the arrival's decision (queued behind another run) and the
    waiter's next one, made once the run ahead left: the test waits on decisions, not time."""
    from cudawrap.sched.decision import Decision
    from cudawrap.sched.schedule import GRANTED

    queue = WaitQueue(str(runtime.queue_dir))
    ahead = queue.enqueue(Request(1), b"pid=1\n")
    device = Device(UUID, "H100", UUID, 0, None, 80000, 0, ())
    seen: list = []

    def observe(decision: Decision) -> None:
        seen.append((decision.cause, decision.verdicts[decision.key].kind))
        if decision.cause == Decision.ARRIVAL:
            queue.leave(ahead)  # the line moves only once the newcomer has decided to queue

    acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), queue, [device], [device], Request(1),
                        ViewOptions(refresh=lambda d: d), observe=observe)
    lease = acquire(acquirer, 60.0, b"pid=2\n")
    assert lease.uuids == [UUID]
    assert seen[0][0] == Decision.ARRIVAL and seen[0][1] != GRANTED
    assert seen[-1] == (Decision.LOOK, GRANTED)
    lease.release()


def test_the_wait_is_timed_by_the_injected_clock(runtime: Layout) -> None:
    """A clock that jumps an hour once the run has queued ends a minute's wait at once."""
    from cudawrap.sched.decision import Decision

    holder = LeaseFiles(str(runtime.lease_dir))
    assert holder.try_lock(UUID)
    device = Device(UUID, "H100", UUID, 0, None, 80000, 0, ())
    offset = [0.0]

    def observe(decision: Decision) -> None:
        if decision.cause == Decision.ARRIVAL:
            offset[0] = 3600.0

    acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), WaitQueue(str(runtime.queue_dir)), [device], [device],
                        Request(1), ViewOptions(refresh=lambda d: d, clock=lambda: 1000.0 + offset[0]), observe=observe)
    with pytest.raises(NoDeviceError, match="no device within 60 s"):
        acquire(acquirer, 60.0, b"pid=2\n")
    assert os.listdir(runtime.queue_dir) == []  # it left the line
    holder.close()


def test_the_debug_trace_is_an_observer_of_the_decisions_made_while_waiting(
        runtime: Layout, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    """CUDAWRAP_DEBUG adds the trace to a run's observers: each look while waiting, on stderr."""
    from cudawrap.sched.decision import Decision, trace
    from cudawrap.sched.schedule import GRANTED, Verdict

    monkeypatch.setenv("CUDAWRAP_DEBUG", "1")
    acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), WaitQueue(str(runtime.queue_dir)), [], [], Request(1))
    assert acquirer.observers == [trace]
    trace(Decision(Decision.LOOK, "1.a", {"1.a": Verdict(GRANTED, 0, "", (UUID,))}, [UUID], ["1.b"]))
    trace(Decision(Decision.ARRIVAL, "~", {"~": Verdict(GRANTED, 0, "", (UUID,))}, [UUID], []))
    err = capfd.readouterr().err
    assert f"free=['{UUID}'] skipped=['1.b'] a:granted:{UUID}" in err and len(err.splitlines()) == 1


def test_the_machine_view_decides_for_the_queue_without_a_run_of_its_own(runtime: Layout) -> None:
    """What `cudawrap status` shows: the view alone (no queue, no request) gives every waiter
    the verdict its own acquirer gives it, here the queued run's "held" while a lease is."""
    from cudawrap.sched.machine import MachineView
    from cudawrap.sched.schedule import GRANTED

    holder = LeaseFiles(str(runtime.lease_dir))
    assert holder.try_lock(UUID)
    device = Device(UUID, "H100", UUID, 0, None, 80000, 0, ())
    queue = WaitQueue(str(runtime.queue_dir))
    entry = queue.enqueue(Request(1), b"pid=1\n")
    scan = queue.scan()
    view = MachineView(LeaseFiles(str(runtime.lease_dir)), [device], [device])
    mine = Acquirer(LeaseFiles(str(runtime.lease_dir)), queue, [device], [device], Request(1))
    theirs, free = view.decide(scan, None, queued=True)
    assert free == [] and theirs[entry.name].kind != GRANTED
    assert theirs[entry.name].text == mine.decide(scan, None, queued=True)[0][entry.name].text
    holder.close()
    assert view.decide(queue.scan(), None, queued=True)[0][entry.name].kind == GRANTED
    queue.leave(entry)


def test_a_probe_seen_in_the_lock_table_holds_no_device_for_anyone(runtime: Layout) -> None:
    """A shared lock on the lease of a device of one slot is a watcher's probe (microseconds):
    the device is free and counts for nobody's turn (read as a share, it gave its prober's
    user a device, and the next turn to someone else)."""
    from cudawrap.sched.queue import Scan
    other = "GPU-00000000-aaaa-bbbb-cccc-000000000002"
    sync_lease_files(str(runtime.lease_dir), [UUID, other])
    devices = [Device(u, "H100", u, i, None, 80000, 0, ()) for i, u in enumerate((UUID, other))]
    leases = LeaseFiles(str(runtime.lease_dir))
    acquirer = Acquirer(leases, WaitQueue(str(runtime.queue_dir)), devices, devices, Request(1))
    probe = {leases.ident(other): [(os.getpid(), False)]}
    free, held, _busy, _shares = acquirer.machine(probe, leases.idents(acquirer.current))
    assert other in free and held == {}
    me = make_waiter("1.me", os.getuid(), os.getpid(), 1, None)
    verdicts, free = acquirer.decide(Scan([], probe, {}), me, queued=False)
    assert verdicts["1.me"].kind == "granted" and set(free) == {UUID, other}


def _behind(runtime: Layout, n: int):  # type: ignore[no-untyped-def]
    """N runs queued, the one device held: (the queue, their entries, the holder, an
    acquirer for a run that will wait behind them)."""
    queue = WaitQueue(str(runtime.queue_dir))
    ahead = [queue.enqueue(Request(1), b"pid=1\n") for _ in range(n)]
    device = Device(UUID, "H100", UUID, 0, None, 80000, 0, ())
    holder = LeaseFiles(str(runtime.lease_dir))
    assert holder.try_lock(UUID)
    return queue, ahead, holder, Acquirer(LeaseFiles(str(runtime.lease_dir)), queue, [device], [device], Request(1))


def test_a_run_behind_the_watchers_moves_up_without_a_poke(runtime: Layout) -> None:
    """The runs ahead leave and the device frees, and nobody pokes the run behind the
    watchers (as when leavers at once each poke the same few): it counts those ahead once a
    second (waiting.NEAR_CHECK_S) and takes the device, instead of sleeping IDLE_S (30 s)."""
    import time

    from cudawrap.sched.waiting import WATCHERS

    queue, ahead, holder, acquirer = _behind(runtime, WATCHERS + 2)
    said = []
    got = []
    looked = []
    acquirer.observers.append(lambda d: looked.append(d) if d.cause == d.LOOK else None)
    thread = threading.Thread(target=lambda: got.append(acquire(acquirer, 8.0, b"pid=2\n", said.append)))
    thread.start()
    wait_for(lambda: looked, 5, "its first look from its place in line")
    for entry in ahead:  # they leave without a word to those behind them
        queue.leave(entry)
    holder.close()
    began = time.monotonic()
    thread.join(timeout=10)
    assert got and got[0].uuids == [UUID], said
    assert time.monotonic() - began < 3.0
    got[0].release()


def test_a_far_run_that_moved_near_and_is_poked_before_its_next_look_keeps_waiting(runtime: Layout) -> None:
    """Far back at arrival, then near (runs ahead left) and poked again and again while it
    counts those ahead: it waits on and takes the device once the line is through. (The
    500-waiter bench had 12 runs die with AttributeError: a poke read the time of a look
    the run had not yet listened after; Waiting now sets it at arrival.)"""
    import time

    from cudawrap.sched.queue import poke
    from cudawrap.sched.waiting import NEAR, WATCHERS

    queue, ahead, holder, acquirer = _behind(runtime, NEAR + 5)
    said, got, failed = [], [], []

    def wait() -> None:
        try:
            got.append(acquire(acquirer, 15.0, b"pid=2\n", said.append))
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            failed.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_for(lambda: said)
    names = {e.name for e in ahead}
    (mine,) = [n for n in os.listdir(runtime.queue_dir) if n not in names]
    for entry in ahead[:NEAR - WATCHERS]:  # it moves near, still behind the watchers
        queue.leave(entry)
    for _ in range(30):  # pokes while it settles near (at most twice a second are looked at)
        poke(str(runtime.queue_dir / mine))
        time.sleep(0.1)
    for entry in ahead[NEAR - WATCHERS:]:
        queue.leave(entry)
    holder.close()
    thread.join(timeout=15)
    assert not failed, failed
    assert got and got[0].uuids == [UUID], said
    got[0].release()


def test_a_lease_held_by_nobody_named_is_not_searched_for_among_every_process(
        runtime: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service deciding for one run alone marks the leases it found held UNNAMED_HOLDER:
    held, counted for nobody, and no search of every process for the holder (heirs), which
    cost the service's grant ~3 ms here and grows with the machine's processes. A taker gone
    (UNKNOWN_HOLDER, the daemonless hand-over's) is still searched for."""
    from cudawrap.lease import holders
    from cudawrap.sched.decision import UNKNOWN_HOLDER
    from cudawrap.sched.tally import UNNAMED_HOLDER

    searched = []
    real = holders.heirs
    monkeypatch.setattr(holders, "heirs", lambda takers: searched.append(set(takers)) or real(takers))
    device = Device(UUID, "H100", UUID, 0, None, 80000, 0, ())
    leases = LeaseFiles(str(runtime.lease_dir))
    acquirer = Acquirer(leases, WaitQueue(str(runtime.queue_dir)), [device], [device], Request(1))
    ident = leases.ident(UUID)
    free, held, busy, _shares = acquirer.machine({ident: [UNNAMED_HOLDER]}, leases.idents(acquirer.current))
    assert free == [] and busy == {UUID} and held == {-1: 1} and searched == []
    acquirer.machine({ident: [UNKNOWN_HOLDER]}, leases.idents(acquirer.current))
    assert searched == [{ident}]


def test_a_run_behind_the_watchers_that_loses_the_race_for_its_grant_looks_again_at_once(runtime: Layout) -> None:
    """Two devices free up for a run behind the watchers (those ahead need more than there
    is), it is poked, and another process locks the one its look gave it between the look
    and its lock: it looks again at once and takes the other. It used to sleep behind the
    runs ahead as if told to wait, up to IDLE_S (30 s): in the 500-waiter bench, seven such
    losers at once left freed devices idle for ~25 s."""
    import time

    from cudawrap.sched.queue import poke
    from cudawrap.sched.waiting import IDLE_S, WATCHERS

    uuids = [UUID] + [f"GPU-00000000-aaaa-bbbb-cccc-00000000000{i}" for i in (2, 3)]
    sync_lease_files(str(runtime.lease_dir), uuids)
    devices = [Device(u, "H100", u, i, None, 80000, 0, ()) for i, u in enumerate(uuids)]
    queue = WaitQueue(str(runtime.queue_dir))
    ahead = [queue.enqueue(Request(3), b"pid=1\n") for _ in range(WATCHERS + 2)]  # all three each: none can start
    holder = LeaseFiles(str(runtime.lease_dir))
    assert all(holder.try_lock(u) for u in uuids)
    thief = LeaseFiles(str(runtime.lease_dir))
    thief.idents(uuids)  # its descriptors open already, as the winner's were: its lock makes no event
    stolen: list = []
    said: list = []
    got: list = []

    def steal(decision) -> None:  # type: ignore[no-untyped-def]
        verdict = decision.verdicts.get(decision.key)
        if decision.cause == decision.LOOK and verdict is not None and verdict.kind == "granted" and not stolen:
            stolen.extend(verdict.devices)
            assert thief.try_lock(verdict.devices[0])  # taken between its look and its lock

    acquirer = Acquirer(LeaseFiles(str(runtime.lease_dir)), queue, devices, devices, Request(1))
    acquirer.observers.append(steal)
    thread = threading.Thread(target=lambda: got.append(acquire(acquirer, IDLE_S + 10, b"pid=2\n", said.append)))
    thread.start()
    try:
        wait_for(lambda: said, 5, "its wait behind the runs ahead")
        assert "position" in said[0] and f"position {WATCHERS + 3}" in said[0], said
        names = {e.name for e in ahead}
        (mine,) = [n for n in os.listdir(runtime.queue_dir) if n not in names]
        holder.unlock(uuids[0])
        holder.unlock(uuids[1])
        began = time.monotonic()
        poke(str(runtime.queue_dir / mine))  # as a watcher's look that freed them pokes it
        thread.join(timeout=IDLE_S + 15)
        took = time.monotonic() - began
        assert got and stolen, (said, stolen)
        assert got[0].uuids != stolen and got[0].uuids[0] in uuids[:2]
        assert took < 5.0, f"took its device {took:.1f} s after the devices freed"
    finally:
        for lease in got:
            lease.release()
        thief.close()
        holder.close()
        for entry in ahead:
            queue.leave(entry)
        thread.join(timeout=IDLE_S + 15)
