"""GPU health, the state file: the monitor writes it every cycle (the GPUs, what brings each
back, the leftover processes and idle leases it saw); `cudawrap health`, status, usage and
the metrics read it, as any user (under [service] private_status, a copy naming nobody).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from .. import locations as loc
from ..base import rootfile
from .rule import GpuHealth, Policy, comes_back

HEALTH_STATE = loc.RUNTIME_DIR + "/health.state"
PUBLIC_STATE = loc.RUNTIME_DIR + "/health.public"  # under private_status, for users (save)
STATE_VERSION = 1


def save(root: str, gpus: Mapping[str, GpuHealth], policy: Policy, now: float,
         leftovers: Sequence[Any] = (), idle: Optional[Mapping[str, Any]] = None, private: bool = False) -> None:
    """The state file; PRIVATE ([service] private_status): root's alone, and beside it a copy
    for everyone (PUBLIC_STATE) whose leftovers and idle leases name nobody."""
    from ..policy.privacy import public_idle, public_leftovers

    data = {
        "version": STATE_VERSION, "written": now,
        "gpus": [g.to_tuple() for g in gpus.values()],
        "back": {u: comes_back(g, policy, now) for u, g in gpus.items()},
        "leftovers": [left.to_tuple() for left in leftovers],
        "idle": {u: lease.to_tuple() for u, lease in (idle or {}).items()}, "idle_after_s": policy.idle_after_s,
    }
    public = loc.under(root, PUBLIC_STATE)
    if private:  # the copy first: a user never finds neither readable
        rootfile.write(public, dict(data, leftovers=public_leftovers(data["leftovers"]), idle=public_idle(data["idle"])))
        rootfile.write(loc.under(root, HEALTH_STATE), data, mode=0o600)
        return
    rootfile.write(loc.under(root, HEALTH_STATE), data)
    try:
        os.unlink(public)  # private_status turned off: the whole file is everyone's again
    except FileNotFoundError:
        pass


def _state(root: str) -> Optional[dict]:
    """The state file, or where only root may read it (private_status) the public copy."""
    return (rootfile.read(root, loc.under(root, HEALTH_STATE), STATE_VERSION)
            or rootfile.read(root, loc.under(root, PUBLIC_STATE), STATE_VERSION))


def load(root: str) -> Tuple[Dict[str, GpuHealth], Dict[str, str], float]:
    """The GPUs' health as the monitor last wrote it, what brings each back, and when written."""
    data = _state(root)
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

    data = _state(root)
    try:
        return ({str(u): Lease(*t) for u, t in (data or {}).get("idle", {}).items()},
                float((data or {}).get("idle_after_s", 0.0)), float((data or {}).get("written", 0.0)))
    except (TypeError, ValueError, AttributeError):
        return {}, 0.0, 0.0


def leftover_list(root: str) -> List[Any]:
    """The leftover processes (leftovers.Leftover) as the monitor last saw them."""
    from .leftovers import Leftover

    data = _state(root)
    try:
        return [Leftover(*t) for t in (data or {}).get("leftovers", ())]
    except (TypeError, ValueError):
        return []


def leftovers(root: str, me: Optional[str] = None) -> Dict[str, List[str]]:
    """Device UUID -> its leftover processes as the monitor last saw them, in words; where ME
    is given ([service] private_status), others' without who or what."""
    from ..policy.privacy import leftover_text

    out: Dict[str, List[str]] = {}
    for left in leftover_list(root):
        out.setdefault(left.uuid, []).append(leftover_text(left, me))
    return out
