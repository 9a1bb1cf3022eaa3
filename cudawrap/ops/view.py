"""`cudawrap status` and `cudawrap cancel` with the service: what it knows that /proc cannot say.

When the service answers, the line it decides (its own waiters and the queue's, in one
order) replaces the one status computes from the queue alone, and a lease it granted is
named (user, program, pid) where this caller's look at /proc could not name its holder.
Without a service nothing changes.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from .. import wire
from ..paths import Layout


def _ask(layout: Layout) -> Optional[Dict[str, str]]:
    from ..launch import client

    return client.question(str(layout.root), wire.STATUS, {})


def through_service(layout: Layout, devices: List[Dict[str, Any]],
                    waiting: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """WAITING as the service sees it, and DEVICES' unknown holders named by it (in place)."""
    reply = _ask(layout)
    if reply is None:
        return waiting
    seen = json.loads(reply.get("json", "{}"))
    holders = seen.get("holders", {})
    for device in devices:
        named = holders.get(device["uuid"])
        holder = device.get("holder")
        if named is not None and holder is not None and holder.get("pid") is None and named["user"] != "?":
            device["holder"] = dict(holder, pid=named["pid"], user=named["user"], program=named["program"],
                                    command=named["program"], since=named["since"])
    return seen.get("waiting", waiting)


def service_waiters(layout: Layout) -> Dict[int, int]:
    """pid -> uid of each run waiting in the service (none without a service)."""
    reply = _ask(layout)
    out: Dict[int, int] = {}
    for item in (reply or {}).get("service_pids", "").split(","):
        pid, _sep, uid = item.partition(":")
        if pid.isdigit() and uid.isdigit():
            out[int(pid)] = int(uid)
    return out


def cancel(layout: Layout, pids: List[int]) -> None:
    from ..launch import client

    client.question(str(layout.root), wire.CANCEL, {"pids": ",".join(str(p) for p in pids)})
