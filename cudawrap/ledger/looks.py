"""The ledger: every lease granted and ended, recorded by root from what the kernel shows.

A wrapped run is an ordinary user: it cannot append to a file only root may write, and
nothing a user can write is taken as a fact here. So root observes and records: who holds
a lease comes from the kernel (flock holders in /proc/locks), the holder's uid, start time
and command line from /proc. The monitor looks every cycle (half a second), so a grant or
an end is known to within a cycle (while the service runs, which records its own grants
exactly, only where there is something to record: quiet()); without it, whichever root command next looks
(`cudawrap status`, `usage`, `sync` run by root) records what changed since the last look,
and every time is stored with the interval it is sure of (``*_lo``, ``*_hi``).

Records are JSON lines, appended with one write(2) on an O_APPEND descriptor under a lock,
then fsync'd; a write cut short (a full disk) is cut back off, so a failure loses nothing
already written and the records are written again at the next look. The file is rotated at
``[ledger] max_mib`` keeping ``keep`` old files, mode 0600. Each user's finished leases are
also appended to ``usage/UID``, readable by that user's private group only, so users can
see their own usage and nobody else's.

Besides leases (``grant``, ``end``: each with an ``id``) the monitor records what it did and
saw about the GPUs' health (NOTES: ``health-drain``, ``health-resume``, ``leftover``,
``leftover-killed``, ``idle``: each with a ``device`` and a time ``at``). A reader names the
kinds it wants; the others are passed over in silence, so a ledger written before notes
existed reads as it did, and a lease reader never sees a note.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ..base.rootfile import private_tmp
from ..lease.files import lock_table
from ..lease.holders import holdings, takers
from ..paths import Layout
from ..base.users import user_name
from .files import RECORD_VERSION, STATE, Locked, append, append_user_view, ledger_path, read
from .processes import Proc, boot_id, boot_time, proc


def _estimate(lo: float, hi: float, anchor: Optional[float] = None) -> float:
    """A time known to lie in [LO, HI]: ANCHOR if it does (a process's own start), else the middle."""
    if anchor is not None and lo <= anchor <= hi:
        return anchor
    return (lo + hi) / 2


def _share_costs(layout: Layout) -> Callable[[str], float]:
    """What a share of a device counts as ([sharing] counts_as, or 1/slots), by UUID."""
    from ..lease.sharing import configured

    try:
        sharing = configured(str(layout.root))
    except Exception:  # a broken config: count the device whole rather than lose the record
        return lambda uuid: 1.0
    return lambda uuid: sharing.cost(sharing.slots_for(uuid))


def lease_id(boot: str, pid: int, ticks: int, devices: Sequence[str]) -> str:
    """A lease's id: this boot, its client's pid and start ticks, a digest of its devices (unique per grant)."""
    digest = hashlib.sha1(",".join(devices).encode()).hexdigest()[:8]
    return f"{boot[:8]}-{pid}-{ticks}-{digest}"


# --- observing -------------------------------------------------------------------------------


@dataclass
class Observation:
    """What one look found: records written, waits that ended without a grant, who waits now."""

    grants: List[Dict[str, Any]] = field(default_factory=list)
    ends: List[Dict[str, Any]] = field(default_factory=list)
    abandoned: int = 0  # waits that ended without a grant (time limit, Ctrl-C, cancel, kill)
    waiting: Dict[int, int] = field(default_factory=dict)  # uid -> runs waiting now
    open: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # lease id -> its grant record
    error: Optional[str] = None  # why the ledger could not be written (kept for the next look)


def load_state(path: Path) -> Dict[str, Any]:
    """The ledger's state (the leases open, the runs waiting, the last look); a fresh one
    where it is missing or of another version."""
    try:
        data = json.loads(path.read_bytes())
        if isinstance(data, dict) and data.get("version") == RECORD_VERSION:
            return data
    except (OSError, ValueError):
        pass
    return {"version": RECORD_VERSION, "boot": "", "looked": None, "open": {}, "waiting": {}}


def save_state(path: Path, state: Dict[str, Any]) -> None:
    """STATE written whole in place of PATH's (write_state)."""
    write_state(path, json.dumps(state).encode())


def write_state(path: Path, text: bytes) -> None:
    """TEXT as PATH's new content, written beside it and renamed over it, root's alone
    (0600): a reader sees the old state or the new, never a part."""
    tmp = path.with_name("." + private_tmp(path.name))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def service_running(layout: Layout) -> bool:
    """Whether a service holds its lock now (the kernel's word; see service/loop.py)."""
    from .. import locations as loc
    from ..base.daemon import running

    return running(loc.under(str(layout.root), loc.SERVICE_LOCK)) is not None


@dataclass
class _Look:
    """What one look at the leases goes by: who looks, when, this boot, and since when a lease
    first seen now may have been granted (the last look, or the boot if later)."""

    layout: Layout
    seen_by: str
    now: float
    boot: str
    since: float
    _share_cost: Optional[Callable[[str], float]] = None

    def share_cost(self) -> Callable[[str], float]:
        """What a share of a device counts as: the config read once a look, and only for shares."""
        if self._share_cost is None:
            self._share_cost = _share_costs(self.layout)
        return self._share_cost


def observe(layout: Layout, seen_by: str = "monitor", limits: Tuple[int, int] = (64 << 20, 4),
            unless_quiet: bool = False) -> Observation:
    """Compare the leases held now with the last look; record grants and ends (root only).

    LIMITS: (max bytes of a ledger file, rotated files kept). UNLESS_QUIET (the monitor's
    look, every half second): nothing is done, and the ledger's lock not taken, where the
    look would record nothing (quiet()); the Observation then only names the leases open.
    """
    obs = Observation()
    state_path = layout.state_dir / STATE
    # The lock table read once before the lock: the kernel makes a read that follows none a
    # moment before wait ~8 ms (the _known docstring in service/waitline.py), and the read under the
    # lock then takes ~0.05 ms. The service's grant waits for this lock: a look held it ~8 ms
    # every half second, so a hand-over met it now and then.
    table = lock_table()
    if unless_quiet:
        kept = quiet(layout, table)
        if kept is not None:
            obs.open = kept["open"]
            return obs
    with Locked(layout):
        state = load_state(state_path)
        now = time.time()
        boot = boot_id()
        opened, waiting, since = _since_last_look(state, obs, boot, boot_time(), now, seen_by)
        look = _Look(layout, seen_by, now, boot, since)
        current = _leases(look, opened, waiting, obs)
        now_waiting = _waits(look, waiting, obs)
        obs.open = current
        if not _append_records(layout, obs, limits):
            return obs  # the state is left as it was: the next look records all of it
        state.update(boot=boot, looked=now, open=current, waiting=now_waiting)
        try:
            save_state(state_path, state)
        except OSError as exc:
            obs.error = f"cannot write {state_path}: {exc.strerror}"
    return obs


# While the service runs it records every lease it grants, exactly (service/bookkeeping.py), and
# the monitor's look, every half second, mostly finds nothing to record; yet each held the
# ledger's lock for 2-7 ms (its reads of /proc, cold, and the state's rewrite), and a grant
# waits for that lock: in one burst of bench/service.py three hand-overs of 43 took 7-11 ms
# behind it (ftrace, 2026-11-28). So the monitor first asks, without the lock, whether a look
# could record anything; and looks in full at least every QUIET_MAX_S all the same, which
# bounds how old its times can grow ("looked", from which a lease first seen next is dated,
# and each open lease's "seen", from which its end is dated if the service dies meanwhile).
QUIET_MAX_S = 10.0


def quiet(layout: Layout, table: Dict[Tuple[int, int], List[Tuple[int, bool]]],
          now: Optional[float] = None) -> Optional[Dict[str, Any]]:
    """The ledger's state where a look now would record nothing, and change nothing but its
    own time; None where it might. By the state (read without its lock: it is replaced whole,
    by a rename) and TABLE (the kernel's lock table): the service runs (asked first, so that
    a monitor without it reads nothing more each pass); every lease open in the state is one
    it granted; the lock on each lease file held was taken by the client of one of those
    grants, for that device; no run waits in the queue directory, and none did at the last
    look; and that look, in full, is younger than QUIET_MAX_S. Anything else (a lease taken
    past the service, a child holding a lease its client left, a queue entry, a restart) is
    a full look's to record. Read a moment apart, the state and the table can only disagree
    the other way: then the full look, under the lock, decides."""
    if not service_running(layout):
        return None
    state = load_state(layout.state_dir / STATE)
    now = time.time() if now is None else now
    looked = state.get("looked")
    if state.get("boot") != boot_id() or state.get("waiting") or not isinstance(looked, (int, float)) \
            or not 0 <= now - looked < QUIET_MAX_S:
        return None
    served: Dict[int, Set[str]] = {}
    for record in state.get("open", {}).values():
        if record.get("seen_by") != "service":
            return None
        served.setdefault(record.get("pid"), set()).update(record.get("devices", ()))
    for uuid, pids in takers(str(layout.lease_dir), table).items():
        if any(uuid not in served.get(pid, ()) for pid in pids):
            return None
    try:
        if os.listdir(layout.queue_dir):
            return None
    except FileNotFoundError:
        pass
    except OSError:
        return None
    return state


def _since_last_look(state: Dict[str, Any], obs: Observation, boot: str, booted: float, now: float,
                     seen_by: str) -> Tuple[Dict[str, Dict[str, Any]], Dict[str, Dict[str, Any]], float]:
    """The leases open and the runs waiting at the last look, and since when this look is sure
    of nothing: the last look, or the boot if later. After a restart nothing is open (each
    lease then open is an end in OBS) or waiting."""
    looked: Optional[float] = state["looked"]
    opened: Dict[str, Dict[str, Any]] = state["open"]
    waiting: Dict[str, Dict[str, Any]] = state["waiting"]
    if state["boot"] != boot:
        # Restarted since the last look: whatever was held then ended before this boot.
        for record in opened.values():
            obs.ends.append(end_record(record, record["seen"], max(record["seen"], booted), now,
                                 "ended (the machine restarted)", seen_by))
        opened, waiting, looked = {}, {}, None
    return opened, waiting, max(looked if looked is not None else booted, booted)


def _held_by_pid(layout: Layout) -> Tuple[Dict[int, List[str]], Set[int]]:
    """pid -> the devices it holds a lease on (each sharer, or the holder), and the sharers."""
    by_pid: Dict[int, List[str]] = {}
    shared: Set[int] = set()
    for uuid, holding in holdings(str(layout.lease_dir)).items():
        for pid in holding.pids if not holding.exclusive else [holding.pid]:  # each sharer, or the holder
            by_pid.setdefault(pid, []).append(uuid)  # type: ignore[arg-type]
            if not holding.exclusive:
                shared.add(pid)  # type: ignore[arg-type]
    return by_pid, shared


def _leases(look: _Look, opened: Dict[str, Dict[str, Any]], waiting: Dict[str, Dict[str, Any]],
            obs: Observation) -> Dict[str, Dict[str, Any]]:
    """The leases held now by id: OPENED's still held, and the new ones, each a grant in OBS
    (its wait taken out of WAITING); each of OPENED no longer held is an end in OBS."""
    by_pid, shared = _held_by_pid(look.layout)
    current: Dict[str, Dict[str, Any]] = {}
    # While the service runs, what it granted is its own to record (service/bookkeeping.py).
    served = [r for r in opened.values() if r.get("seen_by") == "service"]
    serving = bool(served) and service_running(look.layout)
    handed: Optional[Dict[str, Set[int]]] = None  # read once a holder unknown to the ledger needs it
    for pid, devices in by_pid.items():
        devices.sort()
        p = proc(pid, devices)
        known = next((i for i, r in opened.items() if r["pid"] == pid and r["devices"] == devices
                      and (p is None or r["ticks"] == p.ticks)), None)
        if known is not None:
            current[known] = dict(opened[known], seen=look.now)
            continue
        if p is None:
            continue  # gone between the two looks at /proc: seen at the next look, if still held
        if serving:
            handed = _handed(served) if handed is None else handed
            if all(p.uid in handed.get(u, ()) for u in devices):
                continue
        record = _grant(look, p, devices, pid in shared, waiting.pop(str(pid), None))
        current[record["id"]] = record
        obs.grants.append(record)
    for lid, record in opened.items():
        if lid not in current and record.get("seen_by") == "service":
            if serving:
                # The service records its grants' ends exactly, and a grant's lock appears
                # only once the client takes it: while it runs, its records are its own.
                current[lid] = record
                continue
        if lid not in current:
            p = proc(record["pid"])
            how = ("released while its process still runs" if p is not None and p.ticks == record["ticks"]
                   else "ended")
            obs.ends.append(end_record(record, record["seen"], look.now, look.now, how, look.seen_by))
    return current


def _handed(served: List[Dict[str, Any]]) -> Dict[str, Set[int]]:
    """uuid -> the users of SERVED (the service's open grants) whose client is gone: a child it
    handed the descriptors to holds them now, which is no new lease."""
    handed: Dict[str, Set[int]] = {}
    for r in served:
        client = proc(r["pid"])
        if client is None or client.ticks != r["ticks"]:
            for u in r["devices"]:
                handed.setdefault(u, set()).add(r["uid"])
    return handed


def _grant(look: _Look, p: Proc, devices: List[str], shared: bool,
           seen_wait: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The grant record of P's lease of DEVICES, first seen by this look (SEEN_WAIT: its wait
    as the last look saw it, if it did)."""
    lo = max(look.since, p.started)
    start = _estimate(lo, look.now, p.started)
    record: Dict[str, Any] = {
        "v": RECORD_VERSION, "event": "grant", "id": lease_id(look.boot, p.pid, p.ticks, devices), "uid": p.uid,
        "user": user_name(p.uid), "pid": p.pid, "ticks": p.ticks, "program": p.program, "exe": p.exe,
        "devices": devices, "start": round(start, 3), "start_lo": round(lo, 3), "start_hi": round(look.now, 3),
        "seen_by": look.seen_by, "seen": look.now}
    if shared:
        # A share of its device(s): it counts as what its user's limit counts it.
        record["shared"] = True
        share_cost = look.share_cost()
        record["devices_held"] = round(sum(share_cost(u) for u in devices), 4)
    # The wait: from the run's start (the shim starts the run) to its grant, as sure as the grant.
    record["wait_s"] = round(max(start - p.started, 0.0), 3)
    if seen_wait is not None and seen_wait.get("enqueued") is not None:
        # From the queue entry's name: the run's own claim, kept apart as a hint.
        record["wait_hint_s"] = round(max(start - seen_wait["enqueued"], 0.0), 3)
    return record


def _waits(look: _Look, waiting: Dict[str, Dict[str, Any]], obs: Observation) -> Dict[str, Dict[str, Any]]:
    """The runs waiting now (pid -> when it began, as sure as the looks are, and its claim),
    from the kernel's record of who holds each queue entry's lock; OBS counts them by user,
    and the waits of WAITING that ended without a grant."""
    from ..sched.waiters import waiters

    mono, wall = time.monotonic(), time.time()
    now_waiting: Dict[str, Dict[str, Any]] = {}
    for w in waiters(str(look.layout.root)):
        obs.waiting[w.uid] = obs.waiting.get(w.uid, 0) + 1
        old = waiting.get(str(w.pid))
        if old is None:
            p = proc(w.pid)
            lo = max(look.since, p.started) if p is not None else look.since
            key = w.key[:20]
            enqueued = wall - (mono - int(key) / 1e9) if key.isdigit() else None
            old = {"lo": lo, "hi": look.now, "uid": w.uid, "enqueued": enqueued}
        now_waiting[str(w.pid)] = old
    obs.abandoned = sum(1 for pid in waiting if pid not in now_waiting)
    return now_waiting


def _append_records(layout: Layout, obs: Observation, limits: Tuple[int, int]) -> bool:
    """OBS's grants and ends into the ledger, and each end into its user's view; False where
    the ledger cannot take them (why in OBS.error, and OBS keeps none of them)."""
    try:
        append(ledger_path(layout), obs.grants + obs.ends, *limits)
    except OSError as exc:
        obs.error = f"cannot write the ledger {ledger_path(layout)}: {exc.strerror or exc}"
        obs.grants, obs.ends = [], []
        return False
    for record in obs.ends:
        append_user_view(layout, record, limits)
    return True


def end_record(grant: Dict[str, Any], lo: float, hi: float, now: float, how: str, seen_by: str) -> Dict[str, Any]:
    """The end record: self-contained (the grant's facts too), so a user's view needs no grants."""
    record = {k: v for k, v in grant.items() if k not in ("seen", "seen_by", "memory_at", "memory_ended")}
    if grant.get("memory_ended"):
        how = grant["memory_ended"]  # ended for its memory (memwatch): the one line saying who and why
    end = _estimate(lo, hi)
    record.update(event="end", end=round(end, 3), end_lo=round(lo, 3), end_hi=round(hi, 3), how=how,
                  seen_by=seen_by)
    return record


def look(layout: Layout, seen_by: str) -> Optional[Observation]:
    """A root command's look without the monitor: record what changed (the problem in .error).

    None where this process may not write the ledger (an ordinary user).
    """
    from ..policy.config import load_config
    from ..errors import CudawrapError
    from ..base.privilege import is_admin

    if not is_admin(layout) or not layout.state_dir.is_dir():
        return None
    try:
        config = load_config(layout.config_file)
        limits = (config["max_mib"] << 20, config["keep"])
    except CudawrapError:
        limits = (64 << 20, 4)
    try:
        return observe(layout, seen_by, limits)
    except OSError as exc:
        return Observation(error=f"cannot record leases in {layout.state_dir}: {exc.strerror or exc}")
