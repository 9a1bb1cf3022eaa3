"""The table `cudawrap status` prints from machine_status's rows (status.py): one line per
device, then one per waiting run; --json has it all.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple


def memory_text(holder: Dict[str, Any]) -> str:
    """" 23.1/40 GiB" (a share: used of its limit), " 23.1 GiB", or "" when not known."""
    memory = holder.get("memory")
    if not memory or memory.get("used_mib") is None:
        return ""
    used = f"{memory['used_mib'] / 1024:.1f}"
    limit = memory.get("limit_mib")
    return f" {used}/{limit / 1024:g} GiB" if limit else f" {used} GiB"


# --- the table `cudawrap status` prints ------------------------------------------------------
#
# A column is (header, cell, widest): cell(row) gives the text, cut to WIDEST characters
# (0: never cut). The default table fits 80 columns with typical names; --json has it all.

Column = Tuple[str, Callable[[Dict[str, Any]], str], int]


def _cut(text: str, width: int) -> str:
    return text if not width or len(text) <= width else text[:width - 1] + "~"


def _short_time(stamp: str) -> str:
    """HH:MM for today, MM-DD before (process_info's ISO time)."""
    if len(stamp) < 16:
        return stamp
    return stamp[11:16] if stamp[:10] == time.strftime("%Y-%m-%d") else stamp[5:10]


def _device(d: Dict[str, Any]) -> str:
    where = "?" if d["gpu_index"] < 0 else str(d["gpu_index"])
    if d.get("mig_slot") is not None:
        where += f"/{d['mig_slot']}"
    return f"{where} {d['uuid'][:12]}"


def _memory(d: Dict[str, Any]) -> str:
    return "?" if not d["memory_total_mib"] else f"{d['memory_used_mib']}/{d['memory_total_mib']}"


def holder_text(holder: Optional[Dict[str, Any]]) -> str:
    """pid, user and program of a lock's holder, as one cell."""
    if holder is None:
        return "free"
    if holder["pid"] is None and holder.get("user", "?") != "?":  # a grant whose run exited, the lease passed on
        return f"{_cut(holder['user'], 8)} {_cut(holder.get('program', '?'), 10)} (its run exited)"
    if holder["pid"] is None:
        return "held (holder not visible to you)"
    return f"pid {holder['pid']} {_cut(holder['user'], 8)} {_cut(holder.get('program', '?'), 10)}{memory_text(holder)}"


def _lease(d: Dict[str, Any]) -> str:
    if not d["lease_file"]:
        return "no lease file (run `cudawrap sync`)"
    shares = d.get("shares")
    if shares:  # "2/4 shared: alice pid 123, alice pid 456"; "eve pid 9 (slot only)": no lease lock
        who = ", ".join(_sharer(h) for h in shares["holders"])
        text = f"{shares['used']}/{shares['slots']} shared: {who}"
    elif d.get("slots_apart"):  # held whole, and slots locked besides
        text = f"{holder_text(d['holder'])}; slots locked apart: {', '.join(_sharer(h) for h in d['slots_apart'])}"
    else:
        text = holder_text(d["holder"])
    if not d.get("drains"):
        return text
    # Drained: nobody new gets it, whether or not a run still holds it (drain --wait waits for that run).
    reason = d["drains"][0]["reason"] or "-"
    return f"drained: {reason}" if text == "free" else f"{text}; drained"


def _sharer(h: Dict[str, Any]) -> str:
    who = "?" if h["pid"] is None else f"{_cut(h['user'], 8)} pid {h['pid']}{memory_text(h)}"
    return who if h.get("lease", True) else f"{who} (slot only)"


def _others(d: Dict[str, Any]) -> str:
    pids = d["foreign_pids"]
    if pids is None:
        return "unknown"
    hidden = d.get("foreign_hidden")  # [service] private_status: others' processes, counted
    return ",".join([*map(str, pids), *([f"{hidden} hidden"] if hidden else [])]) or "-"


def _foreign(d: Dict[str, Any], cut: bool) -> List[str]:
    """A line per process on D that holds no lease there (OTHERS has only its pid): whose it is
    and its command, from the device's processes (the pid alone where they are not shown).
    Not "not started by cudawrap": a run's worker that closed its lease descriptor is one too."""
    known = {p["pid"]: p for p in d.get("processes") or ()}
    out = []
    for pid in d.get("foreign_pids") or ():
        p = known.get(pid) or {}
        who = f"pid {pid} of {p['user']}" if p.get("user") else f"pid {pid}"
        line = f"{d['uuid']}: {who} holds no lease here"
        if p.get("command"):  # a line of its own: on a terminal it may wrap, but not for 4 KiB
            line += f": {_cut(p['command'], 60 if cut else 0)}"
        out.append(line)
    return out


DEVICE_COLUMNS: List[Column] = [
    ("DEVICE", _device, 0),
    ("MEMORY MiB", _memory, 0),
    ("LEASE", _lease, 0),
    ("SINCE", lambda d: _short_time(d["holder"]["since"]) if d["holder"] else "", 5),
    ("OTHERS", _others, 8),
]

WAITING_COLUMNS: List[Column] = [
    ("POS", lambda w: str(w["position"] or "?"), 0),
    ("USER", lambda w: w["user"], 8),
    ("PID", lambda w: "?" if w["pid"] is None else str(w["pid"]), 0),  # None: another user's, hidden
    ("N", lambda w: str(w["count"]), 0),
    ("PROGRAM", lambda w: w["program"], 12),
    ("START", lambda w: w.get("start", "unknown"), 10),  # docs/user/waiting.md
    ("WHY", lambda w: w["reason"], 38),  # all of it in --json
]


DRAINED_COLUMNS: List[Column] = [
    ("DRAINED", lambda d: d["uuid"][:16], 0),
    ("SINCE", lambda d: _short_time(d["at"]), 5),
    ("BY", lambda d: d["by"], 8),
    ("REASON", lambda d: d["reason"] or "-", 40),
]


def table(rows: Sequence[Dict[str, Any]], columns: Sequence[Column], cut: bool = True) -> List[str]:
    """ROWS as aligned lines under COLUMNS' headers; each cell cut to its column's widest if CUT
    (for a terminal: a script reading the table gets every cell whole)."""
    cells = [[header for header, _, _ in columns]]
    cells += [[_cut(cell(row), widest if cut else 0) for _, cell, widest in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]


def render(status: Dict[str, Any], cut: bool = True) -> List[str]:
    """`cudawrap status` as text: which install, the devices, who waits, who holds the queue;
    long cells cut to fit a terminal if CUT."""
    held = sum(1 for d in status["devices"] if d["holder"] or d.get("shares"))
    count = (f"devices unknown, {len(status['devices'])} lease files" if status["nvml_error"]
             else f"{len(status['devices'])} devices")
    way = {"service": " (runs with the service)", "daemonless": " (runs daemonless)"}.get(status.get("way") or "", "")
    lines = [f"install root {status['root']}: {count}, {held} leased, {len(status['waiting'])} waiting{way}"]
    if status["devices"]:
        lines += table(status["devices"], DEVICE_COLUMNS, cut)
    for d in status["devices"]:
        if d.get("mps_without_share"):
            who = ", ".join("another user's" if p["pid"] is None else
                            f"{_cut(p['user'], 8)} pid {p['pid']} {_cut(p['program'], 16)}"
                            for p in d["mps_without_share"])
            lines.append(f"{d['uuid']}: MPS client(s) holding no share: {who}; "
                         "the device's shares wait for them to end")
    lines += [line for d in status["devices"] for line in _foreign(d, cut)]
    lines += [f"{d['uuid']}: {text}" for d in status["devices"] for text in d.get("leftovers", ())]
    lines += [f"{d['uuid']}: IDLE for {d['idle']['idle_s'] / 60:.0f} min: "
              + ("another user's run" if d["idle"]["pid"] is None else f"pid {d['idle']['pid']} {d['idle']['user']}")
              + f" ({d['idle']['basis']})" for d in status["devices"] if d.get("idle")]
    if status.get("drained"):
        lines.append("")
        lines += table([dict(d, uuid=u) for u, d in sorted(status["drained"].items())], DRAINED_COLUMNS, cut)
    if status["waiting"]:
        lines.append("")
        lines += table(status["waiting"], WAITING_COLUMNS, cut)
    return lines
