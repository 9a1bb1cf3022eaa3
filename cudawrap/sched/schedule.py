"""Who gets which free devices now, and why every other run waits: the whole rule, pure.

One decision reads one snapshot: the live waiters (from the queue), the devices that are
free right now, how many devices each user holds, the users' limits, the clock. Nothing
here touches a file or a process, so every waiter, `cudawrap status` and the tests compute
the same answer from the same snapshot, and the rule can be tested exhaustively.

The rule (docs/user/waiting.md):

1. Runs that have waited longer than their ``reserve_after`` come first, oldest first: the
   devices they can use are *reserved* for them as they free up, so a large run is never
   starved by a stream of small ones. What an entry claims is the user's word, so `Bounds`
   holds it to the admin's: never reserved for sooner than the config allows any run, nor
   for a count that can never be met (more devices than exist among those it may use, or
   than any run may ask for): such a run waits, and keeps nothing idle.
2. Then the users take turns: the next run served belongs to the user who holds the fewest
   devices (counting what this decision already gave them); ties go to the user whose
   oldest waiting run arrived first. A user's own runs go in arrival order.
3. Every run whose request can be met with the free devices left over is granted now,
   whatever stands before it (no head-of-line idling); a run that would exceed its user's
   limit is passed over, not served early.

Shared runs (docs/admin/sharing.md) take a slot of a device instead of all of it: an
exclusive run needs a device nobody holds, a shared run a free slot on a device no
exclusive run holds. Shared runs fill the fullest shared devices first and open an unused
device only when none has room, so whole devices stay free for exclusive runs. Under MPS a
device's shares belong to one user at a time. A share counts as `Shares.cost` of a device
towards its user's turn and limit. A starving exclusive run also keeps new shares off the
shared devices it could use, so they drain for it.

Work cudawrap did not start keeps a device from a run by that run's own rule (its program's
`foreign` and `busy_memory_mib`, docs/architecture.md "Leases"): the caller judges the devices by
one rule, its own (FREE leaves out those the rule keeps off, ASIDE lists them); a waiter whose
request carries another rule is judged by it over WORK, what was seen on each lease-free device.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple

from .request import place
from .terms import UNBOUNDED, Bounds, Shares, Verdict, Waiter

# Why a run is not granted (the kinds; `Verdict.text` is the sentence shown to people).
GRANTED = "granted"
BUSY = "busy"  # not enough free devices it can use
RESERVED = "reserved"  # free devices it could use are reserved for a run that waited long
RESERVING = "reserving"  # it waited long: free devices are held back for it until it has enough
LIMIT = "limit"  # its user's limit would be exceeded

ALL_BUSY = "every device it may use is busy"  # a BUSY verdict's text, with the place in line after it
EPSILON = 1e-9  # shares add up in floating point: 4 x 0.25 must not exceed a limit of 1
# In WORK (decide): NVML lists processes cudawrap did not start on the device (else the MiB
# used, where process lists are hidden).
LISTED = -1


def kept(rule: Tuple[str, int], work: Optional[int]) -> bool:
    """Whether RULE ((foreign, busy_memory_mib)) keeps a run off a device whose lease is free
    and where WORK was seen (None: none; LISTED: processes; else MiB used, processes hidden)."""
    if work is None or rule[0] == "ignore":
        return False
    return work == LISTED or work > rule[1]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def starving(waiter: Waiter, now: float, bounds: Bounds = UNBOUNDED) -> bool:
    """Whether devices are reserved for WAITER now (rule 1)."""
    return now - waiter.arrival >= bounds.reserve_after(waiter) and bounds.attainable(waiter)


def order(waiters: Sequence[Waiter], held: Mapping[int, int], now: float,
          bounds: Bounds = UNBOUNDED) -> List[Waiter]:
    """WAITERS in the order they are served (rules 1 and 2 above)."""
    ordered, _starving = _order(waiters, held, now, bounds)
    return ordered


def _order(waiters: Sequence[Waiter], held: Mapping[int, int], now: float,
           bounds: Bounds) -> Tuple[List[Waiter], int]:
    """order(), and how many of it are starving: they come first (rule 1)."""
    first: List[Waiter] = []
    queues: Dict[int, List[Waiter]] = {}
    for w in sorted(waiters, key=_arrival):
        if starving(w, now, bounds):
            first.append(w)
        else:
            queues.setdefault(w.uid, []).append(w)
    if len(queues) <= 1:
        return first + [w for q in queues.values() for w in q], len(first)  # one user: arrival order
    from heapq import heapify, heappop, heappush  # only where users take turns: not on every launch's path

    # Each user's next run, by (what the user holds, that run's arrival): the user holding
    # least goes next. A min() over the users for each run cost 1000 waiters ~1.5 ms.
    heads = [(held.get(uid, 0), q[0].arrival, q[0].key, uid) for uid, q in queues.items()]
    heapify(heads)
    served = dict.fromkeys(queues, 0)  # how many of each user's queue are placed (not pop(0): quadratic)
    rest: List[Waiter] = []
    while heads:
        counted, _arrived, _key, uid = heappop(heads)
        queue, i = queues[uid], served[uid]
        w = queue[i]
        rest.append(w)
        served[uid] = i + 1
        if i + 1 < len(queue):
            after = queue[i + 1]
            heappush(heads, (counted + w.count, after.arrival, after.key, uid))
    return first + rest, len(first)


def _arrival(w: Waiter) -> Tuple[float, str]:
    return w.arrival, w.key


class Decision(dict):
    """A decision's verdicts, key -> Verdict. One made with grants_first holds every grant
    from the start, and the other waiters' verdicts once finish() has run."""

    def __init__(self) -> None:
        super().__init__()
        self._rest: Iterator[None] = iter(())

    def finish(self) -> Decision:
        for _ in self._rest:
            pass
        return self


