"""The scheduling rule for shared runs, pure: fill-first, slots, MPS users, reservations, limits.

Like tests/test_schedule.py, no processes: random machines with shared devices are checked
against the invariants the rule promises (docs/admin/sharing.md).
"""
from collections import defaultdict
from typing import Dict, List

from hypothesis import given, settings, strategies as st

from support.sched import make_waiter
from cudawrap.sched.schedule import BUSY, GRANTED, LIMIT, RESERVED, RESERVING, Shares, Waiter, decide

DEVICES = [f"GPU-{i}" for i in range(5)]


def share(key: str, uid: int, count: int = 1, **kw) -> Waiter:  # type: ignore[no-untyped-def]
    return make_waiter(key, uid, 100 + int(key), count, None, share=True, **kw)


def whole(key: str, uid: int, count: int = 1, **kw) -> Waiter:  # type: ignore[no-untyped-def]
    return make_waiter(key, uid, 100 + int(key), count, None, **kw)


def test_shared_runs_fill_the_fullest_device_first() -> None:
    shares = Shares({d: 4 for d in DEVICES}, {"GPU-1": [1], "GPU-3": [1, 2, 2]})
    v = decide([share("1", 5)], ["GPU-0", "GPU-2", "GPU-4"], {}, {}, 0.0, shares=shares)
    assert v["1"].devices == ("GPU-3",)  # one slot left there: filled before GPU-1's three
    v = decide([share("1", 5), share("2", 5), share("3", 5)], ["GPU-0"], {}, {}, 0.0,
               shares=Shares({d: 2 for d in DEVICES}, {"GPU-1": [1]}))
    assert [v[k].devices for k in "123"] == [("GPU-1",), ("GPU-0",), ("GPU-0",)]


def test_exclusive_runs_never_get_a_shared_device_and_shares_leave_whole_ones() -> None:
    shares = Shares({d: 2 for d in DEVICES}, {"GPU-0": [1]})
    v = decide([whole("1", 2), share("2", 3)], ["GPU-1"], {}, {}, 0.0, shares=shares)
    assert v["1"].devices == ("GPU-1",) and v["2"].devices == ("GPU-0",)
    v = decide([whole("1", 2)], [], {}, {}, 0.0, shares=shares)
    assert v["1"].kind == BUSY


def test_under_mps_a_device_serves_one_user() -> None:
    shares = Shares({d: 4 for d in DEVICES}, {"GPU-0": [1]}, mps=True)
    v = decide([share("1", 2)], ["GPU-1"], {}, {}, 0.0, shares=shares)
    assert v["1"].devices == ("GPU-1",)  # not beside user 1's clients
    v = decide([share("1", 2)], [], {}, {}, 0.0, shares=shares)
    assert v["1"].kind == BUSY and "another user's runs (MPS" in v["1"].text
    v = decide([share("1", 1)], [], {}, {}, 0.0, shares=shares)
    assert v["1"].devices == ("GPU-0",)
    # Two users in one decision: the second does not join the device the first just opened.
    v = decide([share("1", 1), share("2", 2)], ["GPU-1", "GPU-2"], {}, {}, 0.0,
               shares=Shares({d: 4 for d in DEVICES}, {}, mps=True))
    assert v["1"].devices != v["2"].devices


def test_a_starving_exclusive_run_drains_the_shared_device_it_needs() -> None:
    shares = Shares({"GPU-0": 2}, {"GPU-0": [1]})
    starving = whole("1", 2, reserve_after=10.0, arrival=0.0)
    v = decide([starving, share("2", 3, arrival=50.0)], [], {}, {}, 60.0, shares=shares)
    assert v["1"].kind == RESERVING and "taking no new shares" in v["1"].text
    assert v["2"].kind == RESERVED  # the free slot is not taken: GPU-0 drains for run 1


def test_a_share_counts_as_a_fraction_of_a_device_towards_limits() -> None:
    shares = Shares({d: 4 for d in DEVICES}, {"GPU-0": [1, 1, 1]})
    v = decide([share("1", 1)], [], {1: 0.75}, {1: 1}, 0.0, shares=shares)
    assert v["1"].devices == ("GPU-0",)  # 0.75 + 0.25 = 1
    v = decide([share("1", 1)], ["GPU-1"], {1: 1.0}, {1: 1}, 0.0, shares=Shares({d: 4 for d in DEVICES}))
    assert v["1"].kind == LIMIT and "1.00 devices" not in v["1"].text
    v = decide([share("1", 1)], ["GPU-1"], {1: 0.5}, {1: 1}, 0.0,
               shares=Shares({d: 4 for d in DEVICES}, counts_as=0.6))
    assert v["1"].kind == LIMIT and "0.50 devices" in v["1"].text


