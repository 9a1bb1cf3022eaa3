"""GPU health, the state file: the monitor writes it every cycle (the GPUs, what brings each
back, the leftover processes and idle leases it saw); `cudawrap health`, status, usage and
the metrics read it, as any user.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .. import locations as loc
from ..base import rootfile
from .healthrule import GpuHealth, Policy, comes_back

HEALTH_STATE = loc.RUNTIME_DIR + "/health.state"
STATE_VERSION = 1


def save(root: str, gpus: Mapping[str, GpuHealth], policy: Policy, now: float,
         leftovers: Sequence[Any] = (), idle: Optional[Mapping[str, Any]] = None) -> None:
    rootfile.write(loc.under(root, HEALTH_STATE), {
        "version": STATE_VERSION, "written": now,
        "gpus": [g.to_tuple() for g in gpus.values()],
        "back": {u: comes_back(g, policy, now) for u, g in gpus.items()},
        "leftovers": [left.to_tuple() for left in leftovers],
        "idle": {u: lease.to_tuple() for u, lease in (idle or {}).items()}, "idle_after_s": policy.idle_after_s,
    })


def load(root: str) -> Tuple[Dict[str, GpuHealth], Dict[str, str], float]:
    """The GPUs' health as the monitor last wrote it, what brings each back, and when written."""
    data = rootfile.read(root, loc.under(root, HEALTH_STATE), STATE_VERSION)
    if data is None:
        return {}, {}, 0.0
    try:
        gpus = {g.uuid: g for g in (GpuHealth.from_tuple(t) for t in data["gpus"])}
        return gpus, {str(k): str(v) for k, v in data["back"].items()}, float(data["written"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return {}, {}, 0.0


def idle_leases(root: str) -> Tuple[Dict[str, Any], float, float]:
    """Held device UUID -> idle.Lease as the monitor last sampled it, idle_after_s, and when."""
    from .idle import Lease

    data = rootfile.read(root, loc.under(root, HEALTH_STATE), STATE_VERSION)
    try:
        return ({str(u): Lease(*t) for u, t in (data or {}).get("idle", {}).items()},
                float((data or {}).get("idle_after_s", 0.0)), float((data or {}).get("written", 0.0)))
    except (TypeError, ValueError, AttributeError):
        return {}, 0.0, 0.0


def leftover_list(root: str) -> List[Any]:
    """The leftover processes (leftovers.Leftover) as the monitor last saw them."""
    from .leftovers import Leftover

    data = rootfile.read(root, loc.under(root, HEALTH_STATE), STATE_VERSION)
    try:
        return [Leftover(*t) for t in (data or {}).get("leftovers", ())]
    except (TypeError, ValueError):
        return []


def leftovers(root: str) -> Dict[str, List[str]]:
    """Device UUID -> its leftover processes as the monitor last saw them, in words."""
    out: Dict[str, List[str]] = {}
    for left in leftover_list(root):
        out.setdefault(left.uuid, []).append(left.describe())
    return out
