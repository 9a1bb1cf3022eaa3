"""Each run's GPU memory, and the limit of a shared run: one step per monitor cycle.

A run is one lease (or one share) and the processes behind it: its holder, the holder's
descendants, and any process holding the run's lock file through a descriptor (a worker that
left its parent keeps the lease open). What a run uses on a device is the sum of NVML's
per-process used memory over those processes. Time-slicing gives no memory isolation, so a
shared run over its share (``[sharing] memory_limit_mib``, by default the device's memory
over its slots) is warned at 90 % and, with ``memory_action = "terminate"``, ended once it
stayed over for ``grace_s``: SIGTERM, then SIGKILL after ``kill_after_s``. Exclusive runs are
never limited. Under MPS the pinned limit stops the overrun itself; this only bounds the
damage and names the culprit.

Called by the monitor (``Watch.cycle``), and by whatever runs that loop later; the
decisions (``decide``) are pure over what one cycle saw.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from ..paths import Layout
from .terminal import tell

log = logging.getLogger(__name__)

WARN_AT = 0.9  # of the limit: the holder is told before anything happens
ACTIONS = ("warn", "terminate")
# A first release only warns: a limit that was always advisory must not start ending runs on
# an upgrade; an admin who wants it enforced says so.
DEFAULT_ACTION = "warn"
DEFAULT_GRACE_S = 5.0
DEFAULT_KILL_AFTER_S = 10.0
MEMORY_KEYS = ("memory_limit_mib", "memory_action", "grace_s", "kill_after_s")
SNAPSHOT = "memory.json"  # in the runtime directory: what status and the metrics show
MIB = 1 << 20
GIB_MIB = 1024


# --- what one cycle sees --------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One lease or share: its holder and the lock files that make it one."""

    pid: int
    uid: int
    program: str
    devices: Tuple[str, ...]
    shared: Tuple[str, ...]  # those of DEVICES it holds a share of (the others whole)
    files: Tuple[Tuple[int, int], ...]  # (st_dev, st_ino) of its lease or slot files


@dataclass(frozen=True)
class Limit:
    limit_mib: int  # 0: none
    action: str
    grace_s: float
    kill_after_s: float


def owner(pid: int, parents: Mapping[int, int], holders: Mapping[int, int]) -> Optional[int]:
    """The holder (a key of HOLDERS, pid -> itself) PID descends from, or None. PARENTS: pid -> ppid."""
    seen: Set[int] = set()
    while pid and pid not in seen:
        if pid in holders:
            return pid
        seen.add(pid)
        pid = parents.get(pid, 0)
    return None


def account(process_memory: Mapping[str, Mapping[int, Optional[int]]],
            member_of: Mapping[int, int]) -> Dict[int, Dict[str, int]]:
    """holder pid -> device -> MiB used: PROCESS_MEMORY (device -> pid -> MiB, None where
    the driver hides it) summed over each run's members (MEMBER_OF: pid -> holder pid)."""
    out: Dict[int, Dict[str, int]] = {}
    for uuid, by_pid in process_memory.items():
        for pid, mib in by_pid.items():
            holder = member_of.get(pid)
            if holder is not None and mib is not None:
                used = out.setdefault(holder, {})
                used[uuid] = used.get(uuid, 0) + mib
    return out


def _pick(layers: Sequence[Mapping[str, Any]], key: str, default: Any) -> Any:
    for layer in layers:
        if key in layer:
            return layer[key]
    return default


