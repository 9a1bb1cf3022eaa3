"""The terms of a decision (schedule.decide): who waits (Waiter), how devices are shared
(Shares), what the admin allows any run (Bounds), and what each run is told (Verdict).

Apart from the rule itself because they travel beyond it: the queue reads its entries into
Waiters, the service and status hold Verdicts. Pure values; imported on the waiting path
only (a launch nobody waits before never decides).
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import AbstractSet, FrozenSet, List, Mapping, Optional, Sequence, Tuple

    from .request import Request


class Waiter:
    """One waiting run as the queue shows it: who (KEY, sorting in arrival order; UID, PID),
    since when (ARRIVAL, the clock of `now`), under which wrapped name (PROGRAM), and its
    REQUEST (sched/request.py), whose fields read as the waiter's own (w.count, ...)."""

    __slots__ = ("key", "uid", "pid", "request", "arrival", "program")

    def __init__(self, key: str, uid: int, pid: int, request: Request, arrival: float = 0.0,
                 program: str = "?") -> None:
        self.key = key  # sorts in arrival order; unique
        self.uid = uid
        self.pid = pid
        self.request = request
        self.arrival = arrival  # seconds, the clock of `now`
        self.program = program

    @property
    def count(self) -> int:
        return self.request.count

    @property
    def candidates(self) -> Optional[FrozenSet[str]]:
        return self.request.candidates  # None: any device

    @property
    def placement(self) -> str:
        return self.request.placement

    @property
    def reserve_after(self) -> float:
        return self.request.reserve_after

    # Filters on what changes as jobs come and go (docs/admin/policy.md).
    @property
    def min_free_mib(self) -> int:
        return self.request.min_free_mib

    @property
    def max_util(self) -> int:
        return self.request.max_util

    @property
    def share(self) -> bool:
        return self.request.share  # a slot on each of COUNT devices, not the devices whole

    def can_use(self, uuid: str, fit: Optional[Mapping[str, Tuple[Optional[int], Optional[int]]]] = None) -> bool:
        """Whether this run may be given UUID; FIT: uuid -> (free MiB, utilisation %), each
        None where unknown (an unknown free memory does not pass a floor; an unknown
        utilisation, as on MIG, passes any ceiling)."""
        if self.candidates is not None and uuid not in self.candidates:
            return False
        if fit is None or (self.min_free_mib <= 0 and self.max_util >= 100):
            return True
        free_mib, util = fit.get(uuid, (None, None))
        if self.min_free_mib > 0 and (free_mib is None or free_mib < self.min_free_mib):
            return False
        return util is None or util <= self.max_util

    def usable(self, uuids: Sequence[str], fit: Optional[Mapping[str, Tuple[Optional[int], Optional[int]]]] = None
               ) -> List[str]:
        """Those of UUIDS this run may be given (can_use), in their order. Without filters,
        all of them, without a call per device: a decision on 56 MIG instances made one each."""
        if self.candidates is None and (fit is None or (self.min_free_mib <= 0 and self.max_util >= 100)):
            return list(uuids)
        return [u for u in uuids if self.can_use(u, fit)]

    def __repr__(self) -> str:
        return f"Waiter({self.key!r}, uid={self.uid}, count={self.count}{', shared' if self.share else ''})"


class Shares:
    """The machine's sharing at one decision: slots per device, who holds the shares.

    SLOTS: uuid -> slots (absent: 1, not shared). USED: uuid -> the uid of each share held
    now, for the devices that have sharers (in the machine's order); those are never free.
    MPS: one user's shares per device. COUNTS_AS: a share's weight (None: 1/slots).
    """

    def __init__(self, slots: Optional[Mapping[str, int]] = None,
                 used: Optional[Mapping[str, Sequence[int]]] = None, mps: bool = False,
                 counts_as: Optional[float] = None) -> None:
        self.slots = dict(slots or {})
        self.used = {u: list(uids) for u, uids in (used or {}).items()}
        self.mps = mps
        self.counts_as = counts_as

    def slots_of(self, uuid: str) -> int:
        return self.slots.get(uuid, 1)

    def cost(self, uuid: str) -> float:
        """What a shared run's hold on UUID counts as (a device of 1 slot is taken whole)."""
        slots = self.slots_of(uuid)
        if slots <= 1:
            return 1.0
        return self.counts_as if self.counts_as is not None else 1.0 / slots


class Verdict:
    """The decision for one waiter: devices to take now, or why not."""

    __slots__ = ("kind", "devices", "position", "text")

    def __init__(self, kind: str, position: int, text: str, devices: Tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.devices = devices
        self.position = position  # 0 = served first
        self.text = text

    def __repr__(self) -> str:
        return f"Verdict({self.kind!r}, {self.devices!r}, pos={self.position})"


class Bounds:
    """What the admin's config and the machine allow any run, whatever its entry claims.

    FLOOR: the shortest reserve_after the config gives any run (an entry may claim longer,
    never shorter); MOST: the largest count any run may ask for (max_gpus; 0: no bound);
    DEVICES: the devices that can be leased at all (None: unknown, no bound). A run asking
    for more than MOST, or than DEVICES holds among those it may use, can never be served,
    so nothing is ever reserved for it (a user's limit is checked before any reservation).
    """

    __slots__ = ("floor", "most", "devices")

    def __init__(self, floor: float = 0.0, most: int = 0, devices: Optional[AbstractSet[str]] = None) -> None:
        self.floor = floor
        self.most = most
        self.devices = devices

    def reserve_after(self, waiter: Waiter) -> float:
        return max(waiter.reserve_after, self.floor)

    def attainable(self, waiter: Waiter) -> bool:
        if self.most and waiter.count > self.most:
            return False
        if self.devices is None:
            return True
        usable = self.devices if waiter.candidates is None else self.devices & waiter.candidates
        return waiter.count <= len(usable)


UNBOUNDED = Bounds()
