"""Who gets which free devices now, and why every other run waits: the whole rule, pure.

One decision reads one snapshot: the live waiters (from the queue), the devices that are
free right now, how many devices each user holds, the users' limits, the clock. Nothing
here touches a file or a process, so every waiter, `cudawrap status` and the tests compute
the same answer from the same snapshot, and the rule can be tested exhaustively.

The rule (README "Order of service"):

1. Runs that have waited longer than their ``reserve_after`` come first, oldest first: the
   devices they can use are *reserved* for them as they free up, so a large run is never
   starved by a stream of small ones.
2. Then the users take turns: the next run served belongs to the user who holds the fewest
   devices (counting what this decision already gave them); ties go to the user whose
   oldest waiting run arrived first. A user's own runs go in arrival order.
3. Every run whose request can be met with the free devices left over is granted now,
   whatever stands before it (no head-of-line idling); a run that would exceed its user's
   limit is passed over, not served early.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple

# Why a run is not granted (the kinds; `Verdict.text` is the sentence shown to people).
GRANTED = "granted"
BUSY = "busy"  # not enough free devices it can use
RESERVED = "reserved"  # free devices it could use are reserved for a run that waited long
RESERVING = "reserving"  # it waited long: free devices are held back for it until it has enough
LIMIT = "limit"  # its user's limit would be exceeded


class Waiter:
    """One waiting run as the queue shows it."""

    __slots__ = ("key", "uid", "pid", "count", "candidates", "placement", "reserve_after",
                 "arrival", "program", "min_free_mib", "max_util")

    def __init__(self, key: str, uid: int, pid: int, count: int,
                 candidates: Optional[FrozenSet[str]], placement: str = "spread",
                 reserve_after: float = 300.0, arrival: float = 0.0, program: str = "?",
                 min_free_mib: int = 0, max_util: int = 100) -> None:
        self.key = key  # sorts in arrival order; unique
        self.uid = uid
        self.pid = pid
        self.count = count
        self.candidates = candidates  # None: any device
        self.placement = placement
        self.reserve_after = reserve_after
        self.arrival = arrival  # seconds, the clock of `now`
        self.program = program
        # Filters on what changes as jobs come and go (README "Choosing devices").
        self.min_free_mib = min_free_mib
        self.max_util = max_util

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

    def __repr__(self) -> str:
        return f"Waiter({self.key!r}, uid={self.uid}, count={self.count})"


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


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def starving(waiter: Waiter, now: float) -> bool:
    return now - waiter.arrival >= waiter.reserve_after


def order(waiters: Sequence[Waiter], held: Mapping[int, int], now: float) -> List[Waiter]:
    """WAITERS in the order they are served (rules 1 and 2 above)."""
    first = sorted((w for w in waiters if starving(w, now)), key=lambda w: (w.arrival, w.key))
    queues: Dict[int, List[Waiter]] = {}
    for w in sorted((w for w in waiters if not starving(w, now)), key=lambda w: (w.arrival, w.key)):
        queues.setdefault(w.uid, []).append(w)
    counts = {uid: held.get(uid, 0) for uid in queues}
    rest: List[Waiter] = []
    while queues:
        uid = min(queues, key=lambda u: (counts[u], queues[u][0].arrival, queues[u][0].key))
        w = queues[uid].pop(0)
        rest.append(w)
        counts[uid] += w.count
        if not queues[uid]:
            del queues[uid]
    return first + rest


def place(eligible: Sequence[str], count: int, placement: str, parents: Mapping[str, str],
          busy: Set[str], seed: str = "") -> List[str]:
    """COUNT devices of ELIGIBLE (in the machine's order) by the placement policy.

    spread: on the physical GPUs with the smallest share of busy devices; pack: the largest;
    random: a shuffle seeded by SEED, so every process that computes this decision agrees.
    """
    if placement == "random":
        import random  # only here: ~3 ms of imports nobody else needs

        pool = list(eligible)
        random.Random(seed).shuffle(pool)
        return pool[:count]
    total: Dict[str, int] = {}
    taken: Dict[str, int] = {}
    for uuid, parent in parents.items():
        total[parent] = total.get(parent, 0) + 1
        if uuid in busy:
            taken[parent] = taken.get(parent, 0) + 1
    rank = {uuid: i for i, uuid in enumerate(eligible)}
    sign = -1 if placement == "pack" else 1
    chosen: List[str] = []
    pool = list(eligible)
    while len(chosen) < count:
        def key(u: str) -> Tuple[float, int]:
            parent = parents.get(u, u)
            return (sign * taken.get(parent, 0) / total.get(parent, 1), rank[u])

        best = min(pool, key=key)
        pool.remove(best)
        chosen.append(best)
        parent = parents.get(best, best)
        taken[parent] = taken.get(parent, 0) + 1
    return chosen


def decide(waiters: Sequence[Waiter], free: Sequence[str], held: Mapping[int, int],
           limits: Mapping[int, int], now: float, parents: Optional[Mapping[str, str]] = None,
           busy: Optional[Set[str]] = None,
           fit: Optional[Mapping[str, Tuple[Optional[int], Optional[int]]]] = None) -> Dict[str, Verdict]:
    """A Verdict for every waiter: what it may take now (FREE, in the machine's order), or why not.

    HELD: devices each uid holds now; LIMITS: uid -> most devices (absent or 0: no limit).
    PARENTS and BUSY feed the placement (physical GPU of each device, devices in use); FIT
    has the readings that free-memory and utilisation filters are judged by.
    """
    parents = parents if parents is not None else {u: u for u in free}
    busy = set(busy or ())
    avail = list(free)
    reserved: Dict[str, str] = {}  # device -> key of the starving run it is kept for
    holding = dict(held)
    out: Dict[str, Verdict] = {}
    for position, w in enumerate(order(waiters, held, now)):
        limit = limits.get(w.uid, 0)
        mine = holding.get(w.uid, 0)
        if limit and mine + w.count > limit:
            out[w.key] = Verdict(LIMIT, position, (
                f"you hold {_plural(mine, 'device')}, your limit is {limit}; "
                f"waiting for one of yours to end"))
            continue
        usable = [u for u in avail if w.can_use(u, fit)]
        open_ = [u for u in usable if u not in reserved]
        if len(open_) >= w.count:
            chosen = place(open_, w.count, w.placement, parents, busy, seed=w.key)
            for u in chosen:
                avail.remove(u)
                busy.add(u)
            holding[w.uid] = mine + w.count
            out[w.key] = Verdict(GRANTED, position, "granted", tuple(chosen))
        elif starving(w, now):
            for u in open_:
                reserved[u] = w.key
            out[w.key] = Verdict(RESERVING, position, (
                f"waited over {w.reserve_after:g} s: {_plural(len(open_), 'free device')} "
                f"kept for this run, waiting for {w.count - len(open_)} more"))
        elif len(usable) > len(open_):
            out[w.key] = Verdict(RESERVED, position, (
                f"{_plural(len(usable) - len(open_), 'free device')} it could use "
                f"{'is' if len(usable) - len(open_) == 1 else 'are'} kept for a run that "
                f"has waited longer; position {position + 1}"))
        else:
            need = w.count - len(usable)
            what = "every device it may use is busy" if not usable else (
                f"{_plural(len(usable), 'usable device')} free, {need} more needed")
            out[w.key] = Verdict(BUSY, position, f"{what}; position {position + 1} in line")
    return out