def limit_for(sharing: Mapping[str, Any], device_tables: Mapping[str, Mapping[str, Any]],
              programs: Mapping[str, Mapping[str, Any]], uuid: str, parent: str, program: str,
              total_mib: Optional[int], slots: int) -> Limit:
    """The limit of one share of UUID (a MIG instance also matches by its GPU PARENT) for a
    run of PROGRAM: the program's keys, then the device's (longest prefix), then [sharing]'s;
    the memory limit by default the device's memory over its SLOTS. Plain values. Pure."""
    device = next((t for name, t in sorted(device_tables.items(), key=lambda i: -len(i[0]))
                   if uuid.startswith(name) or (parent and parent.startswith(name))), {})
    layers = [programs.get(program, {}), device, sharing]
    limit = _pick(layers, "memory_limit_mib", None)
    if limit is None:
        limit = (total_mib // max(slots, 1)) if total_mib else 0
    return Limit(int(limit), _pick(layers, "memory_action", DEFAULT_ACTION),
                 float(_pick(layers, "grace_s", DEFAULT_GRACE_S)),
                 float(_pick(layers, "kill_after_s", DEFAULT_KILL_AFTER_S)))


@dataclass
class Track:
    """What the watch remembers of one shared run on one device between cycles."""

    warned: bool = False
    over_since: Optional[float] = None
    term_at: Optional[float] = None
    killed: bool = False
    reported: bool = False  # "over, but only warned" said once


@dataclass(frozen=True)
class Action:
    kind: str  # "warn", "over" (over the limit, warn only), "term", "kill"
    pid: int
    uuid: str
    used_mib: int
    limit: Limit


def decide(track: Track, pid: int, uuid: str, used_mib: int, limit: Limit, now: float) -> List[Action]:
    """What to do about one shared run using USED_MIB of UUID now; updates TRACK. Pure but for TRACK."""
    if limit.limit_mib <= 0:
        return []
    out: List[Action] = []
    if used_mib >= WARN_AT * limit.limit_mib and not track.warned:
        track.warned = True
        out.append(Action("warn", pid, uuid, used_mib, limit))
    if used_mib <= limit.limit_mib:
        if track.term_at is None:
            track.over_since = None  # back inside its share before anything was done
        return out
    if track.over_since is None:
        track.over_since = now
    if now - track.over_since < limit.grace_s:
        return out
    if limit.action != "terminate":
        if not track.reported:
            track.reported = True
            out.append(Action("over", pid, uuid, used_mib, limit))
        return out
    if track.term_at is None:
        track.term_at = now
        out.append(Action("term", pid, uuid, used_mib, limit))
    elif not track.killed and now - track.term_at >= limit.kill_after_s:
        track.killed = True
        out.append(Action("kill", pid, uuid, used_mib, limit))
    return out


def gib(mib: float) -> str:
    return f"{mib / GIB_MIB:.1f}"


def ended_line(program: str, pid: int, user: str, used_mib: int, limit_mib: int) -> str:
    """The line the audit log and the ledger keep: "recon (pid 4242, alice) ended: 43.2 GiB on a 40 GiB share"."""
    return f"{program} (pid {pid}, {user}) ended: {gib(used_mib)} GiB on a {limit_mib / GIB_MIB:g} GiB share"


def limit_problems(config: Any, devices: Iterable[Any]) -> List[str]:
    """A line for each memory_limit_mib above the memory of a shared device it applies to
    (CONFIG: a loaded Config; DEVICES: the inventory's). Such a share is never held back. Pure."""
    sharing = config.sharing
    slots = sorted(((n, s.value) for n, s in sharing["devices"].items()), key=lambda i: -len(i[0]))
    tables = sharing.get("device_memory", {})
    out = []
    for d in devices:
        matches = [n for n, _s in slots if d.uuid.startswith(n) or d.parent_uuid.startswith(n)]
        count = dict(slots)[matches[0]] if matches else sharing["slots"].value
        if count <= 1 or not d.memory_total_mib:
            continue
        found = [("[sharing]", sharing["memory_limit_mib"].value)] if "memory_limit_mib" in sharing else []
        found += [(f'[sharing.devices."{n}"]', t["memory_limit_mib"].value) for n, t in sorted(tables.items())
                  if "memory_limit_mib" in t and (d.uuid.startswith(n) or d.parent_uuid.startswith(n))]
        found += [(f'[programs."{n}"]', t["memory_limit_mib"].value) for n, t in sorted(config.programs.items())
                  if "memory_limit_mib" in t]
        out += [f"memory_limit_mib = {limit} in {where} is above the {d.memory_total_mib} MiB of {d.uuid}: "
                f"a share there is never held back" for where, limit in found if limit > d.memory_total_mib]
    return out


# --- reading the machine --------------------------------------------------------------------


def _parents() -> Dict[int, int]:
    """pid -> ppid of every process."""
    from ..proc import parent

    out: Dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            ppid = parent(int(name))
            if ppid is not None:
                out[int(name)] = ppid
    return out


def runs(layout: Layout) -> List[Run]:
    """Every lease and share held now, from the kernel's lock table."""
    from ..lease.holders import _locked, holdings
    from ..lease.files import lock_table
    from .ledger import proc

    table = lock_table()
    found: Dict[int, Dict[str, Any]] = {}

    def add(pid: Optional[int], uuid: str, shared: bool, key: Tuple[int, int]) -> None:
        if pid is not None:
            entry = found.setdefault(pid, {"devices": set(), "shared": set(), "files": set()})
            entry["devices"].add(uuid)
            entry["files"].add(key)
            if shared:
                entry["shared"].add(uuid)

    leases = {name: key for key, name in _locked(str(layout.lease_dir), table).items()}
    for uuid, holding in holdings(str(layout.lease_dir), table).items():
        if holding.exclusive:
            add(holding.pid, uuid, False, leases[uuid])
    slots = {name: key for key, name in _locked(str(layout.share_dir), table).items()}
    for name, holding in holdings(str(layout.share_dir), table).items():
        add(holding.pid, name.rpartition(".")[0], True, slots[name])
    out = []
    for pid, entry in sorted(found.items()):
        devices = tuple(sorted(entry["devices"]))
        p = proc(pid, devices)
        if p is not None:
            out.append(Run(pid, p.uid, p.program, devices, tuple(sorted(entry["shared"])),
                           tuple(sorted(entry["files"]))))
    return out


def members(gpu_pids: Iterable[int], held: Sequence[Run]) -> Dict[int, int]:
    """pid -> holder pid for each of GPU_PIDS (NVML's processes) that belongs to a run: a
    descendant of its holder, or a process holding one of its lock files."""
    from ..lease.holders import fd_holders

    holders = {r.pid: r.pid for r in held}
    parents = _parents()
    out: Dict[int, int] = {}
    strays = []
    for pid in gpu_pids:
        found = owner(pid, parents, holders)
        if found is not None:
            out[pid] = found
        else:
            strays.append(pid)
    if strays:
        by_file = {key: r.pid for r in held for key in r.files}
        for key, pids in fd_holders(by_file, strays).items():
            for pid in pids:
                out.setdefault(pid, by_file[key])
    return out


def process_memory(uuids: Iterable[str]) -> Dict[str, Dict[int, Optional[int]]]:
    """device -> pid -> MiB NVML says each compute process uses (None where it hides it)."""
    from ..devices import nvml

    out: Dict[str, Dict[int, Optional[int]]] = {}
    uuids = list(uuids)
    if not uuids:
        return out
    nv = nvml.init()
    for uuid in uuids:
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByUUID(uuid))
        except nv.NVMLError:
            continue
        out[uuid] = {}
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            out[uuid][int(p.pid)] = None if used is None else int(used) // MIB
    return out


