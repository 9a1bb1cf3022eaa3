"""Taking free devices: all or nothing, in fair turns between users, released by the kernel.

A device is free when nobody holds its lease and NVML shows no process cudawrap did not
start (where process lists are hidden, when little memory is used). Every decision is
cudawrap.sched.schedule.decide over one look at the machine (leases from /proc/locks, waiters
from the queue); the flock on the lease file is the only step with effects, so when two
processes decide at once the kernel lets one of them win and the other decides again.

This module judges devices, decides and takes; a run that must queue waits for its turn
in waiting.py, which decides between full looks on looks amended by events (handover.py).
A run that is given devices but does not take them (stopped, blocked, or a fake; turns.py
tells those from a run only slow for want of a CPU) is passed over by the others, its user
for STALL_S, so nobody can hold others up for longer than that.
"""

import fcntl  # (leases.py has loaded it: free on the shim path)
import posix
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Union

    from .decision import Decision
    from .queue import Entry

    from .terms import Verdict, Waiter
    from .turns import Offers

from ..base.posixos import getenv
from ..devices.model import Device
from ..errors import NoDeviceError
from ..lease.sharing import MPS
from ..lease.files import Lease, LeaseFiles, lock_table
# The scheduler (schedule.py) is imported where a decision is made: a launch nobody waits
# before takes its devices without one (_uncontended), and the shim pays for every module.
from .machine import DEFAULTS, MachineView, ViewOptions, free_mib_of
from .queue import Scan, WaitQueue, poke
# decision.py (observers, the line's constants) is imported where a decision is made, as
# schedule.py is: a launch nobody waits before needs neither.
from .request import Request

# Tries of a lease before a taker counts it taken, and the pause between them (see _lock):
# those of a run the service granted, wire.LOCK_TRIES and LOCK_GAP_S (tests/test_handover.py
# holds them equal). Not imported from there: a launch without the service would load wire.
PROBE_TRIES = 4
PROBE_GAP_S = 0.0003


