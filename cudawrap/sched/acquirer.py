"""Taking free devices: all or nothing, in fair turns between users, released by the kernel.

A device is free when nobody holds its lease and NVML shows no process cudawrap did not
start (where process lists are hidden, when little memory is used). Every decision is
cudawrap.sched.schedule.decide over one look at the machine (leases from /proc/locks, waiters
from the queue); the flock on the lease file is the only step with effects, so when two
processes decide at once the kernel lets one of them win and the other decides again.

No daemon: each waiter decides for itself. So that hundreds of waiters cost nothing while
nothing changes, only the first few in line (WATCHERS) watch the lease and queue
directories through inotify; the others sleep until one of those pokes them (opens their
entry, which they watch) because they moved up or were given devices. A run that is given
devices but does not take them within GRACE_S (stopped, starved, or a fake) is passed over
by the others, its user for STALL_S, so nobody can hold others up for longer than that.
"""
from __future__ import annotations

import fcntl  # (leases.py has loaded it: free on the shim path)
import os
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    import select
    from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

    from ..base.inotify import Watch
    from .schedule import Bounds, Verdict, Waiter

from ..devices.model import Device
from ..errors import Interrupted, NoDeviceError
from ..lease.sharing import MPS, Sharing, mps_daemon
from ..lease.files import Lease, LeaseFiles, lock_table
# The scheduler (schedule.py) is imported where a decision is made: a launch nobody waits
# before takes its devices without one (_uncontended), and the shim pays for every module.
from .queue import Entry, Scan, WaitQueue, poke

# The first WATCHERS in line watch the machine; everyone else sleeps until poked, or IDLE_S.
WATCHERS = 8
IDLE_S = 30.0
# Only the first NEAR in line keep an inotify instance (to be poked): Linux allows a user 128
# (fs.inotify.max_user_instances), and a batch of 500 runs must not use them all up, leaving
# the runs at the head to poll. Those further back (or without an instance) sleep until runs
# leave the queue (farwait: dnotify, or the directory's mtime polled), at most once every
# FAR_POLL_S x (their position / 100), at least FAR_POLL_S; then they count how many of the
# runs ahead at their last look have left (one listing, no lock table) and decide again once
# fewer than NEAR are left, or IDLE_S x (position / NEAR) after their last decision (500
# waiters looking every 30 s would cost a quarter of a core).
NEAR = 48
FAR_POLL_S = 1.0
# A watcher re-looks this often even without events (NVML state has no event to watch).
WATCH_S = 1.0
# A look amended by events (a lease released, a run that left) serves at most this long.
AMEND_S = 10.0
# Batches of events that changed nothing, at most this many a second after a burst of
# (rate, burst): anyone can open a lease file or a queue entry in a loop (1000 a second made
# the waiters of others use a core), and each batch costs a waiter the same as one event.
# Past that, events wait to be read in one batch: a release 1/rate at most (a watcher);
# a poke of a run behind the watchers (who wait for nothing sooner) longer.
IDLE_BATCHES = (50.0, 10)
IDLE_POKES = (10.0, 3)
# A run behind the watchers, poked: it looks at once if fewer than WATCHERS of the runs
# ahead of it at its last look are left (they cannot be faked: nobody can remove another's
# entry); if a device it may use is free (maybe given to it), (rate, burst) at most; any
# poke once this long has passed since its last look.
POKED_LOOKS = (2.0, 3)
POKE_IDLE_S = 2.0
# A watcher whose look a newcomer or a lease file opened may have outdated looks again at
# once (rate, burst) at most, so that the release that follows is amended on a fresh look
# (a burst of launches); past that, the release is decided on a full look.
REFRESH_LOOKS = (2.0, 3)
MOVED_UP, FREE = "moved up", "free"
# In an amended lock table: a lease found held whose holder the look cannot name (pid -1:
# no process, so it counts for no waiting user).
UNKNOWN_HOLDER = (-1, True)
# Without inotify (out of watches) the watchers poll this often.
POLL_S = 0.02
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


