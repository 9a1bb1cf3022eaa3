"""What `cudawrap status` shows: each device, who leases it, what else runs there, who waits.

Besides the inventory the launch path uses, status reads what gpustatus shows
(utilisation, temperature, power, performance state, each process's memory): more NVML
queries that only this command makes.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..errors import NvmlUnavailable
from ..lease.holders import Holding, holdings, slots_apart
from ..lease.files import lock_table
from ..paths import Layout
from ..base.users import user_name
from ..sched.queue import WaitQueue
from ..lease.lessees import foreign_pids
from ..base.procinfo import printable, process_info, program_name  # noqa: F401 - re-exported
from .statustable import Column, holder_text, memory_text, render, table  # noqa: F401 - re-exported


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


def _int(text: Optional[str]) -> int:
    try:
        return int(text or "")
    except ValueError:
        return -1


def _waiting(layout: Layout, inventory: Any) -> List[Dict[str, Any]]:
    """Every live waiter in the order it will be served, with why it waits.

    The reasons come from the same decision the waiters make (cudawrap.sched.schedule), over
    this look at the machine. The user comes from the entry's owner and the pid from the
    kernel's record of who holds its lock: entries are written by users, so nothing else
    in them is trusted.
    """
    from ..sched.machine import MachineView, ViewOptions
    from ..errors import CudawrapError
    from ..lease.files import LeaseFiles
    from ..policy.limits import limit_for
    from ..policy.effective import effective, queue_bounds

    try:
        queue = WaitQueue(str(layout.queue_dir))
    except Exception:  # a missing runtime directory is reported with the devices
        return []
    scan = queue.scan(clean=False)
    verdicts: Dict[str, Any] = {}
    if inventory is not None:
        try:
            from ..lease.sharing import Sharing

            settings = effective(str(layout.root), None)
            limits = settings.limits
            view = MachineView(LeaseFiles(str(layout.lease_dir), str(layout.share_dir)), inventory.devices,
                               inventory.devices, ViewOptions(
                                   limit_of=(lambda uid: limit_for(uid, limits)) if limits else None,
                                   sharing=Sharing(settings.sharing), root=str(layout.root),
                                   admin=lambda: queue_bounds(str(layout.root))))
            verdicts = view.decide(scan, None, queued=True)[0]
        except CudawrapError:
            verdicts = {}
    out = []
    for w in scan.waiters:
        info = queue.read_info(scan.paths[w.key]) or {}
        verdict = verdicts.get(w.key)
        out.append({"key": w.key, "user": user_name(w.uid), "pid": w.pid, "count": w.count,
                    "program": printable(info.get("program", "?")),
                    "waiting_s": round(max(0.0, time.time() - w.arrival), 1),
                    "position": verdict.position + 1 if verdict else None,
                    "kind": verdict.kind if verdict else None,
                    "reason": verdict.text if verdict else "unknown (no device data)",
                    "candidates": sorted(w.candidates) if w.candidates is not None else None})
    out.sort(key=lambda w: (w["position"] is None, w["position"] or 0, w["key"]))
    return out


_UNKNOWN_HOLDER = {"pid": None, "user": "?", "command": "unknown holder", "program": "unknown holder", "since": "?"}


def _holder(held: Dict[str, Holding], uuid: str) -> Optional[Dict[str, Any]]:
    """Who holds UUID's lease (its first sharer if shared): None if free; "?" fields where the
    holder cannot be named (another user's process, seen by a user), rather than a pid that
    may be someone else."""
    if uuid not in held:
        return None
    pid = held[uuid].pid
    return dict(_UNKNOWN_HOLDER) if pid is None else process_info(pid, [uuid])


def _named(pid: Optional[int], devices: Sequence[str], **extra: Any) -> Dict[str, Any]:
    return dict(_UNKNOWN_HOLDER if pid is None else process_info(pid, devices), **extra)


def _shares(held: Dict[str, Holding], uuid: str, slots: int,
            apart: Sequence[Optional[int]] = ()) -> Optional[Dict[str, Any]]:
    """UUID's shares if it is shared now: slots used and taken, and who holds each; a slot
    locked apart from the lease file (APART: its holders) is a share too, marked "lease": false."""
    holding = held.get(uuid)
    if (holding is None and not apart) or (holding is not None and holding.exclusive):
        return None
    pids = holding.pids if holding is not None else []
    return {"used": len(pids) + len(apart), "slots": slots,
            "holders": [_named(pid, [uuid], lease=True) for pid in pids]
            + [_named(pid, [uuid], lease=False) for pid in apart]}


def _mps_without_share(root: str, lease_dir: str, uuid: str, pids: Optional[Sequence[int]],
                       table: Dict[Tuple[int, int], List[Tuple[int, bool]]]) -> List[Dict[str, Any]]:
    """Under MPS, the processes on UUID of users who hold no share there, besides the server of
    cudawrap's daemon for it (an MPS client connected without a lease): they keep the
    device's other users waiting. Shares are the lease file's locks, by the owner of each taker."""
    from ..sched.machine import mps_strangers
    from ..sched.tally import uid_of
    from ..lease.sharing import mps_daemon

    if not pids:
        return []
    try:
        st = os.stat(os.path.join(lease_dir, uuid), follow_symlinks=False)
        owner = os.stat(lease_dir).st_uid
    except OSError:
        return []
    daemon = mps_daemon(root, uuid, owner)
    if daemon is None:
        return []  # no daemon of cudawrap's: nobody is an MPS client of it
    uids = {uid_of(pid) for pid, _ex in table.get((st.st_dev, st.st_ino), [])}
    return [process_info(pid) for pid in mps_strangers(pids, uids, daemon)]


# Readings a device has when NVML cannot be asked, or does not say.
_NO_READINGS: Dict[str, Any] = {
    "memory_free_mib": None, "utilization": None, "memory_utilization": None, "temperature_c": None,
    "power_w": None, "power_limit_w": None, "performance_state": None,
}


def _readings(uuid: str, nv: Any) -> Tuple[Dict[str, Any], Optional[Dict[int, Optional[int]]]]:
    """(the readings of _NO_READINGS' keys, pid -> memory MiB of its processes or None),
    through NV, the binding machine_status initialised once for the whole status."""
    from ..devices import nvml

    got = nvml.readings(uuid, nv)
    return {key: got.get(key) for key in _NO_READINGS}, got.get("process_memory_mib")


def _processes(pids: Optional[Any], holder: Optional[Dict[str, Any]],
               memory: Optional[Dict[int, Optional[int]]],
               shares: Optional[Dict[str, Any]] = None) -> Optional[List[Dict[str, Any]]]:
    """Every compute process on a device: who, what, how much memory, and whether it holds the lease."""
    if pids is None:
        return None  # the driver hides them from this user
    sharers = {h["pid"] for h in shares["holders"] if h.get("lease", True)} if shares else set()
    out = []
    for pid in pids:
        info = process_info(pid)
        out.append({"pid": pid, "user": info["user"], "command": info["command"],
                    "memory_mib": (memory or {}).get(pid),
                    "lease_holder": (bool(holder) and holder["pid"] == pid) or pid in sharers})
    return out


def _gpus(inventory: Any, nv: Any) -> List[Dict[str, Any]]:
    """The physical GPUs with their board readings (a MIG instance has none of its own)."""
    out = []
    for gpu in inventory.gpus:
        readings, _memory = _readings(gpu.uuid, nv)
        out.append({"uuid": gpu.uuid, "index": gpu.index, "name": gpu.name, "mig_mode": gpu.mig_mode,
                    **readings})
    return out


def machine_status(layout: Layout, ask_service: bool = True,
                   line: Optional[List[Dict[str, Any]]] = None, viewer: Optional[int] = None,
                   private: Optional[bool] = None) -> Dict[str, Any]:
    """Every device, its holder and state, and everyone waiting. ASK_SERVICE: the service's
    line and holders complete it (False: the service itself asks, and gives its own LINE,
    which then stands for the queue's). As VIEWER (a uid; default this process's) may see it
    where PRIVATE ([service] private_status; default the config's): others' runs hidden."""
    from ..devices import nvml
    from ..policy.privacy import hidden_from

    viewer = os.geteuid() if viewer is None else viewer
    me = hidden_from(str(layout.root), viewer) if private is None else (
        user_name(viewer) if private and viewer != 0 else None)

    if ask_service and not os.access(layout.lease_dir, os.X_OK) and layout.lease_dir.exists():
        return _through_service_whole(layout)  # the service arbitrates: only root reads the leases
    leases = _leases(layout)  # read before NVML, as the rows always were
    nvml_error: Optional[str] = None
    nv = None
    try:
        nv = nvml.init()  # once for the whole status: the inventory and every device's readings
        inventory = nvml.inventory(nv=nv)
    except NvmlUnavailable as exc:
        nvml_error = str(exc)
        inventory = None
    devices = _devices(layout, inventory, leases, nv)
    drains = _add_drains(str(layout.root), devices)
    _add_health(str(layout.root), devices, me)
    _run_memory(layout, devices)
    waiting = _waiting(layout, inventory) if line is None else line
    if ask_service:
        from .view import through_service

        waiting = through_service(layout, devices, waiting)  # the service's line, where one runs
    if me is not None:  # [service] private_status: before the estimates, which name programs
        waiting = _hide(devices, waiting, me, viewer)
    from ..ledger.eta import annotate

    annotate(waiting, devices, layout)  # when each may start (docs/user/waiting.md)
    for device in devices:
        device["waiters"] = [w["pid"] for w in waiting
                             if w["candidates"] is None or device["uuid"] in w["candidates"]]
    from ..paths import recorded_way

    return {"root": str(layout.root), "way": recorded_way(str(layout.root)),
            "devices": devices, "waiting": waiting, "drained": drains,
            "nvml_error": nvml_error,
            "lost": list(inventory.lost) if inventory else [],
            "gpus": _gpus(inventory, nv) if inventory else []}


def _hide(devices: List[Dict[str, Any]], waiting: List[Dict[str, Any]], me: str,
          viewer: int) -> List[Dict[str, Any]]:
    """DEVICES (in place) and WAITING as ME (uid VIEWER) may see them under private_status."""
    from ..base.proc import real_uid
    from ..policy.privacy import redact

    own = {p for d in devices for p in d.get("foreign_pids") or () if real_uid(p) == viewer}
    view = {"devices": devices, "waiting": waiting}
    redact(view, me, own)
    return view["waiting"]


def _through_service_whole(layout: Layout) -> Dict[str, Any]:
    """The whole status as the service (root) reads it, for a caller who cannot."""
    import json

    from ..launch import client
    from .. import wire
    from ..errors import ServiceUnavailable

    reply = client.question(str(layout.root), wire.STATUS, {"whole": "1"})
    if reply is None or "status" not in reply:
        raise ServiceUnavailable(f"{client.NOT_RUNNING}, and only it may read the leases (the install's arbiter)",
                                 hint=client.start_it(str(layout.root)))
    return json.loads(reply["status"])


def _leases(layout: Layout) -> Tuple[Any, ...]:
    """(the lock table, the holdings, the sharers' slots held apart, the sharing policy, the
    lease files' names)."""
    from ..lease.sharing import Sharing, configured

    lease_dir = str(layout.lease_dir)
    table = lock_table()
    held = holdings(lease_dir, table)
    apart = slots_apart(lease_dir, str(layout.share_dir), table)
    try:
        sharing = configured(str(layout.root))
    except Exception:  # a broken config is `cudawrap config`'s to report; status still shows leases
        sharing = Sharing()
    lease_files = set(os.listdir(lease_dir)) if os.path.isdir(lease_dir) else set()
    return table, held, apart, sharing, lease_files


def _devices(layout: Layout, inventory: Any, leases: Tuple[Any, ...], nv: Any = None) -> List[Dict[str, Any]]:
    """A row per device: NVML's (INVENTORY, read through NV), or the lease files' when NVML
    is unusable (None)."""
    from ..lease.sharing import MPS

    lease_dir = str(layout.lease_dir)
    table, held, apart, sharing, lease_files = leases
    devices: List[Dict[str, Any]] = []
    if inventory is not None:
        from ..sched.filters import product

        for d in inventory.devices:
            holder = _holder(held, d.uuid)
            shares = _shares(held, d.uuid, sharing.slots_for(d.uuid, d.parent_uuid), apart.get(d.uuid, ()))
            # With the holder unknown its processes cannot be told from others': unknown too.
            unknown = d.pids is None or (holder is not None and holder["pid"] is None)
            foreign = None if unknown else foreign_pids(lease_dir, d.uuid, d.pids)
            readings, memory = _readings(d.uuid, nv)
            devices.append({
                "uuid": d.uuid, "name": d.name, "gpu_index": d.gpu_index, "parent": d.parent_uuid,
                "mig_slot": d.mig_slot, "memory_used_mib": d.memory_used_mib,
                "memory_total_mib": d.memory_total_mib, "lease_file": d.uuid in lease_files,
                "holder": holder, "foreign_pids": foreign, "shares": shares,
                "slots_apart": [_named(pid, [d.uuid]) for pid in apart.get(d.uuid, ())],
                "mps_without_share": (_mps_without_share(str(layout.root), lease_dir, d.uuid, d.pids, table)
                                      if sharing.mode == MPS else []),
                "slots": sharing.slots_for(d.uuid, d.parent_uuid),
                "index": d.gpu_index, "product": product(d, inventory),
                "mig_profile": d.name if d.is_mig else None, **readings,
                "processes": _processes(d.pids, holder, memory, shares), "waiters": [], "drains": []})
    else:
        for uuid in sorted(lease_files):
            holder = _holder(held, uuid)
            devices.append({"uuid": uuid, "name": "?", "gpu_index": -1, "parent": "?", "mig_slot": None,
                            "memory_used_mib": 0, "memory_total_mib": 0, "lease_file": True,
                            "holder": holder, "foreign_pids": None,
                            "shares": _shares(held, uuid, sharing.slots_for(uuid), apart.get(uuid, ())),
                            "slots_apart": [_named(pid, [uuid]) for pid in apart.get(uuid, ())], "mps_without_share": [],
                            "slots": sharing.slots_for(uuid),
                            "index": None, "product": None, "mig_profile": None, **_NO_READINGS,
                            "processes": None, "waiters": [], "drains": []})
    return devices


def _add_drains(root: str, devices: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The admin's drains (uuid -> reason, by, at), each device given the one covering it."""
    from ..sched.drains import covering, drained

    found = drained(root)
    drains = {u: {"reason": d.reason, "by": d.by, "at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(d.at))}
              for u, d in found.items()}
    for device in devices:  # which drain covers each device, if any (a GPU's covers its MIG instances)
        cover = covering(found, device["uuid"], device["parent"])
        device["drains"] = [dict(drains[cover], uuid=cover)] if cover else []
    return drains


def _add_health(root: str, devices: List[Dict[str, Any]], me: Optional[str] = None) -> None:
    """Each device's leftover processes of ended runs, and its lease if idle (the monitor's
    look); where ME is given (private_status), others' leftovers without who or what."""
    from ..health.state import idle_leases, leftovers

    left = leftovers(root, me)  # processes of ended runs still on a device (the monitor's look)
    quiet, idle_after_s, sampled = idle_leases(root)
    for device in devices:
        device["leftovers"] = left.get(device["uuid"], [])
        lease = quiet.get(device["uuid"])
        device["idle"] = None if lease is None or lease.idle_s(sampled) < idle_after_s or not device["holder"] \
            or device["holder"]["pid"] not in (lease.pid, None) else {
                "idle_s": round(lease.idle_s(sampled)), "pid": lease.pid, "user": lease.user, "basis": lease.basis}


def _run_memory(layout: Layout, devices: List[Dict[str, Any]]) -> None:
    """Each named holder's "memory" on its device (used and limit, MiB) from the monitor's last
    memory snapshot, where it is recent (memwatch)."""
    from ..memory.snapshot import read_snapshot

    snapshot = read_snapshot(layout)
    if snapshot is None:
        return
    found = {(r.get("pid"), r.get("device")): r for r in snapshot.get("runs", [])}
    for device in devices:
        shares = device.get("shares") or {}
        for holder in [device.get("holder"), *shares.get("holders", [])]:
            row = found.get((holder.get("pid"), device["uuid"])) if holder else None
            if row is not None:
                holder["memory"] = {"used_mib": row.get("used_mib"), "limit_mib": row.get("limit_mib")}
