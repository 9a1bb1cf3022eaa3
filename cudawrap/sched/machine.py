"""The machine as one run sees it: which devices are free, held by whom, shared, busy with
work cudawrap did not start; and the decision for every waiter over that look
(cudawrap.sched.schedule.decide). The acquirer decides on it; `cudawrap status` shows it.

A device is free when nobody holds its lease and NVML shows no process cudawrap did not
start (where process lists are hidden, when little memory is used).
"""

import posix
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

    from .schedule import Decision
    from .terms import Bounds, Shares, Waiter

from ..devices.model import Device
from ..errors import NoDeviceError
from ..lease.files import LeaseFiles
from ..lease.sharing import MPS, Sharing, mps_daemon
from .queue import Scan

# NVML data older than this is re-read before a device is judged occupied by a process
# cudawrap did not start. A device whose lease was held at the last look is re-read at
# once: the processes seen on it were probably that job's, now gone.
FOREIGN_RECHECK_S = 1.0


def free_mib_of(device: "Device") -> "Optional[int]":
    """Memory free on DEVICE, None where it was not read (the lean launch path skips it)."""
    if device.memory_used_mib is None:
        return None
    return device.memory_total_mib - device.memory_used_mib


def _mps_server(pid: int, daemon: "Optional[int]") -> bool:
    """Whether PID is an MPS server of cudawrap's: a child of DAEMON, the control daemon
    `cudawrap mps start` runs for the device (None: none runs). Never by its name: anyone can
    run a program named nvidia-cuda-mps-server."""
    if daemon is None:
        return False
    from ..base.proc import parent  # only once a process was seen on a device

    return parent(pid) == daemon


def mps_strangers(pids: "Sequence[int]", uids: "Set[int]", daemon: "Optional[int]",
                  gone: "Callable[[int], bool]" = lambda pid: False) -> "List[int]":
    """Of PIDS on a device shared through MPS, those of users who hold no share there (UIDS
    do), other than the MPS server of DAEMON (cudawrap's control daemon for the device): MPS
    clients connected without a lease, or other work. The daemon serves one user at a time,
    so a sharer's next client would wait behind them. GONE: pids known to be no work. A pid
    without a process here (ended since NVML was read, or of another pid namespace) is not
    counted: whose it is cannot be told, and a sharer's own must not close its device."""
    from .tally import uid_of  # only once a process was seen on a shared device

    out = []
    for pid in pids:
        uid = uid_of(pid)
        if uid not in uids and uid != -1 and not gone(pid) and not _mps_server(pid, daemon):
            out.append(pid)
    return out


def _exited(pid: int) -> bool:
    from ..base.proc import exiting  # only once a lease holder was seen: not on a launch's path

    return exiting(pid)


