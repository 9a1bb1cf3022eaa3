"""`cudawrap health`: each GPU's health as the monitor last recorded it, for any user."""
from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping

from .rule import clock
from .state import leftovers, load
from ..policy.privacy import hidden_from


def report(root: str, now: float) -> Dict[str, Any]:
    """Each GPU's health as the monitor last recorded it, for `cudawrap health` (any user)."""
    from ..devices import invcache
    from ..sched.drains import drained

    gpus, back, written = load(root)
    inventory = invcache.read(root)
    index = {g.uuid: g.index for g in inventory.gpus} if inventory is not None else {}
    drains = drained(root)
    left = leftovers(root, hidden_from(root, os.geteuid()))  # [service] private_status: others' unnamed
    parents = _parents(inventory)
    rows = []
    for uuid, gpu in sorted(gpus.items(), key=lambda kv: (index.get(kv[0], 1 << 20), kv[0])):
        admin = drains.get(uuid)
        rows.append({
            "uuid": uuid, "index": index.get(uuid), "state": gpu.state, "reason": gpu.reason,
            "since": gpu.since, "condition": gpu.condition, "notes": gpu.notes,
            "back": back.get(uuid, ""),
            "admin_drain": admin.reason if admin is not None and admin.kind != "health" else None,
            "events": [{"at": at, "what": what, "drains": d} for at, what, d in gpu.events],
            "leftovers": [text for u, texts in left.items() if uuid in (u, parents.get(u)) for text in texts],
        })
    return {"written": written, "age_s": now - written if written else None, "gpus": rows}


def _parents(inventory: Any) -> Dict[str, str]:
    return {d.uuid: d.parent_uuid for d in inventory.devices} if inventory is not None else {}


def render(data: Mapping[str, Any]) -> List[str]:
    """`cudawrap health` as text lines."""
    if not data["gpus"]:
        return ["no GPU health recorded: the monitor (`cudawrap monitor`, root) records it every cycle"]
    lines: List[str] = []
    if data["age_s"] is not None and data["age_s"] > 30:
        lines.append(f"note: recorded {data['age_s']:.0f} s ago: is the monitor running?")
    for row in data["gpus"]:
        name = f"GPU {row['index']}" if row["index"] is not None else "GPU"
        state = row["state"].upper()
        lines.append(f"{name} {row['uuid']}: {state}" + (f" ({row['reason']})" if row["reason"] else ""))
        if row["condition"]:
            lines.append(f"  now: {row['condition']}")
        if row["back"]:
            lines.append(f"  back: {row['back']}")
        if row["admin_drain"] is not None:
            lines.append(f"  also drained by an admin ({row['admin_drain']}): `cudawrap resume` lifts that")
        if row["notes"]:
            lines.append(f"  note: {row['notes']}")
        lines += [f"  {text}" for text in row["leftovers"]]
        for event in row["events"][-5:]:
            effect = "drains" if event["drains"] else "changes nothing"
            lines.append(f"  {clock(event['at'])} {event['what']}: {effect}")
    return lines
