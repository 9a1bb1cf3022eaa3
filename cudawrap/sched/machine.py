"""The machine as one run sees it: which devices are free, held by whom, shared, busy with
work cudawrap did not start; and the decision for every waiter over that look
(cudawrap.sched.schedule.decide). The acquirer decides on it; `cudawrap status` shows it.

A device is free when nobody holds its lease and NVML shows no process cudawrap did not
start (where process lists are hidden, when little memory is used).
"""
from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

    from .schedule import Bounds, Decision, Shares, Waiter

from ..devices.model import Device
from ..errors import NoDeviceError
from ..lease.files import LeaseFiles
from ..lease.sharing import MPS, Sharing, mps_daemon
from .queue import Scan

# NVML data older than this is re-read before a device is judged occupied by a process
# cudawrap did not start. A device whose lease was held at the last look is re-read at
# once: the processes seen on it were probably that job's, now gone.
FOREIGN_RECHECK_S = 1.0


# In a lock table: a lease found held whose holder nobody needs named (pid -2): the service
# deciding for one run alone, without limits or sharing (service/waitline.py, _probed). Counted for no
# user, and never looked for among every process as a gone taker is (_owners: heirs).
UNNAMED_HOLDER = (-2, True)


def _uid_of(pid: int) -> int:
    """PID's real uid (whose lease it is, a setuid program exec'd on it included); -1 if gone."""
    from ..base.proc import real_uid  # only once a lease is seen held

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
    from ..base.proc import parent  # only once a process was seen on a device

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
    from ..base.proc import exiting  # only once a lease holder was seen: not on a launch's path

    return exiting(pid)