def _raise_signal(signum: int, frame: object) -> None:
    raise Interrupted("interrupted while waiting for a device", exit_code=128 + signum)


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


class Acquirer:
    """One run's request for COUNT devices among CANDIDATES."""

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
    ) -> None:
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
        now = time.monotonic() if checked_at is None else checked_at
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
        now = time.monotonic()
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
        now = time.monotonic()
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
        now = time.monotonic()
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
        now = time.monotonic()
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
        now = time.monotonic()
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

        now = time.monotonic()
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

    # -- waiting -----------------------------------------------------------------------
    def acquire(self, wait_s: float, info: bytes,
                on_wait: Optional[Callable[[str], None]] = None) -> Lease:
        """Devices within WAIT_S seconds (inf: as long as it takes), in fair turns."""
        start = time.monotonic()
        deadline = start + wait_s
        lease = self._uncontended()
        if lease is not None:
            return lease
        from .schedule import GRANTED

        probe = self._me("~")  # sorts after every real key: a newcomer arrives last
        for _ in range(3):  # a lost race for a lock means someone else took it: look again
            scan = self.queue.scan()
            verdicts, _free = self.decide(scan, probe, queued=False)
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
            deadline = time.monotonic() + wait_s
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
        return self._wait(entry, deadline, wait_s, on_wait, verdict, ahead)

    def _wait(self, entry: Entry, deadline: float, wait_s: float,
              on_wait: Optional[Callable[[str], None]], first: Verdict, ahead: Set[str]) -> Lease:
        from ..base import inotify
        from .farwait import FarWait
        from .foreignwake import ForeignWake
        import select
        import signal  # waiting only: `signal` pulls in enum (~5 ms)

        from .schedule import GRANTED

        previous = {}
        for s in (signal.SIGTERM, signal.SIGHUP):
            try:
                previous[s] = signal.signal(s, _raise_signal)
            except ValueError:  # not the main thread: the caller keeps its own handlers
                pass
        own: Optional[Watch] = None  # one inotify instance: our entry, and the machine while a watcher
        world: List[int] = []  # its watches on the lease and queue directories
        # Watches of `own` removed since (the kernel never reuses a watch descriptor within
        # an instance): what they still report happened while unwatched, and is no news.
        removed: Set[int] = set()
        poller = select.poll()
        wake = ForeignWake(poller, self.snapshot)  # processes cudawrap did not start, leaving
        # The newcomer decided just before it queued: far back, it need not decide again
        # until the queue changes (a full look at 500 entries is ~10 ms, and each arrival of a
        # batch would otherwise pay it twice).
        position = placed = first.position
        last_decision = time.monotonic() if position >= NEAR else 0.0
        before: Optional[Set[str]] = ahead  # the runs ahead of us at our last look
        far: Optional[FarWait] = None  # far back: woken when runs leave the queue
        poked = False  # woken while not watching by a poke: we moved up, or were given devices
        # Once devices are reserved for us (policy reserve_after) we move up: look then.
        reserve_at = time.monotonic() + self.reserve_after
        told = ""  # the kind of wait last reported
        trace = bool(os.environ.get("CUDAWRAP_DEBUG"))
        verdicts: Dict[str, Verdict] = {}
        batches, pokes = _Budget(*IDLE_BATCHES), _Budget(*IDLE_POKES)  # for events that change nothing
        looks = _Budget(*POKED_LOOKS)  # for pokes that may be true, behind the watchers
        refresh = _Budget(*REFRESH_LOOKS)  # for looks outdated by a newcomer or a lease file opened
        try:
            if on_wait is not None:  # inside the try: a Ctrl-C from here on leaves the queue clean
                on_wait(first.text)  # what the newcomer's own decision said; later, what changed
            told = first.kind
            while True:
                by = self.queue.cancelled_by(entry)
                if by is not None:
                    raise Cancelled(f"cancelled by {by}")
                now = time.monotonic()
                if now >= deadline:
                    raise NoDeviceError(f"no device within {wait_s:g} s: {verdicts[entry.name].text}"
                                        if entry.name in verdicts else f"no device within {wait_s:g} s",
                                        hint="try again later, or set CUDAWRAP_WAIT=SECONDS")
                if (own is None and position >= WATCHERS and now < reserve_at
                        and now - last_decision < IDLE_S * max(1.0, position / NEAR)):
                    # Far back (or no inotify): decide again only once enough of those ahead of
                    # us at our last look have left; asleep until a run leaves the queue.
                    if far is None:
                        far = FarWait(self.queue.dir)
                    moved = far.moved()
                    if moved:
                        if before is None:
                            before = {k for k, v in verdicts.items() if v.position < placed}
                        try:
                            listed = os.listdir(self.queue.dir)
                        except OSError:
                            listed = []  # (all gone: decide)
                        # Junk can only add names, never remove those we counted.
                        position = max(0, placed - len(before.difference(listed)))
                    if not moved or position >= NEAR:
                        far.wait(FAR_POLL_S * max(1.0, position / 100),
                                 min(last_decision + IDLE_S * max(1.0, position / NEAR), reserve_at, deadline) - now,
                                 moved)
                        continue
                if now >= reserve_at:
                    reserve_at = float("inf")  # devices are reserved for us from now: one look to see it
                if far is not None:
                    far.moved()  # what happens from this look on counts for the next far wait
                last_decision = now
                before = None
                # Watch before looking where this look will probably say so (the place we
                # expect; a poke says we moved up): what changes during the look is then an
                # event, and the look need not be made again once the watch exists (~10 ms at
                # 500 waiters, paid by every run moving up).
                if own is None and position < NEAR:
                    own = self._watch_entry(entry, poller)
                if own is not None and not world and (position < WATCHERS or poked):
                    world = self._watch_world(own)
                poked = False
                scan = self.queue.scan(mine=entry.name)
                me = next((w for w in scan.waiters if w.key == entry.name), None)
                if me is None:  # our entry is not seen as valid (cannot happen unless tampered with)
                    me = self._me(entry.name)
                    verdicts, free = self.decide(scan, me, queued=False)
                else:
                    # What we ask for, we know first-hand; the entry says the same to others.
                    me.candidates, me.min_free_mib, me.max_util = self.wanted, self.min_free_mib, self.max_util
                    verdicts, free = self.decide(scan, me, queued=True)
                verdict = verdicts[entry.name]
                position = placed = verdict.position
                if trace:  # CUDAWRAP_DEBUG: every decision, for an admin asking "why"
                    os.write(2, (f"cudawrap[{os.getpid()}]: decision at {time.time():.3f}: free={free} skipped="
                                 f"{sorted(self.skip_keys)} " + "; ".join(
                                     f"{k.split('.')[1]}:{v.kind}:{','.join(v.devices)}"
                                     for k, v in sorted(verdicts.items(), key=lambda kv: kv[1].position))
                                 + "\n").encode())
                if verdict.kind == GRANTED:
                    lease = self._take(verdict.devices)
                    if lease is not None:
                        self._hand_over(verdicts, scan, entry.name)
                        return lease
                    _jitter()
                    continue
                if self.usable() < self.count:
                    if any(d.uuid in self.unavailable for d in self.candidates):
                        raise NoDeviceError("the devices this run may use were drained by an admin while it waited",
                                            hint="`cudawrap status` says why and since when")
                    raise NoDeviceError("the devices this run may use are gone (lost or removed)")
                if verdict.kind != told:
                    if on_wait is not None:
                        on_wait(verdict.text)
                    told = verdict.kind
                if self._watch_others(verdicts, scan, entry.name):
                    continue
                if position < NEAR and own is None:
                    own = self._watch_entry(entry, poller)
                    if own is not None:
                        continue  # something may have changed before the watch existed
                elif position >= NEAR and own is not None:
                    poller.unregister(own.fileno())
                    own.close()  # give the instance back for those nearer the head
                    own, world = None, []
                    removed = set()
                watcher = position < WATCHERS
                if watcher and own is not None and not world:
                    world = self._watch_world(own)
                    continue  # something may have changed before the watch existed
                if not watcher and world and own is not None:
                    for wd in world:
                        own.remove(wd)
                    removed.update(wd for wd in world if wd >= 0)  # (-1: never added; -1 also marks an overflow)
                    world = []
                if watcher and own is not None and min(world) >= 0:
                    # The head alone re-looks WATCH_S apart (NVML changes have no event); the
                    # other watchers wake on events, or when the head pokes them.
                    timeout = WATCH_S if position == 0 else IDLE_S
                elif watcher:
                    timeout = POLL_S
                elif own is not None:
                    timeout = IDLE_S
                else:
                    timeout = FAR_POLL_S * max(1.0, position / 100)
                if self.offered:
                    timeout = min(timeout, max(0.0, min(self.offered.values()) + GRACE_S - now))
                timeout = min(timeout, max(0.0, deadline - now))
                self.stale.update(d.uuid for d in self.candidates if d.uuid not in free)
                if own is None and not watcher:
                    continue  # to the far wait above
                if own is None:
                    time.sleep(timeout)
                    continue
                wake.follow(self.foreign_pids() if watcher else ())
                looked_at = time.monotonic()
                until = looked_at + timeout
                released: Set[str] = set()  # lease files closed since this look
                departed: Set[str] = set()  # queue entries removed since
                decided_on = _signature(scan)  # what the verdicts were last decided on
                pending = False  # another run's turn on what was amended: it should leave soon
                outdated = False  # a newcomer or a lock maybe taken since the look
                poke_due = False  # a poke worth a look once POKED_LOOKS allows
                while True:
                    left = (min(until, time.monotonic() + 0.1) if pending else until) - time.monotonic()
                    ready = poller.poll(left * 1000) if left > 0 else []
                    if not ready:
                        if poke_due:
                            looks.spend()
                            poked = True
                        break  # time for a full look
                    if wake.woken(ready) and self.foreign_left():
                        break  # a device is free of what kept it from us: a full look
                    # A job ended (its lease file closed) or a run left the queue: decide on this
                    # look, amended by what the events say, and take our turn at once (a full
                    # look instead if a newcomer came or a lease file was opened since: the look
                    # may be out of date). A cancel or an old look: a full look at once. A
                    # newcomer or a lease file opened alone cannot make it our turn: a full
                    # look only within REFRESH_LOOKS, for a fresh look at the next release.
                    budget = batches if watcher else pokes
                    budget.pause()  # a storm of events that change nothing: read them in one batch
                    events = [e for e in own.events() if e[0] not in removed]
                    if not events:
                        continue  # only what watches we removed saw (and IN_IGNORED for them)
                    if not watcher:
                        if any(mask != inotify.IN_OPEN for _wd, mask, _name in events):
                            break  # our entry written (a cancel), or events lost
                        # Poked: someone's look says we moved up or were given devices, if
                        # the poke is true (anyone may open our entry).
                        worth = self._poke_worth(looked_at, verdicts, entry.name, free)
                        if worth == MOVED_UP:
                            poked = True
                            break
                        if worth is not None:
                            due = looks.ready_at()
                            if due <= time.monotonic():
                                looks.spend()
                                poked = True
                                break
                            until, poke_due = min(until, due), True
                        budget.spend()
                        continue
                    seen = _amendments(events, world)
                    if seen is None or time.monotonic() - looked_at > AMEND_S:
                        break
                    if seen[3] and not outdated:
                        outdated = True
                        due = refresh.ready_at()
                        if due <= time.monotonic():
                            refresh.spend()
                            break
                        until = min(until, due)  # (and a full look then, as any look past UNTIL)
                    poke = seen[2] and self._poke_worth(looked_at, verdicts, entry.name, free) is not None
                    if not (seen[0] or seen[1] or poke):
                        budget.spend()
                        continue  # nothing freed, left or said: nothing to decide on
                    released |= seen[0]
                    departed |= seen[1]
                    amended = self._amend(scan, released, departed, verdicts)
                    signature = _signature(amended)
                    if signature == decided_on:
                        # Nothing freed, taken or left since the verdicts (a run that took its
                        # device closing the other lease files, a holder's probe): they stand.
                        # Eight watchers deciding again on each such event kept the one whose
                        # turn it was off the CPU for milliseconds.
                        pending = pending or poke
                        budget.spend()
                        continue
                    if outdated:
                        break  # something freed or left, on a look that may be out of date
                    decided_on = signature
                    verdicts, outcome = self._after_release(amended, me, entry.name, released, trace)
                    if outcome is not None:
                        self._hand_over(verdicts, scan, entry.name)
                        return outcome
                    if verdicts[entry.name].kind == GRANTED:
                        break  # our turn, and the race for the locks lost: a full look
                    # Another run's turn: it takes its devices and leaves the queue (an event);
                    # should it not within 0.1 s, a full look (which passes it over after
                    # GRACE_S). Poked, though not our turn here: a full look as soon, as the
                    # poker's look may be newer. Nobody's turn: the look stands, keep waiting.
                    pending = poke or any(v.kind == GRANTED for k, v in verdicts.items() if k != entry.name)
        except KeyboardInterrupt:
            raise Interrupted("interrupted while waiting for a device") from None
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.queue.leave(entry)
            if own is not None:
                own.close()
            if far is not None:
                far.close()
            wake.close()

    def _amend(self, scan: Scan, closed: Set[str], departed: Set[str], before: Dict[str, Verdict]) -> Scan:
        """SCAN (the last full look) as the events since say it is now, without reading
        /proc/locks (see _after_release).

        That read costs ~8 ms when nothing read it in the last moment (the kernel waits out an
        RCU grace period first), most of a hand-over. So the last look stands, amended: the
        leases of CLOSED count free; the runs of DEPARTED have left the queue, holding what
        BEFORE (the last verdicts) gave them. The look is otherwise current, as any other
        change (a newcomer, a lease file opened) makes the next one a full look. A wrong
        amendment costs a turn at most, never a device twice: should a closed lease still be
        held (someone only probed it), the flock says so and nothing is taken."""
        from ..proc import exiting, state

        table = dict(scan.table)
        releasing = []
        for uuid in closed:
            # Any process that looked at the machine had every lease file open and closes them
            # all when it goes (or execs its job): a close frees a lease only if its holders
            # are on their way out. The kernel reports the close a moment before it drops
            # the lock: the lock itself says when.
            ident = self.leases.ident(uuid)
            locks = table.get(ident)
            if locks is None:
                continue
            if all(exiting(pid) for pid, _ex in locks):
                releasing.append((uuid, ident))
            elif self.leases.free_now(uuid):
                del table[ident]  # let go by a process that lives on (the API's Lease.release)
                self._forget_slots(table, uuid, {pid for pid, _ex in locks})
        for uuid, ident in releasing:
            holders = [pid for pid, _ex in table.pop(ident)]
            self._forget_slots(table, uuid, set(holders))
            for _ in range(20):
                if self._vacant(uuid):
                    break
                if all(state(pid) in (None, b"Z") for pid in holders):
                    # They have exited and it is held: taken again since (by whom, below)
                    table[ident] = [UNKNOWN_HOLDER]
                    break
                time.sleep(0.0005)  # still exiting: the lock goes with its files
            else:
                table[ident] = [(pid, True) for pid in holders]
        if departed:
            # Runs that left the queue took devices free at the look or freed since (or gave
            # up). Which: their locks say (a probe holds a shared lock for microseconds; a
            # taker that meets one tries again). Who: the runs that left and still live (one
            # that has exited since holds nothing: its device, if held, was taken by someone
            # else), in their order of the last verdicts, each as many as it asked for.
            takers = sorted((w for w in scan.waiters if w.key in departed and not exiting(w.pid)),
                            key=lambda w: before[w.key].position if w.key in before else len(before))
            slots = [w.pid for w in takers for _ in range(w.count)]
            for uuid in self.current:
                ident = self.leases.ident(uuid)
                if ident is None or uuid in self.lost or (ident in table and table[ident][0][0] != UNKNOWN_HOLDER[0]):
                    continue
                if self._vacant(uuid):
                    table.pop(ident, None)
                else:
                    table[ident] = [(slots.pop(0), True) if slots else UNKNOWN_HOLDER]
        return Scan([w for w in scan.waiters if w.key not in departed], table, scan.paths)

    def _forget_slots(self, table: Dict[Tuple[int, int], List[Tuple[int, bool]]], uuid: str,
                      pids: Set[int]) -> None:
        """Drop from TABLE the locks of PIDS on UUID's slot files: their shares ended with their
        lease locks (left there, they would read as slots locked apart from the lease)."""
        if self.slots.get(uuid, 1) < 2:
            return
        for ident in self.leases.slot_idents(uuid, self.slots[uuid]):
            left = [lock for lock in table.get(ident, ()) if lock[0] not in pids]
            if left:
                table[ident] = left
            else:
                table.pop(ident, None)

    def _after_release(self, amended: Scan, me: Waiter, key: str, closed: Set[str], trace: bool
                       ) -> Tuple[Dict[str, Verdict], Optional[Lease]]:
        """A hand-over on an AMENDED look: (verdicts, our lease if it is our turn)."""
        from .schedule import GRANTED

        table = dict(amended.table)
        queued = any(w.key == key for w in amended.waiters)
        for _ in range(3):
            verdicts, free = self.decide(Scan(amended.waiters, table, amended.paths), me, queued=queued)
            verdict = verdicts[key]
            if trace:
                os.write(2, f"cudawrap[{os.getpid()}]: released {sorted(closed)} at {time.time():.3f}: {verdict.kind} "
                            f"{','.join(verdict.devices)} (free={free})\n".encode())
            if verdict.kind != GRANTED:
                return verdicts, None
            lease = self._take(verdict.devices)
            if lease is not None:
                return verdicts, lease
            # Another watcher, amending its own look, took them: count them held, decide again.
            for uuid in verdict.devices:
                ident = self.leases.ident(uuid)
                if ident is not None:
                    table.setdefault(ident, [UNKNOWN_HOLDER])
        return verdicts, None

    def _poke_worth(self, looked_at: float, verdicts: Dict[str, Verdict], me: str,
                    free: Sequence[str]) -> Optional[str]:
        """Whether a poke (our entry opened) may be true, and why: pokes are sent when we moved
        into the watching places or were given devices, and anyone can open our entry in a
        loop. MOVED_UP (look now): fewer than WATCHERS of the runs ahead of us at the look
        are left, or a device we may use was freed since the look (FREE at the look, a list
        of devices); neither can be faked, as nobody can remove another's entry or free
        another's lease. FREE (look within POKED_LOOKS): a device we may use is free, as it
        was at the look, or the look LOOKED_AT is POKE_IDLE_S old (a turn moved by a lease
        taken or let go elsewhere). None: a poke that cannot be true."""
        mine = verdicts.get(me)
        if mine is not None and mine.position >= WATCHERS:
            ahead = {k for k, v in verdicts.items() if v.position < mine.position}
            try:
                left = len(ahead.intersection(os.listdir(self.queue.dir)))
            except OSError:
                left = 0
            if left < WATCHERS:
                return MOVED_UP
        vacant = [d.uuid for d in self.candidates if d.uuid not in self.lost and self._vacant(d.uuid)]
        if any(u not in free for u in vacant):
            return MOVED_UP
        if vacant or self.share or time.monotonic() - looked_at >= POKE_IDLE_S:
            return FREE
        return None

    def _watch_entry(self, entry: Entry, poller: select.poll) -> Optional[Watch]:
        """An inotify instance watching our entry (pokes, a cancel); None if none is left."""
        from ..base import inotify
        import select

        own = inotify.open_watch()
        if own is not None:
            own.add(entry.path, inotify.IN_OPEN | inotify.IN_MODIFY)
            poller.register(own.fileno(), select.POLLIN)
        return own

    def _watch_world(self, own: Watch) -> List[int]:
        """Watch the machine as a watcher does: lease files opened and closed, runs coming
        and leaving (OWN's watches on the lease and queue directories)."""
        from ..base import inotify

        return [own.add(self.leases.dir, inotify.IN_CLOSE_NOWRITE | inotify.IN_CLOSE_WRITE | inotify.IN_OPEN),
                own.add(self.queue.dir, inotify.IN_CREATE | inotify.IN_DELETE
                        | inotify.IN_CLOSE_WRITE | inotify.IN_MOVED_TO)]

    def _hand_over(self, verdicts: Dict[str, Verdict], scan: Scan, me: str) -> None:
        """We leave the line: wake those who now move into the watching places."""
        from .schedule import GRANTED

        # The watchers see us leave (they watch the queue), but those behind them do not:
        # wake the next in line, and as many more as runs were given devices with us (they
        # leave too, and their views of the line may be older than ours: each wakes the
        # same few, so that none who moves up is left asleep, unwatched, until IDLE_S).
        leaving = sum(1 for v in verdicts.values() if v.kind == GRANTED)
        for key, v in verdicts.items():
            if key != me and WATCHERS <= v.position < WATCHERS + max(1, leaving) and key in scan.paths:
                poke(scan.paths[key])


