"""Taking free devices: all or nothing, in fair turns between users, released by the kernel.

A device is free when nobody holds its lease and NVML shows no process cudawrap did not
start (where process lists are hidden, when little memory is used). Every decision is
cudawrap.sched.schedule.decide over one look at the machine (leases from /proc/locks, waiters
from the queue); the flock on the lease file is the only step with effects, so when two
processes decide at once the kernel lets one of them win and the other decides again.

This module judges devices, decides and takes; a run that must queue waits for its turn
in waiting.py, which decides between full looks on looks amended by events (handover.py).
A run that is given devices but does not take them within GRACE_S (stopped, starved, or a
fake) is passed over by the others, its user for STALL_S, so nobody can hold others up for
longer than that.
"""
from __future__ import annotations

import fcntl  # (leases.py has loaded it: free on the shim path)
import os
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

    from .schedule import Bounds, Verdict, Waiter

from ..devices.model import Device
from ..errors import NoDeviceError
from ..lease.sharing import MPS, Sharing, mps_daemon
from ..lease.files import Lease, LeaseFiles, lock_table
# The scheduler (schedule.py) is imported where a decision is made: a launch nobody waits
# before takes its devices without one (_uncontended), and the shim pays for every module.
from .queue import Scan, WaitQueue, poke

# The first WATCHERS in line watch the machine (see waiting.py).
WATCHERS = 8
# In an amended lock table: a lease found held whose holder the look cannot name (pid -1:
# no process, so it counts for no waiting user).
UNKNOWN_HOLDER = (-1, True)
# A run given devices that has not taken them after this long loses its turn for STALL_S.
GRACE_S = 0.5
# Tries of a lease before a taker counts it taken (see Acquirer._lock).
PROBE_TRIES = 4
STALL_S = 5.0
# Within one user only arrival order is at stake, so a slow process of the same user (a
# loaded machine) is given longer before its own later runs pass it.
OWN_GRACE_S = 3.0
# NVML data older than this is re-read before a device is judged occupied by a process
# cudawrap did not start. A device whose lease was held at the last look is re-read at
# once: the processes seen on it were probably that job's, now gone.
FOREIGN_RECHECK_S = 1.0


class Cancelled(NoDeviceError):
    pass


def _uid_of(pid: int) -> int:
    """PID's real uid (whose lease it is, a setuid program exec'd on it included); -1 if gone."""
    from ..proc import real_uid  # only once a lease is seen held

    uid = real_uid(pid)
    return -1 if uid is None else uid


def _free_mib(device: Device) -> Optional[int]:
    """Memory free on DEVICE, None where it was not read (the lean launch path skips it)."""
    if device.memory_used_mib is None:
        return None
    return device.memory_total_mib - device.memory_used_mib


def _mps_server(pid: int, daemon: Optional[int]) -> bool:
    """Whether PID is an MPS server of cudawrap's: a child of DAEMON, the control daemon
    `cudawrap mps start` runs for the device (None: none runs). Never by its name: anyone can
    run a program named nvidia-cuda-mps-server."""
    if daemon is None:
        return False
    from ..proc import parent  # only once a process was seen on a device

    return parent(pid) == daemon


def mps_strangers(pids: Sequence[int], uids: Set[int], daemon: Optional[int],
                  gone: Callable[[int], bool] = lambda pid: False) -> List[int]:
    """Of PIDS on a device shared through MPS, those of users who hold no share there (UIDS
    do), other than the MPS server of DAEMON (cudawrap's control daemon for the device): MPS
    clients connected without a lease, or other work. The daemon serves one user at a time,
    so a sharer's next client would wait behind them. GONE: pids known to be no work. A pid
    without a process here (ended since NVML was read, or of another pid namespace) is not
    counted: whose it is cannot be told, and a sharer's own must not close its device."""
    out = []
    for pid in pids:
        uid = _uid_of(pid)
        if uid not in uids and uid != -1 and not gone(pid) and not _mps_server(pid, daemon):
            out.append(pid)
    return out


