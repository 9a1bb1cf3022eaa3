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
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from . import locations as loc, rootfile

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


def write(layout: Any, held: Mapping[str, Tuple[str, float]]) -> None:
    """Root: the medians from the ledger, and each held device's program and start (HELD),
    into RUN_LENGTHS: a user cannot read the ledger, nor name another user's process."""
    rootfile.write(loc.under(str(layout.root), RUN_LENGTHS),
                   {"version": VERSION, "medians": dict(_from_ledger(layout)), "held": dict(held)})


def holders(layout: Any) -> Dict[str, Tuple[str, float]]:
    """Device UUID -> (program, start) of its lease holder, as root sees /proc."""
    from .holders import holdings
    from .status import process_info

    out: Dict[str, Tuple[str, float]] = {}
    for uuid, holding in holdings(str(layout.lease_dir)).items():
        if holding.pid is None:
            continue
        info = process_info(holding.pid, [uuid])
        started = _since(info["since"])
        if started is not None:
            out[uuid] = (info["program"], started)
    return out


def _from_ledger(layout: Any) -> Dict[str, Tuple[float, int]]:
    from . import ledger

    problems: List[str] = []
    return medians(ledger.read(ledger.rotated(ledger.ledger_path(layout), 2), problems))


Held = Mapping[str, Tuple[str, float]]  # device UUID -> (its holder's program, start)


def read(layout: Any) -> Tuple[Optional[Dict[str, Tuple[float, int]]], Dict[str, Tuple[str, float]]]:
    """The medians and the held devices: root's file, or for root the ledger itself (root
    names every holder in status); (None, {}) when neither is there."""
    import os

    data = rootfile.read(str(layout.root), loc.under(str(layout.root), RUN_LENGTHS), VERSION)
    if data is not None:
        try:
            return ({str(p): (float(m), int(n)) for p, (m, n) in data["medians"].items()},
                    {str(u): (str(p), float(t)) for u, (p, t) in data["held"].items()})
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
        self._held: Any = None

    def cycle(self) -> None:
        import os

        from . import ledger

        try:
            st = os.stat(ledger.ledger_path(self.layout))
            signature: Any = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            signature = None
        held = holders(self.layout)
        if signature != self._signature or held != self._held:
            write(self.layout, held)
            self._signature, self._held = signature, held


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
    try:
        return time.mktime(time.strptime(str(text), "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


class _Unknown(Exception):
    """Why no estimate can be given, in words."""


def _usable(row: Mapping[str, Any], devices: Sequence[Mapping[str, Any]]) -> List[Mapping[str, Any]]:
    cands = row.get("candidates")
    return [d for d in devices if (cands is None or d["uuid"] in cands) and not d.get("drains")]


def _median(program: str, runs: Medians, whose: str) -> float:
    if program not in runs:
        raise _Unknown(f"no finished run of {program} in the ledger ({whose})")
    return runs[program][0]


def _free_at(device: Mapping[str, Any], runs: Medians, held: Held, now: float) -> float:
    holder = device.get("holder")
    if holder is None:
        return 0.0
    program, started = holder.get("program", "?"), _since(holder.get("since"))
    if holder.get("pid") is None and device["uuid"] in held:  # another user's: root named it
        program, started = held[device["uuid"]]
    median = _median(program, runs, "a holder")
    if started is None:
        raise _Unknown(f"the start of the holder of {device['uuid'][:12]} is not known")
    left = median - (now - started)
    if left < 0:
        raise _Unknown(f"{program} on {device['uuid'][:12]} has run past its median of {_minutes(median)}")
    return left


def estimate(row: Mapping[str, Any], waiting: Sequence[Mapping[str, Any]],
             devices: Sequence[Mapping[str, Any]], runs: Optional[Medians], now: float,
             held: Held = {}) -> Tuple[Optional[float], str]:
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
            return min(_free_at(d, runs, held, now) for d in own), "when the first of your running runs ends"
        pool = _usable(row, devices)
        if len(pool) < row["count"]:
            raise _Unknown(f"only {len(pool)} undrained device(s) it may use, {row['count']} needed")
        free = {d["uuid"]: _free_at(d, runs, held, now) for d in pool}
        ahead: List[str] = []
        for other in waiting:
            if other is row or (other.get("position") or 0) >= (row.get("position") or 0):
                continue
            theirs = sorted((u for u in free if other.get("candidates") is None or u in other["candidates"]),
                            key=lambda u: free[u])[:other["count"]]
            if not theirs or other.get("kind") == "limit":
                continue
            ahead.append(other["program"])
            start = max(free[u] for u in theirs)
            for u in theirs:
                free[u] = start + _median(other["program"], runs, "a run ahead")
        start = sorted(free.values())[row["count"] - 1]
    except _Unknown as why:
        return None, str(why)
    used = sorted({held[d["uuid"]][0] if d["holder"].get("pid") is None and d["uuid"] in held
                   else d["holder"]["program"] for d in pool if d.get("holder")} | set(ahead))
    basis = ", ".join(f"{p} {_minutes(runs[p][0])} (median of {runs[p][1]})" for p in used)
    n = len(ahead)
    return start, (f"run lengths: {basis}; " if basis else "") + (
        f"{n} run{'s' if n != 1 else ''} ahead" if n else "no run ahead")


def annotate(waiting: List[Dict[str, Any]], devices: Sequence[Mapping[str, Any]], layout: Any) -> None:
    """Add "start" (words), "start_s" and "start_basis" to each waiting row, in place."""
    if not waiting:
        return
    runs, held = read(layout)
    now = time.time()
    for row in waiting:
        seconds, basis = estimate(row, waiting, devices, runs, now, held)
        row["start_s"] = None if seconds is None else round(seconds, 1)
        row["start"] = shown(seconds)
        row["start_basis"] = basis
