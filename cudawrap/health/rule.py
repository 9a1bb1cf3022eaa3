"""GPU health, the rule: which events drain a GPU and when a drained one comes back. Pure:
`step()` turns one cycle's events and persisting conditions, the state so far and the
[health] settings into transitions; nothing here reads NVML or changes anything.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..policy.healthconf import XID_NAMES

log = logging.getLogger(__name__)

HISTORY = 20  # events kept per GPU: a storm must not grow memory

HEALTHY = "healthy"
DRAINED = "drained"


@dataclass(frozen=True)
class Event:
    """One NVML event: KIND "xid" (with its number) or "dbe", on the GPU UUID, at AT."""

    uuid: str
    kind: str
    xid: int
    at: float
    instance: Optional[int] = None  # the GPU instance id, for an event in a MIG instance

    def describe(self) -> str:
        if self.kind == "dbe":
            return "double-bit ECC error"
        name = XID_NAMES.get(self.xid)
        return f"Xid {self.xid} ({name})" if name else f"Xid {self.xid} (not in the catalog)"


@dataclass(frozen=True)
class Policy:
    drain_xids: Tuple[int, ...]
    ignore_xids: Tuple[int, ...]
    unknown_xid: str  # "drain" or "ignore"
    recover_after_s: float
    leftover_action: str = "report"
    leftover_grace_s: float = 60.0
    idle_after_s: float = 1800.0
    idle_action: str = "report"

    @classmethod
    def from_config(cls, config: Any) -> "Policy":
        return cls(tuple(config["drain_xids"]), tuple(config["ignore_xids"]), config["unknown_xid"],
                   float(config["recover_after_s"]), config["leftover_action"], float(config["leftover_grace_s"]),
                   60.0 * float(config["idle_after_min"]), config["idle_action"])

    def drains(self, event: Event) -> bool:
        if event.kind == "dbe":
            return True
        if event.xid in self.drain_xids:
            return True
        if event.xid in self.ignore_xids:
            return False
        return self.unknown_xid == "drain"


@dataclass
class GpuHealth:
    """What is known of one GPU: its state, why, since when, and its last events."""

    uuid: str
    state: str = HEALTHY
    reason: str = ""
    since: float = 0.0
    last_bad: float = 0.0  # the last time its condition was seen (event or persisting)
    condition: str = ""  # what persists now ("" when nothing)
    events: Deque[Tuple[float, str, bool]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    notes: str = ""  # what is worth knowing but drains nothing (thermal slowdown)

    def to_tuple(self) -> tuple:
        return (self.uuid, self.state, self.reason, self.since, self.last_bad, self.condition,
                tuple(self.events), self.notes)

    @classmethod
    def from_tuple(cls, t: Sequence[Any]) -> "GpuHealth":
        uuid, state, reason, since, last_bad, condition, events, notes = t
        out = cls(str(uuid), str(state), str(reason), float(since), float(last_bad), str(condition),
                  notes=str(notes))
        out.events.extend((float(a), str(w), bool(d)) for a, w, d in events)
        return out


@dataclass(frozen=True)
class Transition:
    uuid: str
    to: str  # DRAINED or HEALTHY
    reason: str
    at: float


def clock(at: float) -> str:
    """AT as the drain reasons and `cudawrap health` show it."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def step(gpus: Dict[str, GpuHealth], events: Iterable[Event], conditions: Mapping[str, str],
         now: float, policy: Policy) -> List[Transition]:
    """Apply this cycle's EVENTS and persisting CONDITIONS (GPU UUID -> words) to GPUS, in
    place; the transitions that follow, at most one per GPU."""
    first: Dict[str, str] = {}  # uuid -> what drains it this cycle
    for event in events:
        gpu = gpus.setdefault(event.uuid, GpuHealth(event.uuid))
        drains = policy.drains(event)
        gpu.events.append((event.at, event.describe(), drains))
        if drains:
            gpu.last_bad = max(gpu.last_bad, event.at)
            first.setdefault(event.uuid, f"{event.describe()} at {clock(event.at)}")
        elif event.kind == "xid" and event.xid not in policy.ignore_xids:
            log.warning("GPU %s: %s is not in [health] drain_xids or ignore_xids; unknown_xid = ignore",
                        event.uuid, event.describe())
    for uuid, gpu in gpus.items():
        gpu.condition = conditions.get(uuid, "")
        if gpu.condition:
            gpu.last_bad = now
            first.setdefault(uuid, f"{gpu.condition} at {clock(now)}")
    out: List[Transition] = []
    for uuid, gpu in sorted(gpus.items()):
        if gpu.state == HEALTHY and uuid in first:
            gpu.state, gpu.reason, gpu.since = DRAINED, "health: " + first[uuid], now
            out.append(Transition(uuid, DRAINED, gpu.reason, now))
        elif gpu.state == DRAINED and not gpu.condition and now - gpu.last_bad >= policy.recover_after_s:
            reason = f"clear for {now - gpu.last_bad:.0f} s (recover_after_s = {policy.recover_after_s:g})"
            gpu.state, gpu.reason, gpu.since = HEALTHY, "", now
            out.append(Transition(uuid, HEALTHY, reason, now))
    return out


def comes_back(gpu: GpuHealth, policy: Policy, now: float) -> str:
    """What will bring a drained GPU back, in words."""
    if gpu.state != DRAINED:
        return ""
    if gpu.condition:
        return (f"once {gpu.condition!s} clears (a GPU reset or reboot) and stays clear "
                f"{policy.recover_after_s:g} s")
    left = policy.recover_after_s - (now - gpu.last_bad)
    return f"by itself in {max(left, 0):.0f} s if no new error comes (recover_after_s = {policy.recover_after_s:g})"
