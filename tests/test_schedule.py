"""The scheduling rule, pure: random machines, waiters and holdings against a reference model.

No processes here: cudawrap.sched.schedule.decide is the whole decision every waiter, `status` and
the launch fast path make, so these tests cover the rule exhaustively where processes cannot.
"""
from collections import defaultdict
from typing import Dict, List, Optional

from hypothesis import given, settings, strategies as st

from support.sched import make_waiter
from cudawrap.sched.schedule import BUSY, GRANTED, LIMIT, RESERVED, RESERVING, Bounds, Waiter, decide, order

DEVICES = [f"GPU-{i}" for i in range(6)]


def reference(waiters: List[Waiter], free: List[str], held: Dict[int, int], limits: Dict[int, int],
              now: float) -> Dict[str, Optional[List[str]]]:
    """The README's rule written as plainly as possible, independently of schedule.py:
    waiters past reserve_after first (oldest first), then one run at a time from the user
    who would then hold the fewest devices (ties: oldest waiting run); each run takes the
    first free devices it may use unless that breaks its user's limit or a reservation."""
    by_arrival = sorted(waiters, key=lambda w: (w.arrival, w.key))
    seq = [w for w in by_arrival if now - w.arrival >= w.reserve_after]
    normal = [w for w in by_arrival if now - w.arrival < w.reserve_after]
    would_hold = defaultdict(int, held)
    while normal:
        firsts = {}
        for w in normal:
            firsts.setdefault(w.uid, w)  # normal is in arrival order: the first seen is the oldest
        uid = min(firsts, key=lambda u: (would_hold[u], firsts[u].arrival, firsts[u].key))
        w = firsts[uid]
        normal.remove(w)
        seq.append(w)
        would_hold[uid] += w.count
    left = list(free)
    kept = set()
    holding = defaultdict(int, held)
    out: Dict[str, Optional[List[str]]] = {}
    for w in seq:
        if limits.get(w.uid) and holding[w.uid] + w.count > limits[w.uid]:
            out[w.key] = None
            continue
        mine = [d for d in left if (w.candidates is None or d in w.candidates) and d not in kept]
        if len(mine) >= w.count:
            out[w.key] = mine[:w.count]
            for d in mine[:w.count]:
                left.remove(d)
            holding[w.uid] += w.count
        else:
            out[w.key] = None
            if now - w.arrival >= w.reserve_after:
                kept.update(mine)
    return out


@st.composite
def situations(draw):  # type: ignore[no-untyped-def]
    n = draw(st.integers(0, 9))
    waiters = []
    for i in range(n):
        narrowed = draw(st.booleans())
        candidates = frozenset(draw(st.lists(st.sampled_from(DEVICES), min_size=1, unique=True))) if narrowed else None
        waiters.append(make_waiter(
            key=f"{i:04d}", uid=draw(st.integers(0, 3)), pid=1000 + i, count=draw(st.integers(1, 3)),
            candidates=candidates, reserve_after=draw(st.sampled_from([5.0, 50.0, float("inf")])),
            arrival=float(draw(st.integers(0, 60)))))
    free = draw(st.lists(st.sampled_from(DEVICES), unique=True))
    free.sort(key=DEVICES.index)
    held = {uid: draw(st.integers(0, 3)) for uid in range(4)}
    limits = {uid: draw(st.integers(0, 4)) for uid in range(4)}
    return waiters, free, held, limits


@settings(max_examples=800, deadline=None)
@given(situations())
def test_grants_equal_the_reference_model(case) -> None:  # type: ignore[no-untyped-def]
    waiters, free, held, limits = case
    # Each device its own parent and nothing busy: spread placement is then "first in order".
    verdicts = decide(waiters, free, held, limits, now=60.0)
    expected = reference(waiters, free, held, limits, now=60.0)
    got = {k: list(v.devices) if v.kind == GRANTED else None for k, v in verdicts.items()}
    assert got == expected


