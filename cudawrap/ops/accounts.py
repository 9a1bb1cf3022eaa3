"""The ledger, written by the service at the moment a grant is made and when it ends.

The record is in the file (the page cache) before the descriptors leave, which a crash of
the service cannot lose; the fsync that makes it survive a crash of the machine (which
ends every lease anyway) is left to flush(), which the service calls once it is idle, so
the disk's latency is not a launch's.

Records have the daemonless ledger's shape (ledger.observe) with exact times
(``start_lo == start_hi``, ``end_lo == end_hi``) and ``seen_by = "service"``. Each grant
is written before its descriptors are sent (a crash between the two loses no record) and
entered in the ledger's state as open, so a root command's later look (status, usage, the
monitor) knows it already; its end is written only while the state still has it open, so
neither side records a lease twice.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from . import ledger, ledgerfile
from ..paths import Layout
from ..users import user_name


_unsynced: "set[Path]" = set()  # ledger files written since their last fsync


def pending() -> bool:
    return bool(_unsynced)


def flush() -> None:
    """Make what was recorded durable (one fsync per file written since the last flush)."""
    import os

    while _unsynced:
        path = _unsynced.pop()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # rotated away meanwhile: rotation renames, the data is in the new name
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _limits(layout: Layout) -> Tuple[int, int]:
    from ..policy.config import load_config
    from ..errors import CudawrapError

    try:
        config = load_config(layout.config_file)
        return config["max_mib"] << 20, config["keep"]
    except CudawrapError:  # a broken config: the defaults, rather than a lost record
        return 64 << 20, 4


def grant(layout: Layout, pid: int, uid: int, devices: List[str], program: str, asked: float,
          shared: Optional[float] = None) -> Optional[str]:
    """Record the grant of DEVICES to PID (asked at ASKED, time.time()); its lease id, or
    None when PID is gone already (nothing is sent to it then). SHARED: a grant of shares,
    and what it counts as, in devices (as a look records a share: ledger._grant)."""
    p = ledger.proc(pid)
    if p is None:
        return None
    now = time.time()
    boot = ledger.boot_id()
    lid = ledger._lease_id(boot, pid, p.ticks, sorted(devices))
    record: Dict[str, Any] = {
        "v": ledgerfile.RECORD_VERSION, "event": "grant", "id": lid, "uid": uid, "user": user_name(uid),
        "pid": pid, "ticks": p.ticks, "program": program.rsplit("/", 1)[-1] or p.program, "exe": p.exe,
        "devices": sorted(devices), "start": round(now, 3), "start_lo": round(now, 3), "start_hi": round(now, 3),
        "seen_by": "service", "seen": now, "wait_s": round(max(now - asked, 0.0), 3)}
    if shared is not None:
        record["shared"] = True
        record["devices_held"] = round(shared, 4)
    limits = _limits(layout)
    path = layout.state_dir / ledgerfile.STATE
    with ledgerfile.Locked(layout):
        state = ledger._load_state(path)
        if state["boot"] not in ("", boot):
            return lid  # a look after the restart records it (and ends what the old boot held)
        ledgerfile.append(ledgerfile.ledger_path(layout), [record], *limits, durable=False)
        _unsynced.add(ledgerfile.ledger_path(layout))
        state["boot"] = boot
        state["open"][lid] = record
        ledger._save_state(path, state)
    return lid


def end(layout: Layout, lid: str, how: str = "ended") -> None:
    """Record the end of lease LID now, unless a look recorded it already."""
    now = time.time()
    limits = _limits(layout)
    path = layout.state_dir / ledgerfile.STATE
    with ledgerfile.Locked(layout):
        state = ledger._load_state(path)
        record = state["open"].pop(lid, None)
        if record is None:
            return
        done = ledger._end(record, now, now, now, how, "service")
        ledgerfile.append(ledgerfile.ledger_path(layout), [done], *limits, durable=False)
        _unsynced.add(ledgerfile.ledger_path(layout))
        ledger._save_state(path, state)
    ledger._append_user_view(layout, done, limits)


def still_open(layout: Layout) -> List[Dict[str, Any]]:
    """The grants a service recorded that no end has closed yet (for a restarted service)."""
    path = layout.state_dir / ledgerfile.STATE
    with ledgerfile.Locked(layout):
        state = ledger._load_state(path)
    if state["boot"] != ledger.boot_id():
        return []
    return [r for r in state["open"].values() if r.get("seen_by") == "service"]