class _Budget:
    """A leaky bucket: BURST at once, then RATE a second."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.at = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now

    def pause(self) -> None:
        """Sleep until there is one to spend."""
        self._refill()
        if self.tokens < 1:
            time.sleep((1 - self.tokens) / self.rate)

    def spend(self) -> None:
        self._refill()
        self.tokens -= 1

    def ready_at(self) -> float:
        """When there is one to spend (monotonic time)."""
        self._refill()
        return self.at + max(0.0, 1 - self.tokens) / self.rate


def _signature(scan: Scan) -> Tuple[int, FrozenSet[Tuple[Tuple[int, int], Tuple[Tuple[int, bool], ...]]]]:
    """What a decision on SCAN depends on that events change: who waits, who holds what."""
    return len(scan.waiters), frozenset((ident, tuple(locks)) for ident, locks in scan.table.items())


def _amendments(events: List[Tuple[int, int, str]], world: List[int]
                ) -> Optional[Tuple[Set[str], Set[str], bool, bool]]:
    """(lease files closed, queue entries removed, poked, outdated) from EVENTS; None if a
    full look is due at once: our entry written to (a cancel), events lost. Outdated: a
    queue entry made (a newcomer may come first) or a lease file opened (a lock may have
    been taken since the last look); neither can make it anyone's turn, so they only
    keep the look from being amended. A poke (our entry opened): someone's look says we
    moved up or it is our turn. WORLD: the watches on the lease and the queue directory."""
    from ..base import inotify
    from .queue import SUFFIX

    if len(world) != 2:
        return None
    closed: Set[str] = set()
    departed: Set[str] = set()
    poked = outdated = False
    for wd, mask, name in events:
        if wd == world[0] and not name:
            # The lease directory itself, listed (the monitor does, twice a second; so does
            # every newcomer): a listing takes no lock and frees none. Read as "a lock may
            # have been taken", it sent every watcher to a full look at once, all queued on
            # /proc/locks, just as a device freed: a hand-over of ~50 ms.
            continue
        if wd == world[0] and mask & (inotify.IN_CLOSE_WRITE | inotify.IN_CLOSE_NOWRITE):
            closed.add(name)
        elif wd == world[0] and mask & inotify.IN_OPEN:
            outdated = True
        elif wd == world[1] and mask & inotify.IN_DELETE and name.endswith(SUFFIX):
            departed.add(name)
        elif wd == world[1] and mask & inotify.IN_CLOSE_WRITE:
            pass  # an entry closed after writing (its owner leaving)
        elif wd == world[1] and mask & (inotify.IN_CREATE | inotify.IN_MOVED_TO | inotify.IN_DELETE):
            outdated = True  # a newcomer (or its temporary name)
        elif wd not in world and mask == inotify.IN_OPEN:
            poked = True
        else:
            return None
    return closed, departed, poked, outdated


def describe_wait(text: str) -> str:
    return f"waiting for a device: {text} (pid {os.getpid()})"