def decide(waiters: Sequence[Waiter], free: Sequence[str], held: Mapping[int, float],
           limits: Mapping[int, int], now: float, parents: Optional[Mapping[str, str]] = None,
           busy: Optional[Set[str]] = None,
           fit: Optional[Mapping[str, Tuple[Optional[int], Optional[int]]]] = None,
           shares: Optional[Shares] = None, bounds: Bounds = UNBOUNDED, grants_first: bool = False,
           work: Optional[Mapping[str, int]] = None, rule: Optional[Tuple[str, int]] = None,
           aside: Sequence[str] = ()) -> Decision:
    """A Verdict for every waiter: what it may take now (FREE, in the machine's order), or why not.

    HELD: devices each uid holds now (a share as its cost); LIMITS: uid -> most devices
    (absent or 0: no limit). PARENTS and BUSY feed the placement (physical GPU of each
    device, devices in use); FIT has the readings that free-memory and utilisation filters
    are judged by; SHARES the shared devices and slots; BOUNDS what the admin allows any
    run, whatever the waiters' entries claim. GRANTS_FIRST: return once nobody further in
    line can be granted anything (the grants are all in it), the rest at Decision.finish():
    the service sends the grants first. WORK, RULE, ASIDE: work cudawrap did not start on
    the devices whose lease is free (uuid -> LISTED or MiB used; see kept), the rule FREE was
    judged by, and the devices it kept off: a waiter with a rule of its own is judged by that.
    """
    out = Decision()
    steps = _steps(out, waiters, free, held, limits, now, parents, busy, fit, shares, bounds, work, rule, aside)
    next(steps, None)
    out._rest = steps
    return out if grants_first else out.finish()