@settings(max_examples=800, deadline=None)
@given(situations(), st.lists(st.integers(0, 2), min_size=6, max_size=6), st.sampled_from(["spread", "pack"]))
def test_every_verdict_is_true_and_nothing_is_given_twice(case, parent_of, placement) -> None:  # type: ignore[no-untyped-def]
    waiters, free, held, limits = case
    for w in waiters:
        w.request = w.request.replace(placement=placement)
    parents = {d: f"GPU-parent-{parent_of[i]}" for i, d in enumerate(DEVICES)}
    busy = {d for d in DEVICES if d not in free}
    verdicts = decide(waiters, free, held, limits, 60.0, parents, busy)
    assert set(verdicts) == {w.key for w in waiters}
    given_out: List[str] = []
    holding = defaultdict(int, held)
    for w in waiters:
        v = verdicts[w.key]
        if v.kind == GRANTED:
            assert len(v.devices) == w.count
            assert all(d in free and w.can_use(d) for d in v.devices)
            given_out += v.devices
            holding[w.uid] += w.count
    assert len(given_out) == len(set(given_out)), "a device given twice"
    for uid, n in holding.items():
        assert not limits.get(uid) or n <= max(limits[uid], held.get(uid, 0)), (uid, n)
    left = [d for d in free if d not in given_out]
    kept = set()
    for w in sorted(waiters, key=lambda w: verdicts[w.key].position):
        v = verdicts[w.key]
        usable = [d for d in left if w.can_use(d)]
        open_ = [d for d in usable if d not in kept]
        if v.kind == RESERVING:
            assert len(open_) < w.count
            kept.update(open_)
        elif v.kind == BUSY:
            # No head-of-line idling: a run told "busy" really cannot be served with what is left.
            assert len(usable) < w.count and not (set(usable) & kept)
        elif v.kind == RESERVED:
            assert len(open_) < w.count and len(usable) > len(open_)
        elif v.kind == LIMIT:
            assert limits[w.uid] and holding[w.uid] + w.count > limits[w.uid]


def test_users_take_turns_whatever_the_arrival_order() -> None:
    # alice queued five runs before bob's one; both hold one device; one device frees.
    waiters = [make_waiter(f"a{i}", 1, i, 1, None, arrival=i) for i in range(5)]
    waiters.append(make_waiter("b0", 2, 9, 1, None, arrival=10))
    verdicts = decide(waiters, ["GPU-0"], {1: 1, 2: 0}, {}, now=20)
    assert verdicts["b0"].kind == GRANTED
    # Then the turns alternate from the fewest held: bob, alice, alice...
    assert [w.key for w in order(waiters, {1: 1, 2: 0}, 20)] == ["b0", "a0", "a1", "a2", "a3", "a4"]


def test_grants_first_stops_where_nothing_is_left_to_give() -> None:
    """decide(grants_first=True), as the service asks before a hand-over's send: the line is
    worked out only as far as the last grant; the rest (1000 waiters: most of a decision)
    waits for finish()."""
    waiters = [make_waiter(f"w{i:03d}", 1 + i % 3, i, 1, None, arrival=i) for i in range(50)]
    early = decide(waiters, ["GPU-0", "GPU-1"], {}, {}, now=100, grants_first=True)
    assert sorted(v.kind for v in early.values()) == [GRANTED, GRANTED]
    assert [k for k, v in early.items()] == ["w000", "w001"]
    whole = early.finish()
    assert len(whole) == 50 and whole["w049"].text == "every device it may use is busy; position 50 in line"


def test_a_large_run_does_not_idle_a_device_a_small_one_can_use() -> None:
    big = make_waiter("0", 1, 1, 4, None, arrival=0)
    small = make_waiter("1", 2, 2, 1, None, arrival=1)
    verdicts = decide([big, small], ["GPU-0"], {}, {}, now=2)
    assert verdicts["1"].kind == GRANTED and verdicts["0"].kind == BUSY
    assert "1 usable device free, 3 more needed" in verdicts["0"].text


