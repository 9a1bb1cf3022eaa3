"""Who gets a device the moment its holder lets go: the last decision's look, carried on.

A hand-over is what every waiting user feels: from a run's exit to the next run's start.
Most of the service's share of it was the look at the machine that a decision starts
from (each lease tried, each holder's uid, the devices' readings), about two thirds of a
millisecond on a cold 2-core VM, though one release changes one thing in it: the devices
let go are free again, and their holder holds that much less. So the decision's inputs
are kept (State), brought up to date with its grants (after), and a release decides on
them at once (released, then schedule.decide): the same pure rule, on what a new look
would have found. The caller keeps a State only while nothing else has changed, and
looks again (a full decision) as soon as nothing else waits.

Pure: no file, no process, no clock but the one passed in.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Mapping, Optional, Sequence, Set, Tuple

    from .terms import Bounds, Shares, Waiter


class State:
    """The inputs of one decision (schedule.decide) but the clock, and who holds what.

    ORDER: every device in the machine's order (free devices are listed in it); OWNERS:
    uuid -> the uid holding it whole, for the devices held now."""

    __slots__ = ("waiters", "free", "held", "limits", "parents", "busy", "fit", "shares", "bounds", "order",
                 "owners")

    def __init__(self, waiters: Sequence[Waiter], free: Sequence[str], held: Mapping[int, float],
                 limits: Mapping[int, int], parents: Mapping[str, str], busy: Set[str],
                 fit: Mapping[str, Tuple[Optional[int], Optional[int]]], shares: Shares, bounds: Bounds,
                 order: Sequence[str], owners: Mapping[str, int]) -> None:
        self.waiters = list(waiters)
        self.free = list(free)
        self.held = dict(held)
        self.limits = dict(limits)
        self.parents = parents
        self.busy = set(busy)
        self.fit = dict(fit)
        self.shares = shares
        self.bounds = bounds
        self.order = order
        self.owners = dict(owners)

    def decide(self, now: float) -> Dict[str, Tuple[str, ...]]:
        """The grants the rule makes on this state at NOW (time.time()): key -> devices."""
        from .schedule import GRANTED, decide

        verdicts = decide(self.waiters, self.free, self.held, self.limits, now, self.parents, self.busy, self.fit,
                          self.shares, self.bounds, grants_first=True)
        return {key: v.devices for key, v in verdicts.items() if v.kind == GRANTED}


def after(state: State, grants: Mapping[str, Sequence[str]]) -> State:
    """STATE once each run of GRANTS (key -> devices, whole) holds what it was given: gone
    from the line, its devices busy and counted for its user."""
    uid_of = {w.key: w.uid for w in state.waiters}
    out = State([w for w in state.waiters if w.key not in grants], state.free, state.held, state.limits,
                state.parents, state.busy, state.fit, state.shares, state.bounds, state.order, state.owners)
    for key, devices in grants.items():
        uid = uid_of[key]
        for uuid in devices:
            out.free.remove(uuid)
            out.busy.add(uuid)
            out.owners[uuid] = uid
        out.held[uid] = out.held.get(uid, 0) + len(devices)
    return out


def released(state: State, devices: Sequence[str],
             fit: Mapping[str, Tuple[Optional[int], Optional[int]]]) -> Optional[State]:
    """STATE once DEVICES, held whole, are let go and found free (FIT: each one's reading
    now); None where STATE does not have them held (its look is not this machine's)."""
    if any(uuid not in state.owners or uuid in state.free for uuid in devices):
        return None
    out = State(state.waiters, state.free, state.held, state.limits, state.parents, state.busy,
                {**state.fit, **fit}, state.shares, state.bounds, state.order, state.owners)
    for uuid in devices:
        uid = out.owners.pop(uuid)
        out.held[uid] = out.held.get(uid, 0) - 1
        if out.held[uid] <= 0:
            del out.held[uid]
        out.busy.discard(uuid)
    freed = set(out.free) | set(devices)
    out.free = [u for u in state.order if u in freed]
    return out

