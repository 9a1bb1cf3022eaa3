"""A release decided on the last look carried on (sched/successor.py) against a new look.

The service hands a freed device over on the state its last decision saw, brought up to date
with that decision's grants and the release, instead of looking at the machine again. That
is only right if the carried state is the one a new look would build: random machines,
holders and waiters, a decision, then releases one after another, each compared with the
state made from scratch for the same holders, and its grants with the rule's on that state.
"""
from typing import Dict, List, Optional, Tuple

from hypothesis import given, settings, strategies as st

from support.sched import make_waiter
from cudawrap.sched.schedule import Bounds, Shares, Waiter
from cudawrap.sched.successor import State, after, released

DEVICES = [f"GPU-{i}" for i in range(6)]
NOW = 60.0


def scratch(holders: Dict[str, Optional[int]], waiters: List[Waiter], limits: Dict[int, int],
            parents: Dict[str, str]) -> State:
    """The state a new look builds: free devices in the machine's order, each holder's count,
    the devices held busy (placement reads them)."""
    held: Dict[int, float] = {}
    for uid in holders.values():
        if uid is not None:
            held[uid] = held.get(uid, 0) + 1
    return State(waiters, [d for d in DEVICES if holders[d] is None], held, limits, parents,
                 {d for d in DEVICES if holders[d] is not None}, {}, Shares(), Bounds(0.0, 0, frozenset(DEVICES)),
                 DEVICES, {d: uid for d, uid in holders.items() if uid is not None})


def same(a: State, b: State) -> None:
    assert [w.key for w in a.waiters] == [w.key for w in b.waiters]
    assert a.free == b.free
    assert {u: n for u, n in a.held.items() if n} == {u: n for u, n in b.held.items() if n}
    assert a.busy == b.busy
    assert a.owners == b.owners


@st.composite
def machines(draw):  # type: ignore[no-untyped-def]
    holders = {d: draw(st.one_of(st.none(), st.integers(0, 3))) for d in DEVICES}
    parent_of = draw(st.lists(st.integers(0, 2), min_size=len(DEVICES), max_size=len(DEVICES)))
    parents = {d: f"GPU-parent-{parent_of[i]}" for i, d in enumerate(DEVICES)}
    placement = draw(st.sampled_from(["spread", "pack"]))
    waiters = []
    for i in range(draw(st.integers(0, 9))):
        narrowed = draw(st.booleans())
        candidates = frozenset(draw(st.lists(st.sampled_from(DEVICES), min_size=1, unique=True))) if narrowed else None
        waiters.append(make_waiter(
            key=f"{i:04d}", uid=draw(st.integers(0, 3)), pid=1000 + i, count=draw(st.integers(1, 3)),
            candidates=candidates, placement=placement,
            reserve_after=draw(st.sampled_from([5.0, 50.0, float("inf")])), arrival=float(draw(st.integers(0, 60)))))
    limits = {uid: draw(st.integers(0, 4)) for uid in range(4)}
    # Releases: each takes some of one holder's devices (by index into what it holds then).
    releases = draw(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 3)), max_size=6))
    return holders, parents, waiters, limits, releases


def _release(holders: Dict[str, Optional[int]], pick: Tuple[int, int]) -> List[str]:
    """Some devices of one holder, chosen by PICK (which holder, how many)."""
    held = [d for d in DEVICES if holders[d] is not None]
    if not held:
        return []
    uid = holders[held[pick[0] % len(held)]]
    return [d for d in DEVICES if holders[d] == uid][:pick[1]]


@settings(max_examples=600, deadline=None)
@given(machines())
def test_a_release_carried_on_decides_as_a_new_look_would(case) -> None:  # type: ignore[no-untyped-def]
    holders, parents, waiters, limits, releases = case
    state = scratch(holders, waiters, limits, parents)
    grants = state.decide(NOW)
    for pick in [None] + releases:
        # The decision's grants taken: the state carried on is the new look's.
        holders = dict(holders)
        for key, devices in grants.items():
            uid = next(w.uid for w in state.waiters if w.key == key)
            for d in devices:
                assert holders[d] is None, f"{d} given while held"
                holders[d] = uid
        waiters = [w for w in waiters if w.key not in grants]
        state = after(state, grants)
        same(state, scratch(holders, waiters, limits, parents))
        grants = {}
        if pick is None:
            continue
        freed = _release(holders, pick)
        if not freed:
            break
        for d in freed:
            holders[d] = None
        carried = released(state, freed, {})
        assert carried is not None
        fresh = scratch(holders, waiters, limits, parents)
        same(carried, fresh)
        grants = carried.decide(NOW)
        assert grants == fresh.decide(NOW)
        state = carried