class MachineView:
    """What decisions are made on: the leases, the devices (CANDIDATES this run may use,
    of ALL_DEVICES), what NVML said of them and when, and the runs passed over."""

    def __init__(
        self,
        leases: LeaseFiles,
        candidates: Sequence[Device],
        all_devices: Sequence[Device],
        foreign: str = "avoid",
        busy_memory_mib: int = 1024,
        refresh: Optional[Callable[[Device], Optional[Device]]] = None,
        checked_at: Optional[float] = None,
        limit_of: Optional[Callable[[int], int]] = None,
        drained: Optional[Callable[[], Set[str]]] = None,
        sharing: Optional[Sharing] = None,
        unread: Sequence[str] = (),
        root: Optional[str] = None,
        admin: Optional[Callable[[], Tuple[float, int]]] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock  # every timing: grace, stalls, reservations, re-reads
        self.leases = leases
        self.root = root  # the install's: where its MPS daemons' pid files are
        self.candidates = list(candidates)
        self.foreign = foreign
        self.busy_memory_mib = busy_memory_mib
        self.refresh = refresh
        # What _joinable reads: NVML itself, where REFRESH reads a snapshot first (its fresh()):
        # an MPS client that connected since the snapshot would keep a new share waiting.
        self.reread = getattr(refresh, "fresh", refresh)
        self.warmed = False  # the source made ready for a hand-over (warm())
        self.limit_of = limit_of or (lambda uid: 0)
        # (shortest reserve_after, largest max_gpus) of the admin's config: what every
        # waiter's claims are held to (schedule.Bounds); read at the first decision.
        self.admin = admin
        self.admin_bounds: Optional[Tuple[float, int]] = None
        self.unavailable: Set[str] = set()  # drained: never granted (from DRAINED, each decision)
        self.drained = drained  # re-read at every decision (an admin may drain meanwhile)
        self.uid = os.geteuid()
        self.current: Dict[str, Device] = {d.uuid: d for d in all_devices}
        self.parents = {d.uuid: d.parent_uuid for d in all_devices}
        self.sharing = sharing if sharing is not None else Sharing()
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
        # Runs passed over for not taking what they were given (until when).
        self.skip_keys: Dict[str, float] = {}
        self.skip_users: Dict[int, float] = {}
        self.limits: Dict[int, int] = {}
        # Processes seen holding a lease. NVML data read while one ran (a monitor snapshot
        # half a second old) still lists it once it has exited: its pid is then no work.
        # Other pids count even if not found here: in a container, NVML names host pids.
        self.holders: Set[int] = set()
        # (lease file, pids that took its locks) -> the real uid of each lock's holder, read
        # once per lease (see _owners).
        self.owners: Dict[Tuple[Tuple[int, int], Tuple[int, ...]], List[int]] = {}
        # The service's books (service/grants.py): lease file -> {pid that took its lock: uid}
        # of each grant it made and has not seen let go. A lock a booked pid took is that
        # uid's, whatever process has the pid now; an exclusive one whose holder cannot be
        # named (its descriptor sent on into a socket, or mapped) is its one booked uid's.
        self.books: Dict[Tuple[int, int], Dict[int, int]] = {}
        # Our devices whose lease was free at the last look but which processes cudawrap did
        # not start kept from us.
        self.foreign_busy: Set[str] = set()
        self.aside: List[str] = []  # and those of them kept off only by this view's rule (machine())
        # The last decision's inputs, and uuid -> the uid holding it whole (machine): what a
        # release carries on without a new look (successor.py; the service's hand-over).
        self.last: Optional[Tuple[Sequence[Waiter], List[str], Dict[int, float], Dict[int, int], Set[str],
                                  Dict[str, Tuple[Optional[int], Optional[int]]], Shares, Bounds,
                                  Dict[str, Optional[Tuple[int, int]]]]] = None
        self.whole: Dict[str, int] = {}

    # -- judging devices -------------------------------------------------------------
    def occupied(self, device: Device) -> bool:
        """Whether NVML shows work cudawrap did not start on DEVICE (its lease being free).

        The MPS server of cudawrap's daemon for DEVICE, left by shared runs that ended, is
        not work: it idles until stopped."""
        if self.foreign == "ignore":
            return False
        if device.pids is None:
            return (device.memory_used_mib or 0) > self.busy_memory_mib
        return self.work(device) is not None

    def work(self, device: Device) -> Optional[int]:
        """The work cudawrap did not start on DEVICE, whatever the rule (schedule.kept judges
        it): None, none; schedule.LISTED, processes; else the MiB used where NVML hides them."""
        if device.pids is None:
            return device.memory_used_mib or 0
        daemon: Optional[int] = -1  # not read yet: only once a process is seen
        for pid in device.pids:
            if pid in self.holders and _exited(pid):
                continue
            if daemon == -1:
                daemon = self.mps_daemon(device.uuid)
            if not _mps_server(pid, daemon):
                return -1  # schedule.LISTED (schedule is not imported on a lone launch's path)
        return None

    def mps_daemon(self, uuid: str) -> Optional[int]:
        """The pid of the MPS control daemon cudawrap runs for UUID, or None."""
        return mps_daemon(self.root, uuid, self.leases.owner) if self.root is not None else None

    def warm(self) -> None:
        """Before our turn can come: re-read one of our devices now, so that the source is
        ready (NVML initialised: ~10 ms on an H200, plus the handle) and the hand-over's
        re-read of a freed device costs one query. The reading is kept, as any re-read's."""
        if self.refresh is None or self.warmed:
            return
        self.warmed = True
        for device in self.candidates:
            if device.uuid not in self.lost:
                self._recheck(device.uuid, self.clock())
                return

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

    def machine(self, table: Dict[Tuple[int, int], List[Tuple[int, bool]]],
                idents: Dict[str, Optional[Tuple[int, int]]],
                work: Optional[Dict[str, int]] = None) -> Tuple[List[str], Dict[int, float], Set[str], Shares]:
        """(free devices in the machine's order, devices held per uid, busy devices, shares);
        IDENTS: each device's lease file (LeaseFiles.idents). WORK (where given) gets the work
        cudawrap did not start on each device whose lease is free (self.work), and self.aside
        those of them this view's rule keeps off: for waiters judged by a rule of their own."""
        now = self.clock()
        free: List[str] = []
        held: Dict[int, float] = {}
        busy: Set[str] = set()
        used: Dict[str, List[int]] = {}
        closed: Set[str] = set()  # shared, but to take no new shares
        self.foreign_busy = set()
        self.aside = []
        self.whole = {}
        owners = self._owners({ident: table[ident] for ident in idents.values() if ident in table})
        for uuid, ident in idents.items():
            if ident is None:
                continue  # no lease file: cannot be leased (not synced yet)
            locks = table.get(ident)
            if locks is not None and self.slots[uuid] < 2 and not any(exclusive for _pid, exclusive in locks):
                # A device of one slot is only ever held exclusively: shared locks on its
                # lease are probes (Acquirer._vacant, microseconds each). Read as shares,
                # a watcher's probe caught by /proc/locks counted a device for its user,
                # and the next turn went to another (test_fairness, on a loaded machine).
                locks = None
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
                    self.whole[uuid] = uid
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
                    if work is not None and uuid not in self.stale:
                        self.aside.append(uuid)
        for uuid in free + self.aside if work is not None else ():
            seen = self.work(self.current[uuid]) if uuid in self.mine else None
            if seen is not None:
                work[uuid] = seen
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
        unnamed = UNNAMED_HOLDER[0]
        new = {ident: [-1 if pid == unnamed else _uid_of(pid) for pid, _ex in held[ident]]
               for ident, key in keys.items() if key not in self.owners}
        gone = {ident: [None if uid < 0 and pid != unnamed else pid for (pid, _ex), uid in zip(held[ident], uids)]
                for ident, uids in new.items()}
        gone = {ident: pids for ident, pids in gone.items() if None in pids}
        if gone:
            from ..lease.holders import heirs  # only with a taker gone: not on a launch's usual path

            for ident, pids in heirs(gone).items():
                new[ident] = [-1 if p is None or p == unnamed else _uid_of(p) for p in pids]
        if len(self.owners) + len(new) > 4096:
            self.owners.clear()  # a long wait through many jobs: only the current leases matter
        self.owners.update((keys[ident], uids) for ident, uids in new.items())
        out = {ident: self.owners[key] for ident, key in keys.items()}
        for ident, taken in self.books.items():
            if ident in out:
                booked = set(taken.values())
                out[ident] = [taken.get(pid, next(iter(booked)) if uid < 0 and ex and len(booked) == 1 else uid)
                              for (pid, ex), uid in zip(held[ident], out[ident])]
        return out

    def _strangers(self, uuid: str, uids: Set[int]) -> bool:
        """Whether UUID is shared through MPS and NVML shows a process there of a user who
        holds no share on it (see mps_strangers): it takes no new shares until they are gone."""
        pids = self.current[uuid].pids
        if self.sharing.mode != MPS or not pids or self.foreign == "ignore":
            return False
        return bool(mps_strangers(pids, uids, self.mps_daemon(uuid), lambda pid: pid in self.holders and _exited(pid)))

    def _joinable(self, uuid: str, uid: Optional[int] = None) -> bool:
        """Whether a share of UUID, which has sharers, may be taken (by UID; None: us): under
        MPS, NVML read again shows no user there but its sharers and the taker (see _strangers)."""
        if self.sharing.mode != MPS:
            return True
        fresh = self.reread(self.current[uuid]) if self.reread else None
        if fresh is not None:
            self.current[uuid] = fresh
        return not self._strangers(uuid, set(self.used.get(uuid, ())) | {self.uid if uid is None else uid})

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
        from ..base.proc import closing

        return [pid for pid in apart if not closing(pid)]

    def foreign_pids(self) -> Set[int]:
        """The processes on the devices that only processes cudawrap did not start keep from us."""
        return {pid for uuid in self.foreign_busy for pid in self.current[uuid].pids or ()}

    def foreign_freed(self) -> bool:
        """Whether a device that only such processes kept from us at the look reads free since
        (a later re-read: warm's, say): the look is out of date, and there is nothing to follow."""
        return any(not self.occupied(self.current[uuid]) for uuid in self.foreign_busy)

    def foreign_left(self) -> bool:
        """Re-read those devices (one of their processes exited, or the snapshot was
        rewritten): whether any is free of them now."""
        now = self.clock()
        return any([self._recheck(uuid, now) for uuid in self.foreign_busy])

    def unreachable(self, uuids: Iterable[str], count: int) -> Optional[NoDeviceError]:
        """Why a run waiting for COUNT of UUIDS can never be served now: fewer of them are left
        undrained and not lost (as the last decision found them). One rule for a run deciding
        for itself (waiting.py, its candidates) and for the service's waiters (service/waitline.py)."""
        uuids = list(uuids)
        if len([u for u in uuids if u not in self.lost and u not in self.unavailable]) >= count:
            return None
        if any(u in self.unavailable for u in uuids):
            return NoDeviceError("the devices this run may use were drained by an admin while it waited",
                                 hint="`cudawrap status` says why and since when")
        return NoDeviceError("the devices this run may use are gone (lost or removed)")

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

    def decide(self, scan: Scan, me: Optional[Waiter], queued: bool,
               grants_first: bool = False) -> Tuple[Decision, List[str]]:
        """Verdicts for everyone in SCAN plus ME (not yet queued unless QUEUED); free devices.
        GRANTS_FIRST: the verdicts are a schedule.Decision holding every grant, the rest
        once it is finished."""
        now = self.clock()
        key = me.key if me is not None else None
        waiters = ([w for w in scan.waiters if not self._passed_over(w, key, now)]
                   if self.skip_keys or self.skip_users else list(scan.waiters))  # nobody passed over: no call per waiter
        if me is not None and not queued:
            waiters.append(me)
        if self.drained is not None:
            self.unavailable = set(self.drained())
        idents = self.leases.idents(self.current)  # read once, for the machine and the bounds
        rule = (self.foreign, self.busy_memory_mib)
        # Work cudawrap did not start, for runs whose program has a rule of its own (schedule.kept).
        work: Optional[Dict[str, int]] = {} if any(w.request.foreign not in (None, rule) for w in waiters) else None
        free, held, busy, shares = self.machine(scan.table, idents, work)
        self.joined = set(shares.used)
        self.used = shares.used
        limits = {uid: self._limit(uid) for uid in {w.uid for w in waiters}}
        aside = self.aside if work else []
        fit = {u: (_free_mib(d), d.utilization) for u, d in self.current.items()
               if u in free or u in shares.used or u in aside}
        from .schedule import decide

        bounds = self._bounds(idents)
        self.last = (waiters, free, held, limits, busy, fit, shares, bounds, idents)
        verdicts = decide(waiters, free, held, limits, time.time(), self.parents, busy, fit, shares, bounds, grants_first,
                          work, rule, aside)
        return verdicts, free

    def _bounds(self, idents: Dict[str, Optional[Tuple[int, int]]]) -> Bounds:
        """What the admin allows any run, and the devices that can be leased at all (those
        with a lease file: IDENTS)."""
        from .schedule import Bounds

        if self.admin_bounds is None:
            self.admin_bounds = self.admin() if self.admin is not None else (0.0, 0)
        leasable = frozenset(u for u, ident in idents.items() if ident is not None and u not in self.lost)
        return Bounds(self.admin_bounds[0], self.admin_bounds[1], leasable)