def test_after_reserve_after_free_devices_are_kept_for_the_large_run() -> None:
    big = make_waiter("0", 1, 1, 4, None, arrival=0, reserve_after=300)
    small = make_waiter("1", 2, 2, 1, None, arrival=400)
    verdicts = decide([big, small], ["GPU-0", "GPU-1"], {}, {}, now=401)
    assert verdicts["0"].kind == RESERVING and verdicts["1"].kind == RESERVED
    assert "2 free devices kept for this run, waiting for 2 more" in verdicts["0"].text
    assert verdicts["1"].text.startswith("2 free devices it could use are kept for a run")


def test_a_user_at_the_limit_waits_and_says_so_and_others_pass() -> None:
    alice = make_waiter("0", 1, 1, 1, None, arrival=0)
    bob = make_waiter("1", 2, 2, 1, None, arrival=1)
    verdicts = decide([alice, bob], ["GPU-0"], {1: 2}, {1: 2}, now=2)
    assert verdicts["0"].kind == LIMIT and verdicts["1"].kind == GRANTED
    assert verdicts["0"].text == "you hold 2 devices, your limit is 2; waiting for one of yours to end"


def test_an_entry_claiming_no_reserve_after_waits_the_admins_shortest() -> None:
    """Queue jumping: an entry claiming reserve_after 0 (written by hand, or by the API with
    its own settings) is reserved for only after the config's shortest reserve_after."""
    forged = make_waiter("0", 1, 1, 4, None, arrival=0, reserve_after=0)
    other = make_waiter("1", 2, 2, 1, None, arrival=100)
    devices = frozenset(DEVICES[:4])
    verdicts = decide([forged, other], ["GPU-0", "GPU-1"], {}, {}, now=10, bounds=Bounds(300, 64, devices))
    assert verdicts["1"].kind == GRANTED and verdicts["0"].kind == BUSY
    assert [w.key for w in order([forged, other], {}, 10, Bounds(300, 64, devices))] == ["0", "1"]
    # Once it has waited that long it is a starving large run like any other.
    verdicts = decide([forged, other], ["GPU-0", "GPU-1"], {}, {}, now=301, bounds=Bounds(300, 64, devices))
    assert verdicts["0"].kind == RESERVING and verdicts["1"].kind == RESERVED
    assert verdicts["0"].text.startswith("waited over 300 s:")
    # A longer claim stands (an admin's per-program value).
    patient = make_waiter("0", 1, 1, 4, None, arrival=0, reserve_after=600)
    assert decide([patient, other], ["GPU-0"], {}, {}, now=301, bounds=Bounds(300, 64, devices))["1"].kind == GRANTED


def test_a_count_that_can_never_be_met_reserves_nothing() -> None:
    """999 devices (or more than any run may ask for, or than exist among those it may
    use) keep nothing idle, however long the run has waited."""
    devices = frozenset(DEVICES[:4])
    impossible = [make_waiter("0", 1, 1, 999, None, arrival=0, reserve_after=0),
                  make_waiter("0", 1, 1, 4, None, arrival=0, reserve_after=0),  # above max_gpus 3
                  make_waiter("0", 1, 1, 3, frozenset(["GPU-0", "GPU-1", "GPU-9"]), arrival=0, reserve_after=0)]
    for w in impossible:
        other = make_waiter("1", 2, 2, 1, None, arrival=999)
        verdicts = decide([w, other], ["GPU-0", "GPU-1"], {}, {}, now=1000, bounds=Bounds(300, 3, devices))
        assert verdicts["1"].kind == GRANTED and verdicts["0"].kind == BUSY, w
        assert "position" in verdicts["0"].text
    # The same run within the bounds has devices kept for it.
    possible = make_waiter("0", 1, 1, 3, None, arrival=0, reserve_after=0)
    verdicts = decide([possible, make_waiter("1", 2, 2, 1, None, arrival=999)], ["GPU-0", "GPU-1"], {}, {},
                      now=1000, bounds=Bounds(300, 3, devices))
    assert verdicts["0"].kind == RESERVING and verdicts["1"].kind == RESERVED