def test_a_release_of_a_device_the_look_did_not_see_held_is_not_carried_on() -> None:
    holders: Dict[str, Optional[int]] = {d: None for d in DEVICES}
    holders["GPU-1"] = 2
    state = scratch(holders, [], {}, {d: d for d in DEVICES})
    assert released(state, ["GPU-0"], {}) is None  # free at the look: someone took it past it
    assert released(state, ["GPU-1", "GPU-0"], {}) is None
    assert released(state, ["GPU-1"], {}) is not None


def test_a_release_frees_its_holders_share_of_the_turns() -> None:
    """Alice held two devices, Bob one; both wait. Alice lets one go: holding as many as Bob
    now, and her run the older, the device goes to her run; had the state kept her count,
    it would have gone to Bob's."""
    holders: Dict[str, Optional[int]] = {d: None for d in DEVICES}
    holders.update({"GPU-0": 1, "GPU-1": 1, "GPU-2": 2, "GPU-3": 3, "GPU-4": 3, "GPU-5": 3})
    waiters = [make_waiter("0001", 1, 11, 1, None, arrival=1.0), make_waiter("0002", 2, 12, 1, None, arrival=2.0)]
    state = scratch(holders, waiters, {}, {d: d for d in DEVICES})
    assert state.decide(NOW) == {}
    carried = released(state, ["GPU-1"], {})
    assert carried is not None
    assert carried.decide(NOW) == {"0001": ("GPU-1",)}


def _line_after_a_decision(waiting: int, foreign=None):  # type: ignore[no-untyped-def]
    """A service's Line whose last decision (Acquirer.last) saw WAITING runs in line, every
    device held: what Line._carried reads, nothing else of a machine. FOREIGN: the last
    one's own rule for work cudawrap did not start (None: the service's)."""
    from types import SimpleNamespace

    from cudawrap.service.waitline import Line

    line = Line.__new__(Line)  # the decision's look alone: no machine read
    waiters = [SimpleNamespace(key=f"run-{i}", uid=1000 + i % 3, request=SimpleNamespace(foreign=None))
               for i in range(waiting)]
    waiters[-1].request.foreign = foreign
    last = (waiters, [], {1000: 1.0}, {}, {"GPU-a"}, {}, None, None, ["GPU-a"])
    line.acquirer = SimpleNamespace(last=last, sharing=SimpleNamespace(anywhere=False), skip_keys=set(),
                                    skip_users=set(), parents={}, whole={"GPU-a": 1000}, foreign="avoid",
                                    busy_memory_mib=1024)
    return line


def test_a_line_longer_than_the_cap_is_not_carried_on_to_a_release() -> None:
    """With more than CARRY_MAX_WAITERS in line, a release waits for the full decision (the
    rule's order over a long line at each release cost the service its CPU target)."""
    from cudawrap.service.waitline import CARRY_MAX_WAITERS

    kept = _line_after_a_decision(CARRY_MAX_WAITERS)._carried({})  # type: ignore[arg-type]
    assert kept is not None and len(kept.waiters) == CARRY_MAX_WAITERS
    assert kept.owners == {"GPU-a": 1000}
    assert _line_after_a_decision(CARRY_MAX_WAITERS + 1)._carried({}) is None  # type: ignore[arg-type]


def test_a_line_with_a_run_of_its_own_foreign_rule_is_not_carried_on_to_a_release() -> None:
    """A run whose program has its own `foreign` rule: a device let go is judged for it by a
    full decision (a release's hand-over judges it by the service's rule alone)."""
    assert _line_after_a_decision(3, ("avoid", 1024))._carried({}) is not None  # type: ignore[arg-type]
    assert _line_after_a_decision(3, ("ignore", 1024))._carried({}) is None  # type: ignore[arg-type]