# --- the step -----------------------------------------------------------------------------------


@dataclass
class Watch:
    """The per-cycle step; keeps what it decided between cycles."""

    layout: Layout
    tracks: Dict[Tuple[int, str], Track] = field(default_factory=dict)
    _ended: Dict[int, str] = field(default_factory=dict)  # holder pid -> why it was ended
    _signature: Any = None
    _config: Any = None
    _problem: Optional[str] = None  # the config's, said once

    def cycle(self, inventory: Any = None) -> Dict[str, Any]:
        """Account every run, act on the shared ones over their share, write the snapshot.
        Returns the snapshot. Raises nothing for a broken config: the launch reports it."""
        from ..devices import nvml
        from ..errors import CudawrapError

        now = time.time()
        held = runs(self.layout)
        if held and inventory is None:
            inventory = nvml.inventory()  # only while something is held: an idle machine costs nothing
        devices = {d.uuid: d for d in inventory.devices} if held else {}
        usage = process_memory(u for u in devices if any(u in r.devices for r in held))
        member_of = members({pid for by_pid in usage.values() for pid in by_pid}, held)
        used = account(usage, member_of)
        try:
            settings = self._settings()
        except CudawrapError as exc:
            if exc.message != self._problem:
                log.warning("memory limits not applied: %s", exc.message)
            self._problem, settings = exc.message, None
        rows = []
        alive: Set[Tuple[int, str]] = set()
        for run in held:
            procs = sorted(p for p, h in member_of.items() if h == run.pid)
            for uuid in run.devices:
                d = devices.get(uuid)
                row = {"pid": run.pid, "uid": run.uid, "program": run.program, "device": uuid,
                       "shared": uuid in run.shared, "used_mib": used.get(run.pid, {}).get(uuid, 0),
                       "processes": procs, "limit_mib": None}
                if row["shared"] and settings is not None and d is not None:
                    limit = self._limit(settings, d, run.program)
                    row["limit_mib"] = limit.limit_mib or None
                    track = self.tracks.setdefault((run.pid, uuid), Track())
                    alive.add((run.pid, uuid))
                    for action in decide(track, run.pid, uuid, row["used_mib"], limit, now):
                        self._act(action, run, procs)
                rows.append(row)
        for key in set(self.tracks) - alive:
            del self.tracks[key]
        self._ledger(rows, now)
        self._ended = {pid: why for pid, why in self._ended.items() if any(r.pid == pid for r in held)}
        snapshot = {"time": now, "runs": rows}
        self._write(snapshot)
        return snapshot

    # -- settings
    def _settings(self) -> Dict[str, Any]:
        from ..policy.config import load_config
        from .signature import file_signature

        path = self.layout.config_file
        signature = file_signature(path)
        if signature != self._signature or self._config is None:
            config = load_config(path)
            sharing = {k: s.value for k, s in config.sharing.items() if k in MEMORY_KEYS}
            tables = {n: {k: s.value for k, s in t.items()}
                      for n, t in config.sharing.get("device_memory", {}).items()}
            programs = {n: {k: s.value for k, s in t.items() if k in MEMORY_KEYS}
                        for n, t in config.programs.items()}
            slots = {n: s.value for n, s in config.sharing["devices"].items()}
            self._config = {"sharing": sharing, "devices": tables, "programs": programs, "slots": slots,
                            "default_slots": config.sharing["slots"].value}
            self._signature = signature
        return self._config

    def _limit(self, settings: Mapping[str, Any], d: Any, program: str) -> Limit:
        slots = next((n for name, n in sorted(settings["slots"].items(), key=lambda i: -len(i[0]))
                      if d.uuid.startswith(name) or d.parent_uuid.startswith(name)), settings["default_slots"])
        return limit_for(settings["sharing"], settings["devices"], settings["programs"], d.uuid,
                         d.parent_uuid, program, d.memory_total_mib, slots)

    # -- effects
    def _act(self, action: Action, run: Run, procs: Sequence[int]) -> None:
        from ..base import audit
        from ..users import user_name

        user = user_name(run.uid)
        used, limit = gib(action.used_mib), gib(action.limit.limit_mib)
        if action.kind == "warn":
            text = (f"cudawrap: {run.program} (pid {run.pid}) uses {used} GiB of its {limit} GiB share of "
                    f"{action.uuid}; above {limit} GiB for {action.limit.grace_s:g} s it "
                    + ("is ended" if action.limit.action == "terminate" else "is reported"))
            audit.log("memory-warning", "warning", pid=run.pid, holder=user, program=run.program,
                      device=action.uuid, used_mib=action.used_mib, limit_mib=action.limit.limit_mib)
            log.warning("%s (%s)", text, user)
            tell(run.pid, run.uid, text)
        elif action.kind == "over":
            audit.log("memory-over", "warning", pid=run.pid, holder=user, program=run.program,
                      device=action.uuid, used_mib=action.used_mib, limit_mib=action.limit.limit_mib)
            log.warning("%s (pid %d, %s) uses %s GiB on a %s GiB share of %s (memory_action = \"warn\")",
                        run.program, run.pid, user, used, limit, action.uuid)
        else:
            line = ended_line(run.program, run.pid, user, action.used_mib, action.limit.limit_mib)
            if action.kind == "term":
                audit.log("memory-terminate", "warning", pid=run.pid, holder=user, program=run.program,
                          device=action.uuid, used_mib=action.used_mib, limit_mib=action.limit.limit_mib,
                          why=line)
                log.warning("%s", line)
                self._ended[run.pid] = line
                tell(run.pid, run.uid, f"cudawrap: {line}")
            else:
                log.warning("%s (pid %d, %s) still runs %g s after SIGTERM: SIGKILL", run.program, run.pid, user,
                            action.limit.kill_after_s)
            _signal(run, procs, signal.SIGTERM if action.kind == "term" else signal.SIGKILL)

    def _ledger(self, rows: Sequence[Mapping[str, Any]], now: float) -> None:
        """Peak memory, MiB-seconds and why a run was ended, on its open ledger record: the
        end record carries them (`cudawrap usage`)."""
        from . import ledger

        by_pid: Dict[int, int] = {}
        for row in rows:
            by_pid[row["pid"]] = by_pid.get(row["pid"], 0) + row["used_mib"]
        try:
            with ledger.Locked(self.layout):
                path = self.layout.state_dir / ledger.STATE
                state = ledger._load_state(path)
                changed = False
                for record in state["open"].values():
                    pid = record.get("pid")
                    if pid not in by_pid:
                        continue
                    mib = by_pid[pid]
                    last = record.get("memory_at")
                    if last is not None:
                        record["memory_mib_s"] = round(record.get("memory_mib_s", 0.0)
                                                       + mib * max(now - last, 0.0), 1)
                    record["memory_at"] = now
                    record["memory_peak_mib"] = max(record.get("memory_peak_mib", 0), mib)
                    if pid in self._ended:
                        record["memory_ended"] = self._ended[pid]
                    changed = True
                if changed:
                    ledger._save_state(path, state)
        except OSError as exc:
            log.warning("cannot record memory in the ledger: %s", exc.strerror or exc)

    def _write(self, snapshot: Mapping[str, Any]) -> None:
        from ..base.safepath import create_new

        directory = str(self.layout.runtime_dir)
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return
        try:
            tmp = create_new(dfd, f".{SNAPSHOT}.", json.dumps(snapshot).encode(), suffix=".tmp")
            os.replace(tmp, SNAPSHOT, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError as exc:
            log.warning("cannot write %s/%s: %s", directory, SNAPSHOT, exc.strerror or exc)
        finally:
            os.close(dfd)


def _signal(run: Run, procs: Sequence[int], signum: int) -> None:
    """SIGNUM to the run's holder and every process of it on a GPU, each checked to still be
    the run's (a pid is re-read as the run's user's process right before)."""
    from ..proc import real_uid

    for pid in dict.fromkeys([run.pid, *procs]):
        if real_uid(pid) == run.uid:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def read_snapshot(layout: Layout, max_age: float = 10.0) -> Optional[Dict[str, Any]]:
    """The last cycle's snapshot if it is recent (root's file; None otherwise)."""
    path = layout.runtime_dir / SNAPSHOT
    try:
        st = os.stat(path)
        if st.st_uid != 0 and st.st_uid != os.geteuid():
            return None
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or time.time() - float(data.get("time", 0)) > max_age:
        return None
    return data