def _stream(reserve_after: float) -> Optional[float]:
    """When a 4-device run starts among a steady stream of 1-device runs from two other
    users, on a 4-device machine that is never idle (None: not within 100 s)."""
    import random

    rnd = random.Random(7)
    # The machine starts full, its devices freeing at different moments.
    running: Dict[str, tuple] = {f"r{i}": (1 + i % 2, (d,), 1.3 * (i + 1)) for i, d in enumerate(DEVICES[:4])}
    waiting = [make_waiter("big", 9, 9, 4, None, arrival=0.0, reserve_after=reserve_after)]
    next_key = 0
    for step in range(2000):
        now = step * 0.05
        for key, (_uid, _devs, ends) in list(running.items()):
            if ends <= now:
                del running[key]
        while len([w for w in waiting if w.uid != 9]) < 6:
            next_key += 1
            waiting.append(make_waiter(f"s{next_key:05d}", rnd.choice([1, 2]), next_key, 1, None, arrival=now))
        busy = {d for (_u, devs, _e) in running.values() for d in devs}
        free = [d for d in DEVICES[:4] if d not in busy]
        held: Dict[int, int] = defaultdict(int)
        for uid, devs, _e in running.values():
            held[uid] += len(devs)
        verdicts = decide(waiting, free, held, {}, now)
        for w in list(waiting):
            v = verdicts[w.key]
            if v.kind == GRANTED:
                if w.key == "big":
                    return now
                waiting.remove(w)
                running[w.key] = (w.uid, v.devices, now + rnd.uniform(3, 9))
    return None


def test_no_starvation_in_a_simulated_stream() -> None:
    assert _stream(float("inf")) is None  # without reservations it would wait for ever
    started = _stream(30.0)
    assert started is not None and 30.0 <= started <= 30.0 + 9.0 + 0.05


def test_each_waiter_is_judged_by_its_own_foreign_rule() -> None:
    """Work cudawrap did not start keeps a run off a device by the run's own rule (its
    program's foreign and busy_memory_mib), whatever rule the caller judged FREE by."""
    from cudawrap.sched.request import Request
    from cudawrap.sched.schedule import LISTED, kept

    avoid, ignore = ("avoid", 1024), ("ignore", 1024)
    on_a = frozenset({"a"})
    parents = {"a": "a", "b": "b", "c": "c"}
    work = {"a": LISTED, "c": 512}  # processes listed on a; c's hidden, 512 MiB used
    careless = Waiter("1", 1000, 1, Request(1, on_a, foreign=ignore))
    careful = Waiter("2", 1001, 2, Request(1, on_a, foreign=avoid))
    strict = Waiter("3", 1002, 3, Request(1, frozenset({"c"}), foreign=("avoid", 100)))
    plain = Waiter("4", 1003, 4, Request(1, frozenset({"c"})))  # a queue entry: the caller's rule
    # Judged by "avoid": a set aside, c free (512 MiB is not over 1024).
    v = decide([careless, careful, strict, plain], ["b", "c"], {}, {}, 0.0, parents, {"a"},
               work=work, rule=avoid, aside=["a"])
    assert (v["1"].kind, v["1"].devices) == (GRANTED, ("a",))
    assert v["2"].kind == BUSY and v["3"].kind == BUSY
    assert (v["4"].kind, v["4"].devices) == (GRANTED, ("c",))
    # Judged by "ignore": nothing set aside; the careful runs are still kept off.
    v = decide([careful, strict, plain], ["a", "b", "c"], {}, {}, 0.0, parents, set(), work=work, rule=ignore)
    assert v["2"].kind == BUSY and v["3"].kind == BUSY
    assert (v["4"].kind, v["4"].devices) == (GRANTED, ("c",))
    assert not kept(ignore, LISTED) and kept(avoid, LISTED) and not kept(avoid, None) and kept(("avoid", 100), 512)
