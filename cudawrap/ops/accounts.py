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
# What a grant's record needs that does not change between grants, kept between them: the
# service records a grant before its descriptors leave, so every read here is a hand-over's.
# (Not the ledger's state: other processes replace it, and a file replaced within one tick of
# the clock by one of the same size, on a reused inode, looks unchanged.)
_kept: Dict[str, Any] = {}


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


def _signature(path: Path) -> Optional[Tuple[int, int, int, int]]:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _limits(layout: Layout) -> Tuple[int, int]:
    """[ledger] max_mib and keep, parsed again only when the configuration file changed."""
    from ..policy.config import load_config
    from ..errors import CudawrapError

    sig = (str(layout.config_file), _signature(layout.config_file))
    if _kept.get("limits_of") == sig:
        return _kept["limits"]
    try:
        config = load_config(layout.config_file)
        limits = (config["max_mib"] << 20, config["keep"])
    except CudawrapError:  # a broken config: the defaults, rather than a lost record
        limits = (64 << 20, 4)
    _kept.update(limits_of=sig, limits=limits)
    return limits


def _boot() -> str:
    if "boot" not in _kept:
        _kept["boot"] = ledger.boot_id()
    return _kept["boot"]


def grant(layout: Layout, pid: int, uid: int, devices: List[str], program: str, asked: float,
          shared: Optional[float] = None) -> Optional[str]:
    """Record the grant of DEVICES to PID (asked at ASKED, time.time()); its lease id, or
    None when PID is gone already (nothing is sent to it then). SHARED: a grant of shares,
    and what it counts as, in devices (as a look records a share: ledger._grant)."""
    p = ledger.proc(pid)
    if p is None:
        return None
    now = time.time()
    boot = _boot()
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