class ViewOptions:
    """How a MachineView reads and judges the machine, one value from the caller (the launch,
    the service's line, status) through the Acquirer to the view, never taken apart into
    arguments on the way. Immutable, keyword-only; not a dataclass (the shim's path).

    FOREIGN and BUSY_MEMORY_MIB: the rule for work cudawrap did not start. REFRESH reads a
    device again (None: never), CHECKED_AT is when the devices were read (None: now), UNREAD
    those never read yet. LIMIT_OF: uid -> most devices; DRAINED: the devices drained now;
    SHARING: the config's; ADMIN: (shortest reserve_after, largest max_gpus) of the config.
    ROOT: the install's (where its MPS daemons' pid files are). CLOCK times everything."""

    __slots__ = ("foreign", "busy_memory_mib", "refresh", "checked_at", "limit_of", "drained", "sharing",
                 "unread", "root", "admin", "clock")

    def __init__(
        self,
        *,
        foreign: str = "avoid",
        busy_memory_mib: int = 1024,
        refresh: "Optional[Callable[[Device], Optional[Device]]]" = None,
        checked_at: "Optional[float]" = None,
        limit_of: "Optional[Callable[[int], int]]" = None,
        drained: "Optional[Callable[[], Set[str]]]" = None,
        sharing: "Optional[Sharing]" = None,
        unread: "Sequence[str]" = (),
        root: "Optional[str]" = None,
        admin: "Optional[Callable[[], Tuple[float, int]]]" = None,
        clock: "Callable[[], float]" = time.monotonic,
    ) -> None:
        put = object.__setattr__
        for name, value in (("foreign", foreign), ("busy_memory_mib", busy_memory_mib), ("refresh", refresh),
                            ("checked_at", checked_at), ("limit_of", limit_of), ("drained", drained),
                            ("sharing", sharing), ("unread", tuple(unread)), ("root", root), ("admin", admin),
                            ("clock", clock)):
            put(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("ViewOptions cannot be changed; make new ones")


DEFAULTS = ViewOptions()


class MachineView:
    """What decisions are made on: the leases, the devices (CANDIDATES this run may use,
    of ALL_DEVICES), what NVML said of them and when, and the runs passed over; OPTIONS
    say how they are read and judged."""

    def __init__(self, leases: "LeaseFiles", candidates: "Sequence[Device]", all_devices: "Sequence[Device]",
                 options: "ViewOptions" = DEFAULTS) -> None:
        self.clock = options.clock  # every timing: grace, stalls, reservations, re-reads
        self.leases = leases
        self.root = options.root
        self.candidates = list(candidates)
        self.foreign = options.foreign
        self.busy_memory_mib = options.busy_memory_mib
        self.refresh = options.refresh
        # What joinable reads: NVML itself, where REFRESH reads a snapshot first (its fresh()):
        # an MPS client that connected since the snapshot would keep a new share waiting.
        self.reread = getattr(self.refresh, "fresh", self.refresh)
        self.warmed = False  # the source made ready for a hand-over (warm())
        self.limit_of = options.limit_of or (lambda uid: 0)
        # What every waiter's claims are held to (schedule.Bounds), read at the first decision.
        self.admin = options.admin
        self.admin_bounds: "Optional[Tuple[float, int]]" = None
        self.unavailable: "Set[str]" = set()  # drained: never granted (from DRAINED, each decision)
        self.drained = options.drained  # re-read at every decision (an admin may drain meanwhile)
        self.uid = posix.geteuid()
        self.current: "Dict[str, Device]" = {d.uuid: d for d in all_devices}
        self.parents = {d.uuid: d.parent_uuid for d in all_devices}
        self.sharing = options.sharing if options.sharing is not None else Sharing()
        self.slots = {u: self.sharing.slots_for(u, p) for u, p in self.parents.items()}
        now = self.clock() if options.checked_at is None else options.checked_at
        self.checked_at: "Dict[str, float]" = {d.uuid: now for d in all_devices}
        # Devices whose data may be stale: their lease was held at some look since they were
        # last read (the processes seen were probably that job's), or never read (UNREAD:
        # the launch had only the layout, and reads a device as it is about to take it).
        self.stale: "Set[str]" = set(options.unread)
        self.lost: "Set[str]" = set()
        # Those lost before this run queued: on a launch from sync's layout, a sign that the
        # layout is out of date (a MIG instance destroyed since), not of a GPU lost now.
        self.lost_on_arrival: "Set[str]" = set()
        self.queued = False
        self.mine = {d.uuid for d in self.candidates}
        self._remember_nothing()

    def _remember_nothing(self) -> None:
        """What the view keeps from one decision to the next, empty at its start."""
        self.joined: "Set[str]" = set()  # devices that had sharers at the last decision
        self.used: "Dict[str, List[int]]" = {}  # and the uid of each of their shares
        # Runs passed over for not taking what they were given (until when).
        self.skip_keys: "Dict[str, float]" = {}
        self.skip_users: "Dict[int, float]" = {}
        self.limits: "Dict[int, int]" = {}
        # Processes seen holding a lease. NVML data read while one ran (a monitor snapshot
        # half a second old) still lists it once it has exited: its pid is then no work.
        # Other pids count even if not found here: in a container, NVML names host pids.
        self.holders: "Set[int]" = set()
        # (lease file, pids that took its locks) -> the real uid of each lock's holder, read
        # once per lease (see tally.owners).
        self.owners: "Dict[Tuple[Tuple[int, int], Tuple[int, ...]], List[int]]" = {}
        # The service's books (service/grants.py): lease file -> {pid that took its lock: uid}
        # of each grant it made and has not seen let go. A lock a booked pid took is that
        # uid's, whatever process has the pid now; an exclusive one whose holder cannot be
        # named (its descriptor sent on into a socket, or mapped) is its one booked uid's.
        self.books: "Dict[Tuple[int, int], Dict[int, int]]" = {}
        # Our devices whose lease was free at the last look but which processes cudawrap did
        # not start kept from us.
        self.foreign_busy: "Set[str]" = set()
        self.aside: "List[str]" = []  # and those of them kept off only by this view's rule (machine())
        # The last decision's inputs, and uuid -> the uid holding it whole (machine): what a
        # release carries on without a new look (successor.py; the service's hand-over).
        self.last: "Optional[Tuple[Sequence[Waiter], List[str], Dict[int, float], Dict[int, int], Set[str], Dict[str, Tuple[Optional[int], Optional[int]]], Shares, Bounds, Dict[str, Optional[Tuple[int, int]]]]]" = None
        self.whole: "Dict[str, int]" = {}

    # -- judging devices -------------------------------------------------------------
    def occupied(self, device: "Device") -> bool:
        """Whether NVML shows work cudawrap did not start on DEVICE (its lease being free).

        The MPS server of cudawrap's daemon for DEVICE, left by shared runs that ended, is
        not work: it idles until stopped."""
        if self.foreign == "ignore":
            return False
        if device.pids is None:
            return (device.memory_used_mib or 0) > self.busy_memory_mib
        return self.work(device) is not None

    def work(self, device: "Device") -> "Optional[int]":
        """The work cudawrap did not start on DEVICE, whatever the rule (schedule.kept judges
        it): None, none; schedule.LISTED, processes; else the MiB used where NVML hides them."""
        if device.pids is None:
            return device.memory_used_mib or 0
        daemon: "Optional[int]" = -1  # not read yet: only once a process is seen
        for pid in device.pids:
            if pid in self.holders and _exited(pid):
                continue
            if daemon == -1:
                daemon = self.mps_daemon(device.uuid)
            if not _mps_server(pid, daemon):
                return -1  # schedule.LISTED (schedule is not imported on a lone launch's path)
        return None

    def mps_daemon(self, uuid: str) -> "Optional[int]":
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

    def eligible(self, uuid: str, now: float) -> bool:
        if uuid in self.stale and self.refresh is not None:
            # Meanwhile its job may have ended, its GPU been lost or its MIG instance destroyed
            # (the lease file outlives it until the next sync): only a fresh look tells.
            return self._recheck(uuid, now)
        if not self.occupied(self.current[uuid]):
            return True
        if now - self.checked_at[uuid] > FOREIGN_RECHECK_S:
            return self._recheck(uuid, now)
        return False

    def machine(self, table: "Dict[Tuple[int, int], List[Tuple[int, bool]]]",
                idents: "Dict[str, Optional[Tuple[int, int]]]",
                work: "Optional[Dict[str, int]]" = None) -> "Tuple[List[str], Dict[int, float], Set[str], Shares]":
        """(free devices in the machine's order, devices held per uid, busy devices, shares)
        by TABLE (the lock table); see tally.tally, which a launch nobody waits before never loads."""
        from .tally import tally

        return tally(self, table, idents, work)

    def strangers(self, uuid: str, uids: "Set[int]") -> bool:
        """Whether UUID is shared through MPS and NVML shows a process there of a user who
        holds no share on it (see mps_strangers): it takes no new shares until they are gone."""
        pids = self.current[uuid].pids
        if self.sharing.mode != MPS or not pids or self.foreign == "ignore":
            return False
        return bool(mps_strangers(pids, uids, self.mps_daemon(uuid), lambda pid: pid in self.holders and _exited(pid)))

    def joinable(self, uuid: str, uid: "Optional[int]" = None) -> bool:
        """Whether a share of UUID, which has sharers, may be taken (by UID; None: us): under
        MPS, NVML read again shows no user there but its sharers and the taker (see strangers)."""
        if self.sharing.mode != MPS:
            return True
        fresh = self.reread(self.current[uuid]) if self.reread else None
        if fresh is not None:
            self.current[uuid] = fresh
        return not self.strangers(uuid, set(self.used.get(uuid, ())) | {self.uid if uid is None else uid})

    def foreign_pids(self) -> "Set[int]":
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

    def unreachable(self, uuids: "Iterable[str]", count: int) -> "Optional[NoDeviceError]":
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

    def _passed_over(self, w: "Waiter", me: "Optional[str]", now: float) -> bool:
        if w.key == me:
            return False
        if self.skip_keys.get(w.key, 0) > now:
            return True
        return w.uid != self.uid and self.skip_users.get(w.uid, 0) > now

    def decide(self, scan: "Scan", me: "Optional[Waiter]", queued: bool,
               grants_first: bool = False) -> "Tuple[Decision, List[str]]":
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
        work: "Optional[Dict[str, int]]" = {} if any(w.request.foreign not in (None, rule) for w in waiters) else None
        free, held, busy, shares = self.machine(scan.table, idents, work)
        self.joined = set(shares.used)
        self.used = shares.used
        limits = {uid: self._limit(uid) for uid in {w.uid for w in waiters}}
        aside = self.aside if work else []
        fit = {u: (free_mib_of(d), d.utilization) for u, d in self.current.items()
               if u in free or u in shares.used or u in aside}
        from .schedule import decide

        bounds = self._bounds(idents)
        self.last = (waiters, free, held, limits, busy, fit, shares, bounds, idents)
        verdicts = decide(waiters, free, held, limits, time.time(), self.parents, busy, fit, shares, bounds, grants_first,
                          work, rule, aside)
        return verdicts, free

    def _bounds(self, idents: "Dict[str, Optional[Tuple[int, int]]]") -> "Bounds":
        """What the admin allows any run, and the devices that can be leased at all (those
        with a lease file: IDENTS)."""
        from .terms import Bounds

        if self.admin_bounds is None:
            self.admin_bounds = self.admin() if self.admin is not None else (0.0, 0)
        leasable = frozenset(u for u, ident in idents.items() if ident is not None and u not in self.lost)
        return Bounds(self.admin_bounds[0], self.admin_bounds[1], leasable)