@st.composite
def machines(draw):  # type: ignore[no-untyped-def]
    slots = {d: draw(st.integers(1, 4)) for d in DEVICES}
    used: Dict[str, List[int]] = {}
    free = []
    for d in DEVICES:
        state = draw(st.sampled_from(["free", "whole", "shared"]))
        if state == "free":
            free.append(d)
        elif state == "shared" and slots[d] > 1:
            used[d] = draw(st.lists(st.integers(0, 2), min_size=1, max_size=slots[d]))
    mps = draw(st.booleans())
    if mps:
        used = {d: [uids[0]] * len(uids) for d, uids in used.items()}
    waiters = []
    for i in range(draw(st.integers(0, 8))):
        narrowed = draw(st.booleans())
        candidates = frozenset(draw(st.lists(st.sampled_from(DEVICES), min_size=1, unique=True))) if narrowed else None
        waiters.append(make_waiter(f"{i:04d}", draw(st.integers(0, 2)), 1000 + i, draw(st.integers(1, 2)), candidates,
                              reserve_after=draw(st.sampled_from([5.0, float("inf")])),
                              arrival=float(draw(st.integers(0, 60))), share=draw(st.booleans())))
    limits = {uid: draw(st.integers(0, 3)) for uid in range(3)}
    return Shares(slots, used, mps), free, waiters, limits


@settings(max_examples=600, deadline=None)
@given(machines())
def test_no_slot_is_given_twice_and_nothing_exclusive_is_shared(case) -> None:  # type: ignore[no-untyped-def]
    shares, free, waiters, limits = case
    held: Dict[int, float] = defaultdict(float)
    for d, uids in shares.used.items():
        for uid in uids:
            held[uid] += shares.cost(d)
    verdicts = decide(waiters, free, dict(held), limits, 60.0, shares=shares)
    assert set(verdicts) == {w.key for w in waiters}
    on: Dict[str, List[int]] = {d: list(u) for d, u in shares.used.items()}
    whole_given: List[str] = []
    holding = defaultdict(float, held)
    for w in waiters:
        v = verdicts[w.key]
        if v.kind != GRANTED:
            assert not v.devices
            continue
        assert len(set(v.devices)) == len(v.devices) == w.count
        assert all(w.can_use(d) for d in v.devices)
        for d in v.devices:
            if w.share and shares.slots_of(d) > 1:
                assert d in free or d in shares.used
                on.setdefault(d, []).append(w.uid)
            else:
                assert d in free, "an exclusive run was given a device that is held"
                whole_given.append(d)
            holding[w.uid] += shares.cost(d) if w.share else 1.0
    assert len(whole_given) == len(set(whole_given)), "a device given whole twice"
    for d, uids in on.items():
        assert d not in whole_given, "a device given whole while shared"
        assert len(uids) <= shares.slots_of(d), f"{d}: {len(uids)} sharers for {shares.slots_of(d)} slots"
        if shares.mps:
            assert len(set(uids)) == 1, f"{d}: two users' shares under MPS"
    for uid, n in holding.items():
        if limits.get(uid) and n > held.get(uid, 0) + 1e-9:  # a grant was made: within the limit
            assert n <= limits[uid] + 1e-9, (uid, n)
    # No idling: a run told "busy" really has fewer devices it could take than it asked for.
    left = [d for d in free if d not in whole_given and d not in on]
    for w in waiters:
        if verdicts[w.key].kind != BUSY:
            continue
        could = {d for d in left if w.can_use(d)}
        if w.share:
            could |= {d for d, uids in on.items() if len(uids) < shares.slots_of(d) and w.can_use(d)
                      and not (shares.mps and any(uid != w.uid for uid in uids))}
        assert len(could) < w.count, (w, could)
    kinds = {v.kind for v in verdicts.values()}
    assert kinds <= {GRANTED, BUSY, RESERVED, RESERVING, LIMIT}


@given(machines())
def test_a_decision_made_grants_first_holds_every_grant_before_it_finishes(case) -> None:  # type: ignore[no-untyped-def]
    """The service sends grants before it works out every other waiter's verdict
    (decide(grants_first=True)): what it has by then must be every grant the whole decision
    makes, and finishing must give the whole decision."""
    shares, free, waiters, limits = case
    held: Dict[int, float] = {}
    whole = decide(waiters, free, held, limits, 60.0, shares=shares)
    early = decide(waiters, free, held, limits, 60.0, shares=shares, grants_first=True)
    granted = {k: v.devices for k, v in whole.items() if v.kind == GRANTED}
    assert {k: v.devices for k, v in early.items() if v.kind == GRANTED} == granted
    assert {k: (v.kind, v.devices, v.position, v.text) for k, v in early.finish().items()} == \
        {k: (v.kind, v.devices, v.position, v.text) for k, v in whole.items()}