def _exited(pid: int) -> bool:
    from ..proc import exiting  # only once a lease holder was seen: not on a launch's path

    return exiting(pid)


def _stopped(pid: int) -> bool:
    """Whether PID is stopped (SIGSTOP, a debugger): it cannot take its turn now."""
    from ..proc import state

    return state(pid) in (b"T", b"t")


def _jitter() -> None:
    """A lost race for a lock: pause a random moment before deciding again, so that two
    runs that backed off together (two users' shares under MPS) do not collide again."""
    import random  # only after a lost race

    time.sleep(random.uniform(0, 0.02))


class Decision:
    """One decision as an observer sees it: what led to it (CAUSE: ARRIVAL, a run deciding
    before it queues; LOOK, a full look while waiting; RELEASE, a look amended by the leases
    RELEASED since), the VERDICTS for every waiter, the FREE devices, KEY the deciding run's
    entry (ARRIVAL: a key sorting after every real one) and SKIPPED the entries it passes over."""

    ARRIVAL, LOOK, RELEASE = "arrival", "look", "release"
    __slots__ = ("cause", "key", "verdicts", "free", "skipped", "released")

    def __init__(self, cause: str, key: str, verdicts: Dict[str, Verdict], free: List[str],
                 skipped: Iterable[str], released: Iterable[str] = ()) -> None:
        self.cause = cause
        self.key = key
        self.verdicts = verdicts
        self.free = free
        self.skipped = sorted(skipped)
        self.released = sorted(released)


def trace(d: Decision) -> None:
    """CUDAWRAP_DEBUG's observer: each decision while waiting on stderr (the arrival's
    verdict is what the run reports as it queues)."""
    if d.cause == Decision.RELEASE:
        verdict = d.verdicts[d.key]
        os.write(2, f"cudawrap[{os.getpid()}]: released {d.released} at {time.time():.3f}: {verdict.kind} "
                    f"{','.join(verdict.devices)} (free={d.free})\n".encode())
    elif d.cause == Decision.LOOK:
        os.write(2, (f"cudawrap[{os.getpid()}]: decision at {time.time():.3f}: free={d.free} skipped="
                     f"{d.skipped} " + "; ".join(
                         f"{k.split('.')[1]}:{v.kind}:{','.join(v.devices)}"
                         for k, v in sorted(d.verdicts.items(), key=lambda kv: kv[1].position))
                     + "\n").encode())


