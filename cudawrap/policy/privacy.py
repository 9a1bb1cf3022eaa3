"""[service] private_status: what an ordinary user sees of other users' runs.

With it on, a user sees another user's leases, shares, waits and processes (foreign work
and leftovers included) only as busy devices and counts: no pid, user, command, program or
queue key of theirs. Root sees everything; a user sees their own runs whole. One rule for
every way out: status (table and --json) daemonless and through the service, the service's
raw answers (hidden there, by the uid the kernel gives for the connection), `why`, and the
files the monitor leaves for users (health.state gets a public copy without the people in
it; memory.json and the metrics file are root's alone).

Daemonless, a user's own look at /proc may name more than status shows (unless /proc is
mounted hidepid=invisible): this hides what cudawrap says, as SECURITY.md explains.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

HIDDEN = "?"


def private(root: str) -> bool:
    """Whether [service] private_status is on; a config that cannot be read hides (the
    shims and `cudawrap config` say what is wrong with it)."""
    from pathlib import Path

    from .. import locations as loc
    from ..errors import CudawrapError
    from .config import load_config

    try:
        return bool(load_config(Path(root) / loc.CONFIG_FILE)["private_status"])
    except (CudawrapError, OSError):
        return True


def hidden_from(root: str, uid: int) -> Optional[str]:
    """UID's user name where others' runs are hidden from UID, else None (root, or off)."""
    from ..base.users import user_name

    return user_name(uid) if uid != 0 and private(root) else None


def _person(row: Dict[str, Any], me: str) -> Dict[str, Any]:
    """ROW (a holder, sharer or process) as ME may see it: whole if ME's, else its kind only."""
    if row.get("user") == me and row.get("pid") is not None:
        return row
    kept = {k: row[k] for k in ("lease", "lease_holder") if k in row}
    return dict({"pid": None, "user": HIDDEN, "command": HIDDEN, "program": HIDDEN, "since": HIDDEN}, **kept)


def waiter(row: Dict[str, Any], me: str) -> Dict[str, Any]:
    """A waiting run's row as ME may see it: another user's without who, what or its key
    (the key holds the pid); its place, size, reason and devices stay."""
    if row.get("user") == me and row.get("pid") is not None:
        return row
    return dict(row, key=HIDDEN, user=HIDDEN, pid=None, program=HIDDEN)


def redact(status: Dict[str, Any], me: str, own_pids: Any = ()) -> None:
    """STATUS (ops.status.machine_status) as ME may see it, in place. OWN_PIDS: those of
    each device's foreign pids that are ME's (the caller reads their owners)."""
    status["waiting"] = [waiter(w, me) for w in status.get("waiting", [])]
    for device in status.get("devices", []):
        holder = device.get("holder")
        if holder is not None:
            device["holder"] = _person(holder, me)
        shares = device.get("shares")
        if shares:
            device["shares"] = dict(shares, holders=[_person(h, me) for h in shares["holders"]])
        for key in ("slots_apart", "mps_without_share"):
            device[key] = [_person(h, me) for h in device.get(key) or []]
        if device.get("processes") is not None:
            device["processes"] = [p if p.get("user") == me else dict(_person(p, me), memory_mib=None)
                                   for p in device["processes"]]
        foreign = device.get("foreign_pids")
        if foreign is not None:
            mine = [p for p in foreign if p in own_pids]
            device["foreign_pids"] = mine
            device["foreign_hidden"] = len(foreign) - len(mine)
        idle = device.get("idle")
        if idle and idle.get("user") != me:
            device["idle"] = dict(idle, pid=None, user=HIDDEN)
        device["waiters"] = [w["pid"] for w in status["waiting"]
                             if w["candidates"] is None or device["uuid"] in w["candidates"]]


def leftover_text(left: Any, me: Optional[str]) -> str:
    """A leftover (leftovers.Leftover) in words, as ME may see it (None: whole)."""
    if me is None or left.user == me:
        return str(left.describe())
    import time

    when = time.strftime("%H:%M", time.localtime(left.ended)) if left.ended else "?"
    return f"leftover: another user's process (ended {when})"


def public_leftovers(rows: List[Any]) -> List[Any]:
    """The monitor's leftover tuples (leftovers.Leftover.to_tuple) for everyone's copy: the
    device, when its run ended and when first seen stay; pid, user, program and start go."""
    return [(0, r[1], HIDDEN, HIDDEN, r[4], 0, r[6]) for r in rows]


def public_idle(rows: Dict[str, Any]) -> Dict[str, Any]:
    """The monitor's idle tuples (idle.Lease.to_tuple) for everyone's copy, without holder."""
    return {u: (0, HIDDEN, *t[2:]) for u, t in rows.items()}