def _steps(out: Dict[str, Verdict], waiters: Sequence[Waiter], free: Sequence[str], held: Mapping[int, float],
           limits: Mapping[int, int], now: float, parents: Optional[Mapping[str, str]], busy: Optional[Set[str]],
           fit: Optional[Mapping[str, Tuple[Optional[int], Optional[int]]]], shares: Optional[Shares],
           bounds: Bounds, work: Optional[Mapping[str, int]] = None, rule: Optional[Tuple[str, int]] = None,
           aside: Sequence[str] = ()) -> Iterator[None]:
    """decide()'s verdicts, into OUT in the order of the line; it pauses once, when nothing
    is left that anyone further in line could be given."""
    parents = parents if parents is not None else {u: u for u in free}
    busy = set(busy or ())
    shares = shares if shares is not None else Shares()
    used = {u: list(uids) for u, uids in shares.used.items()}
    rank = {u: i for i, u in enumerate(list(used) + list(free) + list(aside))}
    avail = list(free)
    # Runs judged by a rule of their own (docs/architecture.md "Leases"): ASIDE is theirs to take
    # where their rule allows, and FREE what their rule does not keep them off.
    work = work or {}
    ruled = bool(work) and any(w.request.foreign not in (None, rule) for w in waiters)
    aside = list(aside) if ruled else []
    machine = {u: i for i, u in enumerate(parents)} if ruled else {}  # the order a ruled pool is in
    reserved: Dict[str, str] = {}  # device -> key of the starving run it is kept for
    holding: Dict[int, float] = dict(held)
    ordered, starving_first = _order(waiters, held, now, bounds)
    granting = True
    for position, w in enumerate(ordered):
        if granting and not avail and not aside and not any(len(uids) < shares.slots_of(u) for u, uids in used.items()):
            granting = False  # no free device, no shared one with room: no grant past this point
            yield
        reserving = position < starving_first
        limit = limits.get(w.uid, 0)
        mine = holding.get(w.uid, 0)
        share, count = w.share, w.count
        if not share and limit and mine + count > limit + EPSILON:
            out[w.key] = Verdict(LIMIT, position, _limit_text(mine, limit))
            continue
        pool, seen_busy = avail, busy
        own = w.request.foreign
        if ruled and own is not None and own != rule:
            pool = sorted([u for u in avail + aside if not kept(own, work.get(u))],
                          key=lambda u: machine.get(u, len(machine)))
            seen_busy = busy | set(avail).difference(pool)  # work on a device makes it busy for placement, by any rule
        if not pool and not reserving and not share and count > 0:
            # Nothing is left to give: what the general way below concludes, without its
            # lists. Past the head of a long line this is every waiter (1000 waiting: the
            # decision a hand-over waits for went from ~7 to ~4 ms on a slow 2-core VM).
            out[w.key] = Verdict(BUSY, position, f"{ALL_BUSY}; position {position + 1} in line")
            continue
        usable = w.usable(pool, fit)
        open_ = [u for u in usable if u not in reserved]
        if share:
            verdict = _share(w, position, open_, usable, used, reserved, shares, parents, seen_busy, fit, rank,
                             mine, limit, bounds.reserve_after(w) if reserving else None)
        else:
            verdict = _whole(w, position, open_, usable, used, reserved, parents, seen_busy, rank,
                             bounds.reserve_after(w) if reserving else None)
        if verdict.kind == GRANTED:
            holding[w.uid] = mine + _taken(w, verdict.devices, avail, aside, used, busy, shares)
        elif verdict.kind == RESERVING and share:
            reserved.update(dict.fromkeys(open_, w.key))  # (_whole keeps a whole run's itself)
        out[w.key] = verdict


def _taken(w: Waiter, devices: Sequence[str], avail: List[str], aside: List[str], used: Dict[str, List[int]],
           busy: Set[str], shares: Shares) -> float:
    """DEVICES granted to W, taken off what is left to give (AVAIL, ASIDE), counted in USED
    (a share) and BUSY; what they count as towards W's user's turn and limit."""
    for u in devices:
        if u in avail or u in aside:
            (avail if u in avail else aside).remove(u)
            if w.share and shares.slots_of(u) > 1:
                used[u] = []
        if w.share and u in used:
            used[u].append(w.uid)
        busy.add(u)
    return sum(shares.cost(u) for u in devices) if w.share else w.count


