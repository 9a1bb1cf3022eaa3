"""What `cudawrap status` shows: each device, who leases it, what else runs there, who waits.

Besides the inventory the launch path uses, status reads what gpustatus shows
(utilisation, temperature, power, performance state, each process's memory): more NVML
queries that only this command makes.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Tuple

from .errors import NvmlUnavailable
from .leases import _proc_locks, holders
from .paths import Layout
from .users import user_name
from .waitqueue import WaitQueue


def parse_watch(seconds: Any, count: Optional[str]) -> Tuple[float, Optional[int]]:
    """`--watch [SECONDS] [--count N]` as (period, refreshes or None); ValueError if bad."""
    if len(seconds) > 1:
        raise ValueError(f"one refresh period, not {len(seconds)} values")
    try:
        period = float(seconds[0]) if seconds else 2.0
    except ValueError:
        raise ValueError(f"{printable(seconds[0], 40)!r} is not a number of seconds") from None
    if not 0.1 <= period <= 3600:  # NaN fails this too
        raise ValueError(f"{printable(seconds[0], 40)!r}: choose between 0.1 and 3600 seconds")
    if count is None:
        return period, None
    text = count.strip()
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text[:9]) <= 10**6:
        raise ValueError(f"--count {printable(count, 40)!r} is not a number of refreshes (1 or more)")
    return period, int(count)


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


# Readings a device has when NVML cannot be asked, or does not say.
_NO_READINGS: Dict[str, Any] = {
    "memory_free_mib": None, "utilization": None, "memory_utilization": None, "temperature_c": None,
    "power_w": None, "power_limit_w": None, "performance_state": None,
}


def _readings(uuid: str) -> Tuple[Dict[str, Any], Optional[Dict[int, Optional[int]]]]:
    """(the readings of _NO_READINGS' keys, pid -> memory MiB of its processes or None)."""
    from . import nvml

    got = nvml.readings(uuid)
    return {key: got.get(key) for key in _NO_READINGS}, got.get("process_memory_mib")


def _processes(pids: Optional[Any], holder: Optional[Dict[str, Any]],
               memory: Optional[Dict[int, Optional[int]]]) -> Optional[List[Dict[str, Any]]]:
    """Every compute process on a device: who, what, how much memory, and whether it holds the lease."""
    if pids is None:
        return None  # the driver hides them from this user
    out = []
    for pid in pids:
        info = process_info(pid)
        out.append({"pid": pid, "user": info["user"], "command": info["command"],
                    "memory_mib": (memory or {}).get(pid),
                    "lease_holder": bool(holder) and holder["pid"] == pid})
    return out


def _gpus(inventory: Any) -> List[Dict[str, Any]]:
    """The physical GPUs with their board readings (a MIG instance has none of its own)."""
    out = []
    for gpu in inventory.gpus:
        readings, _memory = _readings(gpu.uuid)
        out.append({"uuid": gpu.uuid, "index": gpu.index, "name": gpu.name, "mig_mode": gpu.mig_mode,
                    **readings})
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
        from .filters import product

        for d in inventory.devices:
            holder = process_info(held[d.uuid]) if d.uuid in held else None
            foreign = None if d.pids is None else [p for p in d.pids if not holder or p != holder["pid"]]
            readings, memory = _readings(d.uuid)
            devices.append({
                "uuid": d.uuid, "name": d.name, "gpu_index": d.gpu_index, "parent": d.parent_uuid,
                "mig_slot": d.mig_slot, "memory_used_mib": d.memory_used_mib,
                "memory_total_mib": d.memory_total_mib, "lease_file": d.uuid in lease_files,
                "holder": holder, "foreign_pids": foreign,
                "index": d.gpu_index, "product": product(d, inventory),
                "mig_profile": d.name if d.is_mig else None, **readings,
                "processes": _processes(d.pids, holder, memory), "waiters": [], "drains": []})
    else:
        for uuid in sorted(lease_files):
            holder = process_info(held[uuid]) if uuid in held else None
            devices.append({"uuid": uuid, "name": "?", "gpu_index": -1, "parent": "?", "mig_slot": None,
                            "memory_used_mib": 0, "memory_total_mib": 0, "lease_file": True,
                            "holder": holder, "foreign_pids": None,
                            "index": None, "product": None, "mig_profile": None, **_NO_READINGS,
                            "processes": None, "waiters": [], "drains": []})
    # The queue's mutex is held for milliseconds by each launch; anyone may hold it longer
    # (a user can flock the file), which stalls every launch: show who, for root to act.
    queue_lock_holder = None
    try:
        st = os.stat(layout.queue_lock)
        pid = _proc_locks().get((st.st_dev, st.st_ino))
        queue_lock_holder = process_info(pid) if pid is not None else None
    except OSError:
        pass
    return {"devices": devices, "waiting": _waiting(layout), "queue_lock_holder": queue_lock_holder,
            "nvml_error": nvml_error,
            "lost": list(inventory.lost) if inventory else [],
            "gpus": _gpus(inventory) if inventory else []}
