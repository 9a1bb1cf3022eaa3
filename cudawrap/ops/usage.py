"""`cudawrap usage`: device time, runs and waits from the ledger, grouped and summed.

Root reads the ledger itself (and counts leases still held up to now); an ordinary user
reads the copy of their own finished leases that root keeps for them (ledger/looks.py), so each
user sees their own rows only. Everything here but reading files is pure.
"""
from __future__ import annotations

import datetime as dt
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..ledger import looks as ledger, files as ledgerfile
from ..errors import NotPermitted, StateError, UsageError
from ..paths import Layout

GROUPS = ("user", "program", "device", "day")
_AGE = re.compile(r"(\d{1,6})([smhdw])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_when(text: str, now: float, switch: str) -> float:
    """An age (7d, 12h, 30m, 2w), today, a month (2026-11), a date or a date and time (local)."""
    value = text.strip().lower()
    match = _AGE.fullmatch(value)
    if match:
        return now - int(match.group(1)) * _UNIT_S[match.group(2)]
    if value in ("now", "today"):
        return now if value == "now" else dt.datetime.combine(dt.date.fromtimestamp(now), dt.time()).timestamp()
    for fmt in ("%Y-%m", "%Y-%m-%d", "%Y-%m-%dT%H:%M", "%Y-%m-%d %H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S"):
        try:
            return dt.datetime.strptime(value.upper() if "t" in value else value, fmt).timestamp()
        except ValueError:
            continue
    shown = "".join(c if c.isprintable() else "?" for c in text[:40])
    raise UsageError(f"{switch} {shown!r}: not a date (YYYY-MM-DD[THH:MM]), a month (YYYY-MM) or an age (7d, 12h)",
                     hint="e.g. --since 7d, --since 2026-11 --until 2026-12")


def month_start(now: float) -> float:
    today = dt.date.fromtimestamp(now)
    return dt.datetime(today.year, today.month, 1).timestamp()


@dataclass(frozen=True)
class Lease:
    user: str
    program: str
    devices: Tuple[str, ...]
    start: float
    end: float
    wait_s: Optional[float]
    running: bool  # still held: counted up to now
    uncertainty_s: float  # how far start and end may be off, together (the ledger's intervals)
    held: float = 0.0  # devices it counts as: all of them, or a share's part (0: len(devices))
    memory_peak_mib: Optional[int] = None  # the most its processes used at once, summed (memwatch)
    memory_mib_s: float = 0.0  # memory used over time, MiB-seconds (memwatch)

    @property
    def weight(self) -> float:
        return self.held or len(self.devices)


def _lease(record: Dict[str, Any], end: Optional[float]) -> Optional[Lease]:
    try:
        start = float(record["start"])
        stop = float(record["end"]) if end is None else end
        wait = record.get("wait_s")
        spread = (float(record.get("start_hi", start)) - float(record.get("start_lo", start))) / 2
        if end is None:
            spread += (float(record.get("end_hi", stop)) - float(record.get("end_lo", stop))) / 2
        return Lease(str(record.get("user", "?")), str(record.get("program", "?")),
                     tuple(str(d) for d in record["devices"]), start, max(stop, start),
                     float(wait) if isinstance(wait, (int, float)) else None, end is not None, spread,
                     float(record.get("devices_held", 0.0)), _peak(record),
                     float(record.get("memory_mib_s", 0.0)))
    except (KeyError, TypeError, ValueError):
        return None


def _peak(record: Dict[str, Any]) -> Optional[int]:
    peak = record.get("memory_peak_mib")
    return int(peak) if isinstance(peak, (int, float)) else None


def leases(records: Iterable[Dict[str, Any]], open_ids: Iterable[str], now: float,
           problems: List[str]) -> List[Lease]:
    """Leases from ledger records: each end once; a grant without an end if still held (OPEN_IDS)."""
    grants: Dict[str, Dict[str, Any]] = {}
    ended: Dict[str, Lease] = {}
    for record in records:
        if record["event"] == "grant":
            grants.setdefault(record["id"], record)
        elif record["event"] == "end" and record["id"] not in ended:
            lease = _lease(record, None)
            if lease is None:
                problems.append(f"end record {record['id']!r} lacks a field: skipped")
            else:
                ended[record["id"]] = lease
    out = list(ended.values())
    open_ids = set(open_ids)
    unknown = 0
    for lid, grant in grants.items():
        if lid in ended:
            continue
        if lid in open_ids:
            lease = _lease(grant, now)
            if lease is not None:
                out.append(lease)
        else:
            unknown += 1
    if unknown:
        problems.append(f"{unknown} lease(s) with a grant but no recorded end (nobody has looked since): "
                        "left out; run `sudo cudawrap usage` again once the monitor or a root command looked")
    return out


@dataclass(frozen=True)
class Idle:
    """A spell in which a held device was flagged idle ([health] idle_after_min): the ledger's
    ``idle`` notes, and the spells going on now as the monitor last sampled them."""

    user: str
    program: str
    device: str
    start: float
    end: float


def idle_spells(records: Iterable[Dict[str, Any]]) -> List[Idle]:
    out = []
    for r in records:
        if r["event"] == "idle" and isinstance(r.get("start"), (int, float)) and isinstance(r.get("end"), (int, float)):
            out.append(Idle(str(r.get("user", "?")), str(r.get("program", "?")), r["device"], float(r["start"]),
                            max(float(r["end"]), float(r["start"]))))
    return out


def idle_now(root: str, user: Optional[str]) -> List[Idle]:
    """The spells flagged idle now (the monitor's last sample), USER's only unless None."""
    from ..health.state import idle_leases

    quiet, after_s, sampled = idle_leases(root)
    return [Idle(x.user, "?", uuid, x.quiet_since, sampled) for uuid, x in quiet.items()
            if x.idle_s(sampled) >= after_s > 0 and (user is None or x.user == user)]


def _days(start: float, end: float) -> Iterable[Tuple[str, float, float]]:
    """(local day, from, to) pieces of [START, END)."""
    t = start
    while t < end:
        day = dt.date.fromtimestamp(t)
        nxt = dt.datetime.combine(day + dt.timedelta(days=1), dt.time()).timestamp()
        yield day.isoformat(), t, min(end, nxt)
        t = nxt


def p95(values: Sequence[float]) -> Optional[float]:
    """The 95th percentile by nearest rank (a value that occurred), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(math.ceil(0.95 * len(ordered)) - 1, 0)]


def _idle_seconds(spells: Iterable[Idle], by: str, since: float, until: float) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for x in spells:
        lo, hi = max(x.start, since), min(x.end, until)
        if by == "day":
            keyed = [(day, b - a) for day, a, b in _days(lo, hi)]
        else:
            keyed = [({"user": x.user, "program": x.program, "device": x.device}[by], hi - lo)]
        for key, value in keyed:
            if value > 0:
                out[key] = out.get(key, 0.0) + value
    return out


def summarize(items: Iterable[Lease], by: str, since: float, until: float,
              idle: Iterable[Idle] = ()) -> List[Dict[str, Any]]:
    """Rows of {BY, device_seconds, device_hours, runs, wait_mean_s, wait_p95_s, uncertainty_s,
    memory_gib_hours, memory_peak_gib (None where no run's memory was recorded),
    idle_device_hours (of IDLE's spells)}."""
    idle_s = _idle_seconds(idle, by, since, until)
    seconds: Dict[str, float] = {}
    mib_s: Dict[str, float] = {}
    peaks: Dict[str, int] = {}
    runs: Dict[str, int] = {}
    waits: Dict[str, List[float]] = {}
    spread: Dict[str, float] = {}
    for lease in items:
        lo, hi = max(lease.start, since), min(lease.end, until)
        if hi <= lo and not (since <= lease.start < until):
            continue
        if by == "day":
            pieces = [(day, a, b) for day, a, b in _days(lo, hi)] or [(dt.date.fromtimestamp(lo).isoformat(), lo, lo)]
            keyed = [(day, (b - a) * lease.weight) for day, a, b in pieces]
            first = dt.date.fromtimestamp(lease.start).isoformat() if lease.start >= since else keyed[0][0]
        elif by == "device":
            keyed = [(d, hi - lo) for d in lease.devices]
            first = None
        else:
            key = lease.user if by == "user" else lease.program
            keyed = [(key, (hi - lo) * lease.weight)]
            first = key
        for key, value in keyed:
            seconds[key] = seconds.get(key, 0.0) + max(value, 0.0)
            if first is None or key == first:  # a run counts once, where (and when) it started
                runs[key] = runs.get(key, 0) + 1
                spread[key] = spread.get(key, 0.0) + lease.uncertainty_s * lease.weight
                if lease.wait_s is not None:
                    waits.setdefault(key, []).append(lease.wait_s)
                if lease.memory_peak_mib is not None:  # a run's memory counts once too
                    mib_s[key] = mib_s.get(key, 0.0) + lease.memory_mib_s
                    peaks[key] = max(peaks.get(key, 0), lease.memory_peak_mib)
    rows = []
    for key in sorted(set(seconds) | set(idle_s)):
        w = waits.get(key, [])
        seconds.setdefault(key, 0.0)
        rows.append({by: key, "device_seconds": round(seconds[key], 3), "device_hours": round(seconds[key] / 3600, 4),
                     "runs": runs.get(key, 0), "wait_mean_s": round(sum(w) / len(w), 3) if w else None,
                     "wait_p95_s": round(p95(w), 3) if w else None, "uncertainty_s": round(spread.get(key, 0.0), 3),
                     "memory_gib_hours": round(mib_s[key] / 1024 / 3600, 4) if key in peaks else None,
                     "memory_peak_gib": round(peaks[key] / 1024, 2) if key in peaks else None,
                     "idle_device_hours": round(idle_s.get(key, 0.0) / 3600, 4)})
    return rows


# --- reading what the caller may read -------------------------------------------------------


def _trusted(path: Path, owner: int) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return True  # nothing there yet is no harm
    return st.st_uid == owner and not st.st_mode & 0o002 and (st.st_mode & 0o170000) == 0o100000


def load(layout: Layout, keep: int, problems: List[str], now: Optional[float] = None,
         uid: Optional[int] = None) -> List[Lease]:
    """The leases the caller may see: all for root (and the install's owner), else UID's own."""
    return load_all(layout, keep, problems, now, uid)[0]


def load_all(layout: Layout, keep: int, problems: List[str], now: Optional[float] = None,
             uid: Optional[int] = None) -> Tuple[List[Lease], List[Idle]]:
    """The leases and idle spells the caller may see: all for root (and the install's
    owner), else UID's own (the spells going on now included)."""
    from ..base.privilege import is_admin
    from ..base.users import user_name

    kinds = (*ledgerfile.LEASES, "idle")

    now = time.time() if now is None else now
    uid = os.getuid() if uid is None else uid
    if is_admin(layout):
        path = ledgerfile.ledger_path(layout)
        if os.path.exists(path) and not os.access(path, os.R_OK):
            raise StateError(f"cannot read the ledger {path}: permission denied")
        obs = ledger.look(layout, "cudawrap usage")  # record what changed since the last look
        if obs is not None and obs.error:
            problems.append(f"{obs.error}; usage shows what was recorded before")
        open_ids: Iterable[str] = obs.open if obs is not None else ()
        try:
            records = list(ledgerfile.read(ledgerfile.rotated(path, keep), problems, kinds))
        except OSError as exc:
            raise StateError(f"cannot read the ledger {path}: {exc.strerror}") from None
        return leases(records, open_ids, now, problems), idle_spells(records) + idle_now(str(layout.root), None)
    path = ledgerfile.user_view_path(layout, uid)
    files = ledgerfile.rotated(path, keep)
    owner = os.stat(layout.state_dir).st_uid
    for f in files:
        if not _trusted(f, owner):
            raise StateError(f"{f} was not written by cudawrap (wrong owner or mode): not read",
                             hint="an admin checks it; `sudo cudawrap usage` reads the ledger itself")
    if not any(f.exists() for f in files):
        if ledgerfile.private_group(uid) is None:
            raise NotPermitted("your usage is kept in the ledger, which only root may read (you have no private "
                               "group for a copy of your own)", hint="ask an admin: sudo cudawrap usage --by user")
        return [], idle_now(str(layout.root), user_name(uid))
    try:
        records = list(ledgerfile.read(files, problems, kinds))
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror}") from None
    return leases(records, (), now, problems), idle_spells(records) + idle_now(str(layout.root), user_name(uid))


# --- the chart ----------------------------------------------------------------------------------


def plot(rows_by_user_day: Dict[str, Dict[str, float]], days: Sequence[str], path: str, title: str) -> None:
    """A stacked bar chart of device-hours: one bar per day, one colour per user (tab10, sorted)."""
    try:
        import matplotlib
    except ImportError:
        raise StateError("--plot needs matplotlib, which is not installed",
                         hint="install it into cudawrap's environment: sudo ./install.sh --with-plot "
                              "(or pip install 'cudawrap[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    users = sorted(rows_by_user_day)
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(days) + 2), 4.5), dpi=100)
    bottom = [0.0] * len(days)
    for i, user in enumerate(users):
        heights = [rows_by_user_day[user].get(day, 0.0) for day in days]
        ax.bar(days, heights, bottom=bottom, label=user, color=colours(i % 10), width=0.8)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("device-hours")
    ax.set_title(title)
    if users:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    ax.tick_params(axis="x", labelrotation=90, labelsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise StateError(f"cannot write {path}: {exc.strerror}") from None
    finally:
        plt.close(fig)


def user_day_hours(items: Iterable[Lease], since: float, until: float) -> Tuple[Dict[str, Dict[str, float]], List[str]]:
    """user -> day -> device-hours, and every day of the range (for the chart's x axis)."""
    out: Dict[str, Dict[str, float]] = {}
    for lease in items:
        lo, hi = max(lease.start, since), min(lease.end, until)
        for day, a, b in _days(lo, hi):
            per = out.setdefault(lease.user, {})
            per[day] = per.get(day, 0.0) + (b - a) * lease.weight / 3600
    days = [day for day, _, _ in _days(since, until)]
    return out, days
