"""When will a waiting run start: an estimate from the holders' run times so far and each
program's recent run lengths (the median of its last 20 runs in the ledger).

The why comes from the scheduler's own verdict (cudawrap.schedule, through status); this
only adds the when. `estimate()` is pure: status rows in, seconds (or None) and the basis in
words out. The ledger is root's alone, so the monitor keeps the medians in a file anyone may
read (`RUN_LENGTHS`); root without a monitor reads the ledger itself.
"""
from __future__ import annotations

import statistics
import time
from functools import lru_cache
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .. import locations as loc
from ..base import rootfile

RUN_LENGTHS = loc.RUNTIME_DIR + "/runlengths"
VERSION = 1
RECENT = 20  # runs per program the median is taken over

Medians = Mapping[str, Tuple[float, int]]  # program -> (median seconds, runs it is taken over)


def medians(records: Iterable[Mapping[str, Any]], recent: int = RECENT) -> Dict[str, Tuple[float, int]]:
    """Program -> (median run length, n) over its last RECENT finished runs (ledger end records)."""
    lengths: Dict[str, List[float]] = {}
    for r in records:
        if r.get("event") == "end" and isinstance(r.get("end"), (int, float)) and isinstance(r.get("start"), (int, float)):
            runs = lengths.setdefault(str(r.get("program", "?")), [])
            runs.append(max(0.0, float(r["end"]) - float(r["start"])))
            del runs[:-recent]
    return {p: (statistics.median(v), len(v)) for p, v in lengths.items()}


def write(layout: Any, ends: Mapping[str, Optional[float]], runs: Mapping[str, Tuple[float, int]]) -> None:
    """Root: the medians, and when each held device is expected to free (ENDS: device UUID
    -> epoch, None where its program has no run recorded), into RUN_LENGTHS. A user cannot
    read the ledger nor name another user's process; the file tells them when, not what."""
    rootfile.write(loc.under(str(layout.root), RUN_LENGTHS),
                   {"version": VERSION, "medians": dict(runs), "ends": dict(ends)})


def expected_ends(layout: Any, runs: Medians) -> Dict[str, Optional[float]]:
    """Device UUID -> when its lease holder is expected to end (its start + its program's
    median), None where the program has no finished run; as root sees /proc."""
    from ..lease.holders import holdings
    from ..base.procinfo import process_info

    out: Dict[str, Optional[float]] = {}
    for uuid, holding in holdings(str(layout.lease_dir)).items():
        if holding.pid is None:
            continue
        info = process_info(holding.pid, [uuid])
        started = _since(info["since"])
        if started is not None:
            median = runs.get(info["program"])
            out[uuid] = None if median is None else started + median[0]
    return out


def _from_ledger(layout: Any) -> Dict[str, Tuple[float, int]]:
    from . import files as ledgerfile

    problems: List[str] = []
    return medians(ledgerfile.read(ledgerfile.rotated(ledgerfile.ledger_path(layout), 2), problems))


Ends = Mapping[str, Optional[float]]  # device UUID -> when its holder is expected to end


def read(layout: Any) -> Tuple[Optional[Dict[str, Tuple[float, int]]], Dict[str, Optional[float]]]:
    """The medians and the held devices: root's file, or for root the ledger itself (root
    names every holder in status); (None, {}) when neither is there."""
    import os

    data = rootfile.read(str(layout.root), loc.under(str(layout.root), RUN_LENGTHS), VERSION)
    if data is not None:
        try:
            return ({str(p): (float(m), int(n)) for p, (m, n) in data["medians"].items()},
                    {str(u): None if t is None else float(t) for u, t in data["ends"].items()})
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    if os.geteuid() == 0:
        try:
            return _from_ledger(layout), {}
        except OSError:
            pass
    return None, {}


class RunLengths:
    """The monitor's part: rewrite RUN_LENGTHS when the ledger changed."""

    def __init__(self, layout: Any) -> None:
        self.layout = layout
        self._signature: Any = ()
        self._runs: Dict[str, Tuple[float, int]] = {}
        self._ends: Any = None

    def cycle(self) -> None:
        from . import files as ledgerfile
        from ..base.filestamp import file_signature

        signature = file_signature(ledgerfile.ledger_path(self.layout))
        if signature != self._signature:
            self._runs = _from_ledger(self.layout)
        ends = expected_ends(self.layout, self._runs)
        if signature != self._signature or ends != self._ends:
            write(self.layout, ends, self._runs)
            self._signature, self._ends = signature, ends


# --- the estimate -----------------------------------------------------------------------------


def _minutes(seconds: float) -> str:
    minutes = max(1, int(round(seconds / 60)))
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"


def shown(seconds: Optional[float]) -> str:
    """An estimate as people read it: "about 12 min", "now", or "unknown"."""
    if seconds is None:
        return "unknown"
    return "now" if seconds < 1 else f"about {_minutes(seconds)}"


def _since(text: Any) -> Optional[float]:
    return _parsed(str(text))


