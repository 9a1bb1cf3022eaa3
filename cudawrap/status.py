"""What `cudawrap status` shows: each device, who leases it, what else runs there, who waits."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .errors import NvmlUnavailable
from .leases import _proc_locks, holders
from .locations import REAL_PREFIX
from .paths import Layout
from .users import user_name
from .waitqueue import WaitQueue


def printable(text: str, limit: int = 200) -> str:
    """TEXT cut to LIMIT with control characters replaced: command lines and queue entries are
    written by users, and must not send escape sequences to an admin's terminal."""
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _boot_time() -> float:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


# Programs that run another named on their command line: the program is that one.
INTERPRETERS = ("python", "perl", "ruby", "node", "bash", "sh", "dash", "zsh", "Rscript", "julia", "env")


def program_name(argv: Sequence[str]) -> str:
    """What a person calls the program of ARGV: the script an interpreter runs (train.py for
    `python3 -u train.py`), under its wrapped name (recon for CUDAWRAP_recon)."""
    args = [a for a in argv if a]
    name = os.path.basename(args[0]) if args else "?"
    base = name.rstrip("0123456789.")
    if base in INTERPRETERS or (base.startswith("python") and base[6:].rstrip("dmu") == ""):
        for arg in args[1:]:
            if not arg.startswith("-") and "=" not in arg:
                name = os.path.basename(arg)
                break
    return name[len(REAL_PREFIX):] if name.startswith(REAL_PREFIX) and len(name) > len(REAL_PREFIX) else name


def process_info(pid: int) -> Dict[str, Any]:
    """User, command line and start time of PID from /proc (what `ps` would say)."""
    info: Dict[str, Any] = {"pid": pid, "user": "?", "command": "?", "program": "?", "since": "?"}
    try:
        info["user"] = user_name(os.stat(f"/proc/{pid}").st_uid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(4096).decode("utf-8", "replace").split("\0")
        info["command"] = printable(" ".join(argv).strip(), 4096)
        info["program"] = printable(program_name(argv), 200)
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
        info["since"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started))
    except (OSError, IndexError, ValueError):
        pass
    return info


def _int(text: Optional[str]) -> int:
    try:
        return int(text or "")
    except ValueError:
        return -1


def _waiting(layout: Layout) -> List[Dict[str, Any]]:
    try:
        queue = WaitQueue(str(layout.queue_dir), str(layout.queue_lock))
    except Exception:  # a missing runtime directory is reported with the devices
        return []
    # The user comes from the entry's owner and the pid from the kernel's record of who holds
    # its lock, whatever the entry says: root can see who holds up the queue (SECURITY.md).
    locks = _proc_locks()
    out = []
    for key, uid, info in queue.entries():
        # Entries are written by users: read them as untrusted text.
        fields = dict(line.split("=", 1) for line in info.decode("utf-8", "replace").splitlines() if "=" in line)
        claimed = _int(fields.get("pid"))
        try:
            st = os.stat(os.path.join(queue.dir, key), follow_symlinks=False)
            pid = locks.get((st.st_dev, st.st_ino), claimed)
        except OSError:
            pid = claimed
        waiter = {"key": key, "user": user_name(uid), "pid": pid, "count": _int(fields.get("count")),
                  "program": printable(fields.get("program", "?"))}
        if claimed != pid:
            waiter["claimed_pid"] = claimed
        out.append(waiter)
    return out