def _whole(w: Waiter, position: int, open_: List[str], usable: List[str], used: Dict[str, List[int]],
           reserved: Dict[str, str], parents: Mapping[str, str], busy: Set[str], rank: Mapping[str, int],
           reserve_after: Optional[float]) -> Verdict:
    """The verdict for W, who takes its devices whole, of USABLE (OPEN_ of them not reserved
    for another run); RESERVE_AFTER: its reserve_after in force if devices are reserved for it
    (rule 1; RESERVED then keeps OPEN_ for it), else None."""
    if len(open_) >= w.count:
        chosen = place(open_, w.count, w.placement, parents, busy, seed=w.key)
        return Verdict(GRANTED, position, "granted", tuple(chosen))
    if reserve_after is not None:
        for u in open_:
            reserved[u] = w.key
        # Shared devices it could use take no new shares, so they drain for it.
        draining = sorted((u for u in used if u not in reserved and w.can_use(u)),
                          key=lambda u: (len(used[u]), rank[u]))[:w.count - len(open_)]
        for u in draining:
            reserved[u] = w.key
        return Verdict(RESERVING, position, (
            f"waited over {reserve_after:g} s: {_plural(len(open_), 'free device')} "
            f"kept for this run, waiting for {w.count - len(open_)} more"
            + (f" ({_plural(len(draining), 'shared device')} taking no new shares)" if draining else "")))
    if len(usable) > len(open_):
        return Verdict(RESERVED, position, _reserved_text(len(usable) - len(open_), position))
    need = w.count - len(usable)
    what = ALL_BUSY if not usable else f"{_plural(len(usable), 'usable device')} free, {need} more needed"
    return Verdict(BUSY, position, f"{what}; position {position + 1} in line")


def _limit_text(mine: float, limit: int) -> str:
    held = _plural(int(mine), "device") if mine == int(mine) else f"{mine:.2f} devices"
    return f"you hold {held}, your limit is {limit}; waiting for one of yours to end"


def _reserved_text(n: int, position: int) -> str:
    return (f"{_plural(n, 'free device')} it could use {'is' if n == 1 else 'are'} kept for a run that "
            f"has waited longer; position {position + 1}")


def _share(w: Waiter, position: int, open_: List[str], usable: List[str], used: Dict[str, List[int]],
           reserved: Dict[str, str], shares: Shares, parents: Mapping[str, str], busy: Set[str],
           fit: Optional[Mapping[str, Tuple[Optional[int], Optional[int]]]], rank: Mapping[str, int],
           mine: float, limit: int, reserve_after: Optional[float]) -> Verdict:
    """The verdict for the shared run W (rule in the module's docstring); RESERVE_AFTER: its
    reserve_after in force if devices are reserved for it (rule 1), else None."""
    room = [u for u in used if len(used[u]) < shares.slots_of(u) and w.can_use(u, fit)]
    other_users = [u for u in room if shares.mps and any(uid != w.uid for uid in used[u])]
    joinable = [u for u in room if u not in other_users and u not in reserved]
    # Fullest first: a device with one slot left is filled before one with three.
    joinable.sort(key=lambda u: (shares.slots_of(u) - len(used[u]), rank[u]))
    chosen = joinable[:w.count]
    for pool in ([u for u in open_ if shares.slots_of(u) > 1], [u for u in open_ if shares.slots_of(u) <= 1]):
        n = min(w.count - len(chosen), len(pool))
        chosen += place(pool, n, w.placement, parents, busy, seed=w.key) if n > 0 else []
    costs = [shares.cost(u) for u in joinable + open_] or [shares.cost(u) for u in room + usable] or [0.0]
    if limit and mine + (sum(shares.cost(u) for u in chosen) if len(chosen) == w.count
                         else w.count * min(costs)) > limit + EPSILON:
        return Verdict(LIMIT, position, _limit_text(mine, limit))
    if len(chosen) == w.count:
        return Verdict(GRANTED, position, "granted", tuple(chosen))
    if reserve_after is not None:  # the caller keeps OPEN_ for it
        return Verdict(RESERVING, position, (
            f"waited over {reserve_after:g} s: {_plural(len(open_), 'free device')} kept for this run, "
            f"waiting for a slot"))
    blocked = len([u for u in room if u in reserved]) + len(usable) - len(open_)
    if blocked:
        return Verdict(RESERVED, position, _reserved_text(blocked, position))
    if other_users:
        return Verdict(BUSY, position, (
            f"{_plural(len(other_users), 'shared device')} with room serve{'s' if len(other_users) == 1 else ''} "
            f"another user's runs (MPS: one user per device); position {position + 1} in line"))
    return Verdict(BUSY, position, f"every device it may share is full or taken whole; position {position + 1} in line")
