"""What `cudawrap status` shows: each device, who leases it, what else runs there, who waits."""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional

from .errors import NvmlUnavailable
from .leases import _proc_locks, holders
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


def process_info(pid: int) -> Dict[str, Any]:
    """User, command line and start time of PID from /proc (what `ps` would say)."""
    info: Dict[str, Any] = {"pid": pid, "user": "?", "command": "?", "since": "?"}
    try:
        info["user"] = user_name(os.stat(f"/proc/{pid}").st_uid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            info["command"] = printable(f.read(4096).replace(b"\0", b" ").decode("utf-8", "replace").strip(), 4096)
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
    from .drains import drained

    drains = {u: {"reason": d.reason, "by": d.by, "at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(d.at))}
              for u, d in drained(str(layout.root)).items()}
    return {"devices": devices, "waiting": _waiting(layout), "queue_lock_holder": queue_lock_holder,
            "drained": drains,
            "nvml_error": nvml_error,
            "lost": list(inventory.lost) if inventory else []}