def machine_status(layout: Layout) -> Dict[str, Any]:
    from . import nvml

    lease_dir = str(layout.lease_dir)
    held = holders(lease_dir)
    lease_files = set(os.listdir(lease_dir)) if os.path.isdir(lease_dir) else set()
    devices: List[Dict[str, Any]] = []
    nvml_error: Optional[str] = None
    try:
        inventory = nvml.inventory()
    except NvmlUnavailable as exc:
        nvml_error = str(exc)
        inventory = None
    if inventory is not None:
        for d in inventory.devices:
            holder = process_info(held[d.uuid]) if d.uuid in held else None
            foreign = None if d.pids is None else [p for p in d.pids if not holder or p != holder["pid"]]
            devices.append({
                "uuid": d.uuid, "name": d.name, "gpu_index": d.gpu_index, "parent": d.parent_uuid,
                "mig_slot": d.mig_slot, "memory_used_mib": d.memory_used_mib,
                "memory_total_mib": d.memory_total_mib, "lease_file": d.uuid in lease_files,
                "holder": holder, "foreign_pids": foreign})
    else:
        for uuid in sorted(lease_files):
            holder = process_info(held[uuid]) if uuid in held else None
            devices.append({"uuid": uuid, "name": "?", "gpu_index": -1, "parent": "?", "mig_slot": None,
                            "memory_used_mib": 0, "memory_total_mib": 0, "lease_file": True,
                            "holder": holder, "foreign_pids": None})
    # The queue's mutex is held for milliseconds by each launch; anyone may hold it longer
    # (a user can flock the file), which stalls every launch: show who, for root to act.
    queue_lock_holder = None
    try:
        st = os.stat(layout.queue_lock)
        pid = _proc_locks().get((st.st_dev, st.st_ino))
        queue_lock_holder = process_info(pid) if pid is not None else None
    except OSError:
        pass
    return {"root": str(layout.root), "devices": devices, "waiting": _waiting(layout),
            "queue_lock_holder": queue_lock_holder, "nvml_error": nvml_error,
            "lost": list(inventory.lost) if inventory else []}


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
    return f"pid {holder['pid']} {_cut(holder['user'], 8)} {_cut(holder.get('program', '?'), 10)}"


def _lease(d: Dict[str, Any]) -> str:
    return holder_text(d["holder"]) if d["lease_file"] else "no lease file (run `cudawrap sync`)"


def _others(d: Dict[str, Any]) -> str:
    pids = d["foreign_pids"]
    return "unknown" if pids is None else (",".join(map(str, pids)) or "-")


DEVICE_COLUMNS: List[Column] = [
    ("DEVICE", _device, 0),
    ("MEMORY MiB", _memory, 0),
    ("LEASE", _lease, 0),
    ("SINCE", lambda d: _short_time(d["holder"]["since"]) if d["holder"] else "", 5),
    ("OTHERS", _others, 8),
]

WAITING_COLUMNS: List[Column] = [
    ("WAITING", lambda w: str(w["position"]), 0),
    ("USER", lambda w: w["user"], 0),
    ("PID", lambda w: str(w["pid"]), 0),
    ("DEVICES", lambda w: str(w["count"]), 0),
    ("PROGRAM", lambda w: w["program"], 24),
]


def table(rows: Sequence[Dict[str, Any]], columns: Sequence[Column]) -> List[str]:
    """ROWS as aligned lines under COLUMNS' headers."""
    cells = [[header for header, _, _ in columns]]
    cells += [[_cut(cell(row), widest) for _, cell, widest in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells]


def render(status: Dict[str, Any]) -> List[str]:
    """`cudawrap status` as text: which install, the devices, who waits, who holds the queue."""
    held = sum(1 for d in status["devices"] if d["holder"])
    count = (f"devices unknown, {len(status['devices'])} lease files" if status["nvml_error"]
             else f"{len(status['devices'])} devices")
    lines = [f"install root {status['root']}: {count}, {held} leased, {len(status['waiting'])} waiting"]
    if status["devices"]:
        lines += table(status["devices"], DEVICE_COLUMNS)
    if status["waiting"]:
        lines.append("")
        lines += table([dict(w, position=n) for n, w in enumerate(status["waiting"], 1)], WAITING_COLUMNS)
    holder = status.get("queue_lock_holder")
    if holder:
        lines += ["", f"queue lock held by {holder_text(holder)} since {holder['since']}"]
    return lines