class Acquirer:
    """One run's request for COUNT devices among CANDIDATES.

    CLOCK (monotonic seconds) times the wait; OBSERVE is given each Decision."""

    def __init__(
        self,
        leases: LeaseFiles,
        queue: WaitQueue,
        candidates: Sequence[Device],
        all_devices: Sequence[Device],
        count: int,
        placement: str = "spread",
        foreign: str = "avoid",
        busy_memory_mib: int = 1024,
        refresh: Optional[Callable[[Device], Optional[Device]]] = None,
        checked_at: Optional[float] = None,
        reserve_after: float = 300.0,
        limit_of: Optional[Callable[[int], int]] = None,
        min_free_mib: int = 0,
        max_util: int = 100,
        drained: Optional[Callable[[], Set[str]]] = None,
        share: bool = False,
        sharing: Optional[Sharing] = None,
        unread: Sequence[str] = (),
        root: Optional[str] = None,
        snapshot: Optional[str] = None,
        admin: Optional[Callable[[], Tuple[float, int]]] = None,
        clock: Callable[[], float] = time.monotonic,
        observe: Optional[Callable[[Decision], None]] = None,
    ) -> None:
        self.clock = clock  # every timing of the wait: grace, stalls, reservations, re-reads
        # Who sees each decision (see Decision): OBSERVE, and with CUDAWRAP_DEBUG set the trace
        # on stderr for an admin asking "why".
        self.observers = [o for o in (observe, trace if os.environ.get("CUDAWRAP_DEBUG") else None) if o is not None]
        self.leases = leases
        self.root = root  # the install's: where its MPS daemons' pid files are
        self.queue = queue
        self.candidates = list(candidates)
        self.count = count
        self.placement = placement
        self.foreign = foreign
        self.busy_memory_mib = busy_memory_mib
        self.refresh = refresh
        self.reserve_after = reserve_after
        self.limit_of = limit_of or (lambda uid: 0)
        # (shortest reserve_after, largest max_gpus) of the admin's config: what every
        # waiter's claims are held to (schedule.Bounds); read at the first decision.
        self.admin = admin
        self.admin_bounds: Optional[Tuple[float, int]] = None
        self.unavailable: Set[str] = set()  # drained: never granted (from DRAINED, each decision)
        self.drained = drained  # re-read at every decision (an admin may drain meanwhile)
        self.min_free_mib = min_free_mib
        self.max_util = max_util
        self.uid = os.geteuid()
        self.current: Dict[str, Device] = {d.uuid: d for d in all_devices}
        self.parents = {d.uuid: d.parent_uuid for d in all_devices}
        self.sharing = sharing if sharing is not None else Sharing()
        self.share = share
        self.slots = {u: self.sharing.slots_for(u, p) for u, p in self.parents.items()}
        self.joined: Set[str] = set()  # devices that had sharers at the last decision
        self.used: Dict[str, List[int]] = {}  # and the uid of each of their shares
        now = self.clock() if checked_at is None else checked_at
        self.checked_at: Dict[str, float] = {d.uuid: now for d in all_devices}
        # Devices whose data may be stale: their lease was held at some look since they were
        # last read (the processes seen were probably that job's), or never read (UNREAD:
        # the launch had only the layout, and reads a device as it is about to take it).
        self.stale: Set[str] = set(unread)
        self.lost: Set[str] = set()
        # Those lost before this run queued: on a launch from sync's layout, a sign that the
        # layout is out of date (a MIG instance destroyed since), not of a GPU lost now.
        self.lost_on_arrival: Set[str] = set()
        self.queued = False
        self.mine = {d.uuid for d in self.candidates}
        self.wanted = None if self.mine >= set(self.current) else frozenset(self.mine)
        # What this process has seen of others taking their turns.
        self.offered: Dict[str, float] = {}
        self.skip_keys: Dict[str, float] = {}
        self.skip_users: Dict[int, float] = {}
        self.top: Set[str] = set()
        self.limits: Dict[int, int] = {}
        # Processes seen holding a lease. NVML data read while one ran (a monitor snapshot
        # half a second old) still lists it once it has exited: its pid is then no work.
        # Other pids count even if not found here: in a container, NVML names host pids.
        self.holders: Set[int] = set()
        # (lease file, pids that took its locks) -> the real uid of each lock's holder, read
        # once per lease (see _owners).
        self.owners: Dict[Tuple[Tuple[int, int], Tuple[int, ...]], List[int]] = {}
        # Our devices whose lease was free at the last look but which processes cudawrap did
        # not start kept from us; and the monitor's snapshot, whose rewrite may free them.
        self.foreign_busy: Set[str] = set()
        self.snapshot = snapshot

    # -- judging devices -------------------------------------------------------------
    def occupied(self, device: Device) -> bool:
        """Whether NVML shows work cudawrap did not start on DEVICE (its lease being free).

        The MPS server of cudawrap's daemon for DEVICE, left by shared runs that ended, is
        not work: it idles until stopped."""
        if self.foreign == "ignore":
            return False
        if device.pids is None:
            return (device.memory_used_mib or 0) > self.busy_memory_mib
        daemon: Optional[int] = -1  # not read yet: only once a process is seen
        for pid in device.pids:
            if pid in self.holders and _exited(pid):
                continue
            if daemon == -1:
                daemon = self.mps_daemon(device.uuid)
            if not _mps_server(pid, daemon):
                return True
        return False

    def mps_daemon(self, uuid: str) -> Optional[int]:
        """The pid of the MPS control daemon cudawrap runs for UUID, or None."""
        return mps_daemon(self.root, uuid, self.leases.owner) if self.root is not None else None

    def _recheck(self, uuid: str, now: float) -> bool:
        """Re-read DEVICE from NVML if its data may be stale; True if it is now free."""
        fresh = self.refresh(self.current[uuid]) if self.refresh else None
        if fresh is None:
            if self.refresh is not None:
                self.lost.add(uuid)  # NVML lost it mid-run: never hand it out
                if not self.queued:
                    self.lost_on_arrival.add(uuid)
            return False
        self.current[uuid] = fresh
        self.checked_at[uuid] = now
        self.stale.discard(uuid)
        return not self.occupied(fresh)

    def _eligible(self, uuid: str, now: float) -> bool:
        if uuid in self.stale and self.refresh is not None:
            # Meanwhile its job may have ended, its GPU been lost or its MIG instance destroyed
            # (the lease file outlives it until the next sync): only a fresh look tells.
            return self._recheck(uuid, now)
        if not self.occupied(self.current[uuid]):
            return True
        if now - self.checked_at[uuid] > FOREIGN_RECHECK_S:
            return self._recheck(uuid, now)
        return False

    def machine(self, table: Dict[Tuple[int, int], List[Tuple[int, bool]]]
                ) -> Tuple[List[str], Dict[int, float], Set[str], Shares]:
        """(free devices in the machine's order, devices held per uid, busy devices, shares)."""
        now = self.clock()
        free: List[str] = []
        held: Dict[int, float] = {}
        busy: Set[str] = set()
        used: Dict[str, List[int]] = {}
        closed: Set[str] = set()  # shared, but to take no new shares
        self.foreign_busy = set()
        idents = {uuid: self.leases.ident(uuid) for uuid in self.current}
        owners = self._owners({ident: table[ident] for ident in idents.values() if ident in table})
        for uuid, ident in idents.items():
            if ident is None:
                continue  # no lease file: cannot be leased (not synced yet)
            locks = table.get(ident)
            apart = self._slots_apart(uuid, locks, table)
            if locks is not None or apart:
                busy.add(uuid)
                self.stale.add(uuid)
                if len(self.holders) > 4096:
                    self.holders.clear()  # a long wait through many jobs: only recent ones matter
                self.holders.update(pid for pid, _ex in locks or ())
                if locks is not None and any(exclusive for _pid, exclusive in locks):
                    uid = owners[ident][0]
                    held[uid] = held.get(uid, 0) + 1
                    for uid in map(_uid_of, apart):
                        held[uid] = held.get(uid, 0) + self.sharing.cost(self.slots[uuid])
                    continue
                # Shared: each shared lock on the lease file is one share (see sharing.py),
                # and so is each slot locked apart from the lease.
                used[uuid] = list(owners.get(ident, ())) + [_uid_of(pid) for pid in apart]
                if self._strangers(uuid, set(used[uuid])):
                    closed.add(uuid)  # its sharers' next clients would wait behind another user's
                for uid in used[uuid]:
                    held[uid] = held.get(uid, 0) + self.sharing.cost(self.slots[uuid])
                if uuid in self.lost or uuid in self.unavailable:
                    closed.add(uuid)
            elif uuid in self.lost or uuid in self.unavailable:
                continue
            elif uuid in self.mine and self._eligible(uuid, now):
                free.append(uuid)
            elif uuid not in self.mine and not self.occupied(self.current[uuid]):
                # Another run's device: judged by what we know, never re-read from NVML
                # (the launch reads only its own candidates). A wrong guess here costs
                # fairness at most; whoever takes it checks it for itself.
                free.append(uuid)
            else:
                busy.add(uuid)
                if uuid in self.mine:
                    self.foreign_busy.add(uuid)
        slots = {u: 0 if u in closed else n for u, n in self.slots.items()}
        from .schedule import Shares

        return free, held, busy, Shares(slots, used, self.sharing.mode == MPS, self.sharing.counts_as)

    def _owners(self, held: Dict[Tuple[int, int], List[Tuple[int, bool]]]) -> Dict[Tuple[int, int], List[int]]:
        """Lease file -> the real uid of each lock's holder on it (-1 where none is known).

        The kernel records the pid that took a lock. Where that process has exited, the lock
        lives on in a descriptor it passed on (acquire(), fork, exit): the holder is then
        looked for among the processes this run may inspect (its own user's, every one for
        root), so that a user's own runs count such a lease against their limit. What was
        found, as every holder's uid, is remembered while the kernel shows the same takers
        on that lease: a decision reads /proc only for leases taken since the last one.
        """
        keys = {ident: (ident, tuple(pid for pid, _ex in locks)) for ident, locks in held.items()}
        new = {ident: [_uid_of(pid) for pid, _ex in held[ident]] for ident, key in keys.items()
               if key not in self.owners}
        gone = {ident: [None if uid < 0 else pid for (pid, _ex), uid in zip(held[ident], uids)]
                for ident, uids in new.items() if -1 in uids}
        if gone:
            from ..lease.holders import heirs  # only with a taker gone: not on a launch's usual path

            for ident, pids in heirs(gone).items():
                new[ident] = [-1 if p is None else _uid_of(p) for p in pids]
        if len(self.owners) + len(new) > 4096:
            self.owners.clear()  # a long wait through many jobs: only the current leases matter
        self.owners.update((keys[ident], uids) for ident, uids in new.items())
        return {ident: self.owners[key] for ident, key in keys.items()}

    def _strangers(self, uuid: str, uids: Set[int]) -> bool:
        """Whether UUID is shared through MPS and NVML shows a process there of a user who
        holds no share on it (see mps_strangers): it takes no new shares until they are gone."""
        pids = self.current[uuid].pids
        if self.sharing.mode != MPS or not pids or self.foreign == "ignore":
            return False
        return bool(mps_strangers(pids, uids, self.mps_daemon(uuid), lambda pid: pid in self.holders and _exited(pid)))

    def _joinable(self, uuid: str) -> bool:
        """Whether a share of UUID, which has sharers, may be taken: under MPS, NVML read
        again shows no user there but its sharers and us (see _strangers)."""
        if self.sharing.mode != MPS:
            return True
        fresh = self.refresh(self.current[uuid]) if self.refresh else None
        if fresh is not None:
            self.current[uuid] = fresh
        return not self._strangers(uuid, set(self.used.get(uuid, ())) | {self.uid})

    def _slots_apart(self, uuid: str, locks: Optional[List[Tuple[int, bool]]],
                     table: Dict[Tuple[int, int], List[Tuple[int, bool]]]) -> List[int]:
        """The takers of UUID's slot files locked by no process that locked its lease file too.

        A share takes both locks in one process (LeaseFiles.try_share), so its two lines in
        the lock table name the same pid. A slot locked alone keeps a sharer out as surely as
        a share does, but the lease file does not show it: without this, every shared run
        would be given the device, fail to lock a slot and, after its wait, give up, while
        the device looked free to all. A process that is closing its files is left out: at
        its exit the kernel may drop its lease lock a moment before its slot's."""
        if self.slots[uuid] < 2:
            return []
        sharers = {pid for pid, _ex in locks or ()}
        apart = [pid for ident in self.leases.slot_idents(uuid, self.slots[uuid])
                 for pid, _ex in table.get(ident, ()) if pid not in sharers]
        if not apart:
            return apart
        from ..proc import closing

        return [pid for pid in apart if not closing(pid)]

    def foreign_pids(self) -> Set[int]:
        """The processes on the devices that only processes cudawrap did not start keep from us."""
        return {pid for uuid in self.foreign_busy for pid in self.current[uuid].pids or ()}

    def foreign_left(self) -> bool:
        """Re-read those devices (one of their processes exited, or the snapshot was
        rewritten): whether any is free of them now."""
        now = self.clock()
        return any([self._recheck(uuid, now) for uuid in self.foreign_busy])

    def usable(self) -> int:
        return len([d for d in self.candidates if d.uuid not in self.lost and d.uuid not in self.unavailable])

    # -- deciding ----------------------------------------------------------------------
    def _limit(self, uid: int) -> int:
        if uid not in self.limits:
            self.limits[uid] = self.limit_of(uid)
        return self.limits[uid]

    def _passed_over(self, w: Waiter, me: Optional[str], now: float) -> bool:
        if w.key == me:
            return False
        if self.skip_keys.get(w.key, 0) > now:
            return True
        return w.uid != self.uid and self.skip_users.get(w.uid, 0) > now

    def decide(self, scan: Scan, me: Optional[Waiter], queued: bool) -> Tuple[Dict[str, Verdict], List[str]]:
        """Verdicts for everyone in SCAN plus ME (not yet queued unless QUEUED); free devices."""
        now = self.clock()
        key = me.key if me is not None else None
        waiters = [w for w in scan.waiters if not self._passed_over(w, key, now)]
        if me is not None and not queued:
            waiters.append(me)
        if self.drained is not None:
            self.unavailable = set(self.drained())
        free, held, busy, shares = self.machine(scan.table)
        self.joined = set(shares.used)
        self.used = shares.used
        limits = {w.uid: self._limit(w.uid) for w in waiters}
        fit = {u: (_free_mib(d), d.utilization) for u, d in self.current.items() if u in free or u in shares.used}
        from .schedule import decide

        verdicts = decide(waiters, free, held, limits, time.time(), self.parents, busy, fit, shares, self._bounds())
        return verdicts, free

    def _bounds(self) -> Bounds:
        """What the admin allows any run, and the devices that can be leased at all."""
        from .schedule import Bounds

        if self.admin_bounds is None:
            self.admin_bounds = self.admin() if self.admin is not None else (0.0, 0)
        leasable = frozenset(u for u in self.current if u not in self.lost and self.leases.ident(u) is not None)
        return Bounds(self.admin_bounds[0], self.admin_bounds[1], leasable)

    def _uncontended(self) -> Optional[Lease]:
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
        if self.share or self._limit(self.uid) or not self.queue.idle():
            return None
        if self.drained is not None:
            self.unavailable = set(self.drained())
        now = self.clock()
        pool = [d.uuid for d in self.candidates
                if d.uuid not in self.unavailable and d.uuid not in self.lost and self._fits(d.uuid)]
        if len(pool) < self.count:
            return None
        busy = {u for u, d in self.current.items()
                if u not in self.stale and (d.pids or (d.pids is None and self.occupied(d)))}
        unread = any(u in self.stale for u in pool)  # no monitor: NVML has not been asked yet
        if unread and self.placement != "random" and 1 < len({self.parents[u] for u in pool}) < len(pool):
            # Let go at once: a run deciding meanwhile must not see every free device taken.
            held = [uuid for uuid in pool if not self.leases.free_now(uuid)]
            busy.update(held)
            pool = [u for u in pool if u not in held]
        from .placement import place  # not schedule: the rest of it is for runs that wait

        locked: List[str] = []
        while len(locked) < self.count and pool:
            # One device at a time, each counted busy for the next, as place() does for a
            # whole request: the first choice usually stands, and ordering all 56 devices
            # of a DGX first would cost ~2 ms.
            uuid = place(pool, 1, self.placement, self.parents, busy, seed=str(os.getpid()))[0]
            pool.remove(uuid)
            busy.add(uuid)
            if not self.leases.try_lock(uuid):
                continue
            if self._eligible(uuid, now):
                locked.append(uuid)
            else:
                self.leases.unlock(uuid)  # a process cudawrap did not start is on it
        if len(locked) == self.count:
            return self.leases.take(locked)
        for uuid in locked:
            self.leases.unlock(uuid)
        return None

    def _take(self, uuids: Sequence[str]) -> Optional[Lease]:
        """Lock exactly UUIDS now (all or none) and hand them over as a Lease.

        A shared run takes a share of each device that has slots (a device of one slot
        whole); joining sharers, it does not judge the device by NVML as foreign work (their
        processes are not foreign) except, under MPS, the processes of users without a share
        there (_joinable); opening a device it does, as an exclusive run would.
        """
        now = self.clock()
        locked: List[str] = []
        shared = [u for u in uuids if self.share and self.slots.get(u, 1) > 1]
        for uuid in uuids:
            if not (self.leases.try_share(uuid, self.slots[uuid]) if uuid in shared
                    else self._lock(uuid)):
                break
            locked.append(uuid)
            if not (self._joinable(uuid) if uuid in self.joined else self._eligible(uuid, now)):
                break
        else:
            if not shared or self._shares_hold(shared):
                return self.leases.take(locked)
        for uuid in locked:
            self.leases.unlock(uuid)
        return None

    def _vacant(self, uuid: str) -> bool:
        """Whether nobody holds UUID, as the watchers ask it all at once as a lease frees.

        A device of one slot is only ever locked exclusively: probed shared (LeaseFiles.free_now
        with LOCK_SH), the watchers' probes never meet, where exclusive ones did, each reading another's
        probe as a taker (and the run whose turn it was lost it until the next full look,
        ~100 ms). A device shared in slots needs the exclusive probe (its sharers hold shared
        locks)."""
        return self.leases.free_now(uuid, fcntl.LOCK_EX if self.slots.get(uuid, 1) > 1 else fcntl.LOCK_SH)

    def _lock(self, uuid: str) -> bool:
        """UUID's lease, tried a few times over a millisecond: the watchers probe a lease as
        it frees (_vacant), just as the run whose turn it is takes it, each probe
        holding a shared lock for microseconds. One try would lose that run its turn to a
        probe, and ~100 ms until the next full look."""
        for _ in range(PROBE_TRIES - 1):
            if self.leases.try_lock(uuid):
                return True
            time.sleep(0.0003)
        return self.leases.try_lock(uuid)

    def _shares_hold(self, uuids: Sequence[str]) -> bool:
        """Whether the shares just taken of UUIDS stand: no device over its slots (an admin
        lowered them under running sharers) and, under MPS, no other user's sharers there
        (two users' runs decided at once from different looks: both back off and decide
        again, rather than one being stalled by MPS behind the other's clients)."""
        table = lock_table()
        for uuid in uuids:
            ident = self.leases.ident(uuid)
            locks = table.get(ident, []) if ident is not None else []
            if len(locks) > self.slots[uuid]:
                return False
            if self.sharing.mode == MPS and any(_uid_of(pid) != self.uid for pid, _ex in locks):
                return False
        return True

    def _fits(self, uuid: str) -> bool:
        d = self.current[uuid]
        free_mib = _free_mib(d)
        return ((self.min_free_mib <= 0 or (free_mib is not None and free_mib >= self.min_free_mib))
                and (d.utilization is None or d.utilization <= self.max_util))

    def _me(self, key: str) -> Waiter:
        from .schedule import Waiter

        return Waiter(key, self.uid, os.getpid(), self.count, self.wanted, self.placement,
                      self.reserve_after, time.time(), "?", self.min_free_mib, self.max_util, self.share)

    def _watch_others(self, verdicts: Dict[str, Verdict], scan: Scan, me: str) -> bool:
        """Note who was given devices and has not taken them; poke those to wake.

        True when someone was passed over just now (decide again at once).
        """
        from .schedule import GRANTED

        now = self.clock()
        changed = False
        # Only offers of devices this run could use can hold it up.
        granted = {k for k, v in verdicts.items()
                   if v.kind == GRANTED and k != me and any(u in self.mine for u in v.devices)}
        for key in list(self.offered):
            if key not in granted:
                del self.offered[key]
        owners = {w.key: w for w in scan.waiters}
        for key in granted:
            w = owners.get(key)
            if w is None:
                continue
            first = self.offered.setdefault(key, now)
            if first == now:
                poke(scan.paths[key])
            elif now - first >= (OWN_GRACE_S if w.uid == self.uid else GRACE_S) or _stopped(w.pid):
                self.skip_keys[key] = now + STALL_S
                if w.uid != self.uid:
                    self.skip_users[w.uid] = now + STALL_S
                del self.offered[key]
                changed = True
        top = {k for k, v in verdicts.items() if v.position < WATCHERS and k != me}
        for key in top - self.top:
            if key in scan.paths:
                poke(scan.paths[key])
        self.top = top
        return changed

    def _observe(self, cause: str, key: str, verdicts: Dict[str, Verdict], free: List[str],
                 released: Iterable[str] = ()) -> None:
        if self.observers:
            decision = Decision(cause, key, verdicts, free, self.skip_keys, released)
            for observe in self.observers:
                observe(decision)

    # -- taking ------------------------------------------------------------------------
    def acquire(self, wait_s: float, info: bytes,
                on_wait: Optional[Callable[[str], None]] = None) -> Lease:
        """Devices within WAIT_S seconds (inf: as long as it takes), in fair turns."""
        start = self.clock()
        deadline = start + wait_s
        lease = self._uncontended()
        if lease is not None:
            return lease
        from .schedule import GRANTED

        probe = self._me("~")  # sorts after every real key: a newcomer arrives last
        for _ in range(3):  # a lost race for a lock means someone else took it: look again
            scan = self.queue.scan()
            verdicts, free = self.decide(scan, probe, queued=False)
            self._observe(Decision.ARRIVAL, probe.key, verdicts, free)
            verdict = verdicts[probe.key]
            if verdict.kind != GRANTED:
                break
            lease = self._take(verdict.devices)
            if lease is not None:
                return lease
            _jitter()
        offered = {u for k, v in verdicts.items() if k != probe.key and v.kind == GRANTED for u in v.devices}
        if wait_s <= 0 and any(probe.can_use(u) and self._fits(u) for u in offered):
            # A device it could use is free but offered to a run ahead: wait long enough to
            # see that run take it, or be passed over for not taking it.
            wait_s = 2 * GRACE_S
            deadline = self.clock() + wait_s
        elif wait_s <= 0:
            raise NoDeviceError(f"no free device: {verdict.text}; waiting is off (wait = 0)",
                                hint="set CUDAWRAP_WAIT=SECONDS to wait")
        mine = sum(1 for w in scan.waiters if w.uid == self.uid)
        self.queued = True
        entry = self.queue.enqueue(self.count, self.placement,
                                   None if self.wanted is None else sorted(self.wanted),
                                   self.reserve_after, info, mine, self.min_free_mib, self.max_util,
                                   self.share)
        # Those at the head now were there before us: they need no poke from us later.
        self.top = {k for k, v in verdicts.items() if v.position < WATCHERS and k != probe.key}
        ahead = {k for k, v in verdicts.items() if v.position < verdict.position and k != probe.key}
        from .waiting import Waiting  # only a run that must queue waits

        return Waiting(self, entry, deadline, wait_s, on_wait, verdict, ahead).run()

def describe_wait(text: str) -> str:
    return f"waiting for a device: {text} (pid {os.getpid()})"
