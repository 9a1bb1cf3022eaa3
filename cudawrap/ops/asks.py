"""A client's request, read under the policy as the service reads it (never the client's).

The program comes from peer.program (the kernel's word), its settings from the config the
service reads; what the client says (its count, wait, CUDA_VISIBLE_DEVICES, filter asks)
only narrows them, through the same rules the daemonless launch applies to the
environment (policy.narrow, sched.candidates.usable).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Optional

from ..devices.model import Inventory
from ..errors import SetupError, UsageError
from ..sched.schedule import Waiter

MAX_COUNT = 999  # as the queue's names allow


@dataclass
class Ask:
    """One client's request, checked: what its waiter asks, and how long it may wait."""

    count: int
    wait: float
    candidates: Optional[FrozenSet[str]]  # None: any device
    placement: str
    reserve_after: float
    min_free_mib: int
    max_util: int
    program: str  # the link of a wrapped program, "" for the API and `cudawrap run`

    def waiter(self, key: str, uid: int, pid: int, arrival: float) -> Waiter:
        name = self.program.rsplit("/", 1)[-1] if self.program else "(not a wrapped program)"
        return Waiter(key, uid, pid, self.count, self.candidates, self.placement, self.reserve_after,
                      arrival, name, self.min_free_mib, self.max_util)


def _number(fields: Dict[str, str], key: str, default: str) -> float:
    raw = fields.get(key, default)
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{key}={raw[:40]!r}: not a number") from None
    if value != value or value < 0:
        raise UsageError(f"{key}={raw[:40]!r}: not a number of 0 or more")
    return value


def read(root: str, inventory: Inventory, fields: Dict[str, str], link: Optional[str], uid: int,
         present: FrozenSet[str]) -> Ask:
    """The Ask of FIELDS from UID running LINK (None: not a wrapped program); CudawrapError
    (with the exit status the client passes on) when it can never be met or is malformed.
    PRESENT: the devices that have lease files."""
    from ..sched import candidates as narrow
    from ..policy import effective as policy

    settings = policy.effective(root, link, {})
    for key in ("model", "min_memory_mib", "min_free_memory_mib", "max_utilization"):
        if key in fields:
            policy.ask(settings, key, fields[key], "the run's environment", f"{key}={fields[key][:40]!r}")
    count = _number(fields, "count", "1")
    if count != int(count) or not 1 <= count <= MAX_COUNT:
        raise UsageError(f"count={fields.get('count', '')[:40]!r}: not a number of devices")
    count = int(count)
    policy.check_count(settings, count)
    value = {k: v for k, (v, _src) in settings.items()}
    wait = min(float(value["wait"]), _number(fields, "wait", "inf"))
    allow = narrow.allow_list(value)
    preset = fields.get("visible")
    if preset is not None and not preset.strip():
        raise UsageError("CUDA_VISIBLE_DEVICES is empty: this run asks for no device")
    candidates = narrow.usable(inventory, value, allow, preset, count, fields.get("order"))
    narrow.limits_of(value, count, uid)
    usable = frozenset(d.uuid for d in candidates if d.uuid in present)
    if len(usable) < count:
        from ..lease.files import SYNC_HINT

        raise SetupError(f"{len(candidates) - len(usable)} of the usable devices have no lease file", hint=SYNC_HINT)
    everything = frozenset(d.uuid for d in inventory.devices)
    return Ask(count, wait, None if usable >= everything else usable, value["placement"],
               float(value.get("reserve_after", 300.0)), int(value.get("min_free_memory_mib", 0)),
               int(value.get("max_utilization", 100)), link or "")


def arrival_key(pid: int, now_ns: Optional[int] = None) -> "tuple[str, float]":
    """A waiter's key (sorts by arrival, unique) and its arrival, from the service's clock
    (NOW_NS: the arrival a reconnect ticket restored)."""
    if now_ns is None:
        now_ns = time.time_ns()
    return f"{now_ns:020d}.{pid}.service", now_ns / 1e9