@lru_cache(maxsize=256)
def _parsed(text: str) -> Optional[float]:
    # Cached: each waiter's estimate reads every holder's start again (strptime and mktime:
    # ~80 us each, 75 ms of a status with 900 waiting), and there are a few holders.
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


class _Unknown(Exception):
    """Why no estimate can be given, in words."""


def _usable(row: Mapping[str, Any], devices: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    cands = row.get("candidates")
    return [d for d in devices if (cands is None or d["uuid"] in cands) and not d.get("drains")]


def _median(program: str, runs: Medians, which: str) -> float:
    """PROGRAM's median run length; _Unknown naming it and WHICH run of it the estimate needs."""
    if program not in runs:
        raise _Unknown(f"no finished run in the ledger of {program}, {which}")
    return runs[program][0]


def _free_at(device: Mapping[str, Any], runs: Medians, ends: Ends, now: float) -> float:
    holder = device.get("holder")
    if holder is None:
        return 0.0
    if holder.get("pid") is None and device["uuid"] in ends:  # another user's: root's estimate
        end = ends[device["uuid"]]
        if end is None:
            raise _Unknown(f"no finished run in the ledger of the program on {device['uuid'][:12]}")
        if end < now:
            raise _Unknown(f"the run on {device['uuid'][:12]} has run past its program's median")
        return end - now
    program, started = holder.get("program", "?"), _since(holder.get("since"))
    median = _median(program, runs, f"the program on {device['uuid'][:12]}")
    if started is None:
        raise _Unknown(f"the start of the holder of {device['uuid'][:12]} is not known")
    left = median - (now - started)
    if left < 0:
        raise _Unknown(f"{program} on {device['uuid'][:12]} has run past its median of {_minutes(median)}")
    return left


def estimate(row: Mapping[str, Any], waiting: Sequence[Mapping[str, Any]],
             devices: Sequence[Mapping[str, Any]], runs: Optional[Medians], now: float,
             ends: Ends = {}) -> Tuple[Optional[float], str]:
    """Seconds from NOW until the waiting run ROW starts (None: unknown), and the basis.

    Each device it may use frees when its holder's program reaches its median run length;
    the runs ahead of it in line take the first devices to free and hold them for their
    own program's median. A run over its user's limit waits for one of that user's runs."""
    if runs is None:
        return None, "no run lengths recorded (the monitor keeps them)"
    try:
        if row.get("kind") == "limit":
            own = [d for d in devices if d.get("holder") and d["holder"].get("user") == row["user"]]
            if not own:
                raise _Unknown("none of this user's runs is seen holding a device")
            return min(_free_at(d, runs, ends, now) for d in own), "when the first of your running runs ends"
        pool = _usable(row, devices)
        if len(pool) < row["count"]:
            raise _Unknown(f"only {len(pool)} undrained device(s) it may use, {row['count']} needed")
        free = {d["uuid"]: _free_at(d, runs, ends, now) for d in pool}
        ahead: List[str] = []
        for other in waiting:
            if other is row or (other.get("position") or 0) >= (row.get("position") or 0):
                continue
            theirs = sorted((u for u in free if other.get("candidates") is None or u in other["candidates"]),
                            key=lambda u: free[u])[:other["count"]]
            if not theirs or other.get("kind") == "limit":
                continue
            if other.get("pid") is None:  # another user's, hidden ([service] private_status)
                raise _Unknown("another user's run is ahead, and its program is not shown to you")
            ahead.append(other["program"])
            start = max(free[u] for u in theirs)
            for u in theirs:
                free[u] = start + _median(other["program"], runs, "which waits ahead in line")
        start = sorted(free.values())[row["count"] - 1]
    except _Unknown as why:
        return None, str(why)
    used = sorted({d["holder"]["program"] for d in pool if d.get("holder") and d["holder"].get("pid") is not None}
                  | set(ahead))
    basis = ", ".join(f"{p} {_minutes(runs[p][0])} (median of {runs[p][1]})" for p in used)
    n = len(ahead)
    hidden = sum(1 for d in pool if d.get("holder") and d["holder"].get("pid") is None and d["uuid"] in ends)
    if hidden:  # another user's run: its program is not this user's to know, its usual end is
        basis = (basis + ", " if basis else "") + (
            f"{hidden} other user's run{'s' if hidden != 1 else ''} ending at {'their' if hidden != 1 else 'its'} "
            f"program's median")
    return start, (f"run lengths: {basis}; " if basis else "") + (
        f"{n} run{'s' if n != 1 else ''} ahead" if n else "no run ahead")


def annotate(waiting: List[Dict[str, Any]], devices: Sequence[Mapping[str, Any]], layout: Any) -> None:
    """Add "start" (words), "start_s" and "start_basis" to each waiting row, in place."""
    if not waiting:
        return
    runs, ends = read(layout)
    now = time.time()
    for row in waiting:
        seconds, basis = estimate(row, waiting, devices, runs, now, ends)
        row["start_s"] = None if seconds is None else round(seconds, 1)
        row["start"] = shown(seconds)
        row["start_basis"] = basis