class Acquirer(MachineView):
    """One run's REQUEST for devices among CANDIDATES: decided on its view of the machine
    (MachineView, read and judged as OPTIONS say), taken by flock. SNAPSHOT: the monitor's
    (its rewrite may free devices foreign work kept); OBSERVE is given each Decision."""

    def __init__(self, leases: "LeaseFiles", queue: "WaitQueue", candidates: "Sequence[Device]",
                 all_devices: "Sequence[Device]", request: "Request", options: "ViewOptions" = DEFAULTS,
                 snapshot: "Optional[str]" = None, observe: "Optional[Callable[[Decision], None]]" = None) -> None:
        super().__init__(leases, candidates, all_devices, options)
        # Who sees each decision (see Decision): OBSERVE, and with CUDAWRAP_DEBUG set the trace
        # on stderr for an admin asking "why".
        self.observers = [o for o in (observe, _trace() if getenv("CUDAWRAP_DEBUG") else None) if o is not None]
        self.queue = queue
        # What we ask, with the devices we may use (None: any of the machine's).
        self.request = request.replace(candidates=None if self.mine >= set(self.current) else frozenset(self.mine))
        # What this process has seen of others taking their turns (and the view, passing over).
        self.offered: "Optional[Offers]" = None  # made at the first decision (turns.py is off a lone launch's path)
        self.top: "Set[str]" = set()
        self.snapshot = snapshot  # the monitor's: its rewrite may free devices foreign work kept

    def _uncontended(self) -> "Optional[Lease]":
        """Nobody waits: take free devices by trying their locks, without the lock table.

        With no waiter there is no turn to respect, so the decision is only which free
        devices to prefer, and trying a lock tells whether it is free. This spares the launch
        a read of /proc/locks, which costs ~10 ms when nothing has read it for a moment (the
        kernel waits for an RCU grace period to freeze the lock lists). A user with a limit,
        a shared run, or anyone in the queue: the full decision below.

        Devices are preferred by placement, judging busy GPUs by the processes NVML saw on
        them (the monitor's snapshot). Without the monitor nothing is read yet; where the
        placement then depends on how busy each physical GPU is (spread or pack over the
        MIG instances of several GPUs), every candidate's lock is tried first (and let go at
        once), and those held count as busy. The preferred devices are then judged one by
        one (NVML read now for a device not read yet), so such a launch reads one device,
        not all 56 of a DGX.
        """
        if self.request.share or self._limit(self.uid) or not self.queue.idle():
            return None
        if self.drained is not None:
            self.unavailable = set(self.drained())
        now = self.clock()
        pool = [d.uuid for d in self.candidates
                if d.uuid not in self.unavailable and d.uuid not in self.lost and self._fits(d.uuid)]
        if len(pool) < self.request.count:
            return None
        busy = {u for u, d in self.current.items()
                if u not in self.stale and (d.pids or (d.pids is None and self.occupied(d)))}
        unread = any(u in self.stale for u in pool)  # no monitor: NVML has not been asked yet
        if unread and self.request.placement != "random" and 1 < len({self.parents[u] for u in pool}) < len(pool):
            # Let go at once: a run deciding meanwhile must not see every free device taken.
            held = [uuid for uuid in pool if not self.leases.free_now(uuid)]
            busy.update(held)
            pool = [u for u in pool if u not in held]
        from .request import place  # not schedule: the rest of it is for runs that wait

        locked: "List[str]" = []
        while len(locked) < self.request.count and pool:
            # One device at a time, each counted busy for the next, as place() does for a
            # whole request: the first choice usually stands, and ordering all 56 devices
            # of a DGX first would cost ~2 ms.
            uuid = place(pool, 1, self.request.placement, self.parents, busy, seed=str(posix.getpid()))[0]
            pool.remove(uuid)
            busy.add(uuid)
            if not self.leases.try_lock(uuid):
                continue
            if self.eligible(uuid, now):
                locked.append(uuid)
            else:
                self.leases.unlock(uuid)  # a process cudawrap did not start is on it
        if len(locked) == self.request.count:
            return self.leases.take(locked)
        for uuid in locked:
            self.leases.unlock(uuid)
        return None

    def take_exactly(self, uuids: "Sequence[str]") -> "Optional[Lease]":
        """Lock exactly UUIDS now (all or none) and hand them over as a Lease.

        A shared run takes a share of each device that has slots (a device of one slot
        whole); joining sharers, it does not judge the device by NVML as foreign work (their
        processes are not foreign) except, under MPS, the processes of users without a share
        there (joinable); opening a device it does, as an exclusive run would.
        """
        now = self.clock()
        locked: "List[str]" = []
        shared = [u for u in uuids if self.request.share and self.slots.get(u, 1) > 1]
        for uuid in uuids:
            if not (self.leases.try_share(uuid, self.slots[uuid]) if uuid in shared
                    else self._lock(uuid)):
                break
            locked.append(uuid)
            if not (self.joinable(uuid) if uuid in self.joined else self.eligible(uuid, now)):
                break
        else:
            if not shared or self._shares_hold(shared):
                return self.leases.take(locked)
        for uuid in locked:
            self.leases.unlock(uuid)
        return None

    def vacant(self, uuid: str) -> bool:
        """Whether nobody holds UUID, as the watchers ask it all at once as a lease frees.

        A device of one slot is only ever locked exclusively: probed shared (LeaseFiles.free_now
        with LOCK_SH), the watchers' probes never meet, where exclusive ones did, each reading another's
        probe as a taker (and the run whose turn it was lost it until the next full look,
        ~100 ms). A device shared in slots needs the exclusive probe (its sharers hold shared
        locks)."""
        return self.leases.free_now(uuid, fcntl.LOCK_EX if self.slots.get(uuid, 1) > 1 else fcntl.LOCK_SH)

    def _lock(self, uuid: str) -> bool:
        """UUID's lease, tried a few times over a millisecond: the watchers probe a lease as
        it frees (vacant), just as the run whose turn it is takes it, each probe
        holding a shared lock for microseconds. One try would lose that run its turn to a
        probe, and ~100 ms until the next full look."""
        for _ in range(PROBE_TRIES - 1):
            if self.leases.try_lock(uuid):
                return True
            time.sleep(PROBE_GAP_S)
        return self.leases.try_lock(uuid)

    def _shares_hold(self, uuids: "Sequence[str]") -> bool:
        """Whether the shares just taken of UUIDS stand: no device over its slots (an admin
        lowered them under running sharers) and, under MPS, no other user's sharers there
        (two users' runs decided at once from different looks: both back off and decide
        again, rather than one being stalled by MPS behind the other's clients)."""
        from .tally import uid_of

        table = lock_table()
        for uuid in uuids:
            ident = self.leases.ident(uuid)
            locks = table.get(ident, []) if ident is not None else []
            if len(locks) > self.slots[uuid]:
                return False
            if self.sharing.mode == MPS and any(uid_of(pid) != self.uid for pid, _ex in locks):
                return False
        return True

    def _fits(self, uuid: str) -> bool:
        d = self.current[uuid]
        free_mib = free_mib_of(d)
        return ((self.request.min_free_mib <= 0 or (free_mib is not None and free_mib >= self.request.min_free_mib))
                and (d.utilization is None or d.utilization <= self.request.max_util))

    def waiter_of(self, key: str) -> "Waiter":
        from .terms import Waiter

        return Waiter(key, self.uid, posix.getpid(), self.request, time.time())

    def watch_others(self, verdicts: "Dict[str, Verdict]", scan: "Scan", me: str) -> bool:
        """Note who was given devices and has not taken them; poke those to wake.

        True when someone was passed over just now (decide again at once).
        """
        from .schedule import GRANTED

        now = self.clock()
        changed = False
        # Only offers of devices this run could use can hold it up.
        granted = {k for k, v in verdicts.items()
                   if v.kind == GRANTED and k != me and any(u in self.mine for u in v.devices)}
        from .turns import STALL_S, Offers

        if self.offered is None:
            self.offered = Offers()
        self.offered.keep(granted)
        owners = {w.key: w for w in scan.waiters}
        for key in granted:
            w = owners.get(key)
            if w is None:
                continue
            if self.offered.offer(key, w.pid, now, w.uid == self.uid):
                poke(scan.paths[key])
            elif self.offered.ignored(key, now):
                self.skip_keys[key] = now + STALL_S
                if w.uid != self.uid:
                    self.skip_users[w.uid] = now + STALL_S
                self.offered.drop(key)
                changed = True
        self.poke_new_watchers(verdicts, scan, me)
        return changed

    def poke_new_watchers(self, verdicts: "Dict[str, Verdict]", scan: "Scan", me: str) -> None:
        """Wake those VERDICTS put among the first WATCHERS since our last decision: they
        sleep until poked (waiting.py), and a line turning over fast (a batch of releases)
        must not run out of watchers, leaving freed devices idle until someone looks."""
        from .decision import WATCHERS

        top = {k for k, v in verdicts.items() if v.position < WATCHERS and k != me}
        for key in top - self.top:
            if key in scan.paths:
                poke(scan.paths[key])
        self.top = top

    def observe(self, cause: str, key: str, verdicts: "Dict[str, Verdict]", free: "List[str]",
                 released: "Iterable[str]" = ()) -> None:
        if self.observers:
            from .decision import Decision

            decision = Decision(cause, key, verdicts, free, self.skip_keys, released)
            for observe in self.observers:
                observe(decision)

    # -- taking ------------------------------------------------------------------------
    def arrive(self, wait_s: float, info: bytes) -> "Union[Lease, Queued]":
        """Devices now if this run's turn is now; else its place in the queue, to wait in
        (waiting.py, which run.acquire imports only then) until WAIT_S seconds from now."""
        start = self.clock()
        deadline = start + wait_s
        lease = self._uncontended()
        if lease is not None:
            return lease
        from .decision import Decision
        from .schedule import GRANTED

        probe = self.waiter_of("~")  # sorts after every real key: a newcomer arrives last
        for _ in range(3):  # a lost race for a lock means someone else took it: look again
            scan = self.queue.scan()
            verdicts, free = self.decide(scan, probe, queued=False)
            self.observe(Decision.ARRIVAL, probe.key, verdicts, free)
            verdict = verdicts[probe.key]
            if verdict.kind != GRANTED:
                break
            lease = self.take_exactly(verdict.devices)
            if lease is not None:
                return lease
            from .decision import jitter

            jitter()
        offered = {u for k, v in verdicts.items() if k != probe.key and v.kind == GRANTED for u in v.devices}
        if wait_s <= 0 and any(probe.can_use(u) and self._fits(u) for u in offered):
            # A device it could use is free but offered to a run ahead: wait long enough to
            # see that run take it, or be passed over for not taking it.
            from .turns import GRACE_S

            wait_s = 2 * GRACE_S
            deadline = self.clock() + wait_s
        elif wait_s <= 0:
            raise NoDeviceError(f"no free device: {verdict.text}; waiting is off (wait = 0)",
                                hint="set CUDAWRAP_WAIT=SECONDS to wait")
        mine = sum(1 for w in scan.waiters if w.uid == self.uid)
        self.queued = True
        entry = self.queue.enqueue(self.request, info, mine)
        # Those at the head now were there before us: they need no poke from us later.
        from .decision import WATCHERS

        self.top = {k for k, v in verdicts.items() if v.position < WATCHERS and k != probe.key}
        ahead = {k for k, v in verdicts.items() if v.position < verdict.position and k != probe.key}
        return Queued(entry, deadline, wait_s, verdict, ahead)


class Queued:
    """A run's place in the queue as it arrived: its ENTRY, when its wait ends (DEADLINE on
    the acquirer's clock, after WAIT_S seconds), the VERDICT that queued it and the runs
    AHEAD of it then."""

    __slots__ = ("entry", "deadline", "wait_s", "verdict", "ahead")

    def __init__(self, entry: "Entry", deadline: float, wait_s: float, verdict: "Verdict", ahead: "Set[str]") -> None:
        self.entry = entry
        self.deadline = deadline
        self.wait_s = wait_s
        self.verdict = verdict
        self.ahead = ahead


def describe_wait(text: str) -> str:
    return f"waiting for a device: {text} (pid {posix.getpid()})"


def _trace() -> "Callable[[Decision], None]":
    from .decision import trace

    return trace
