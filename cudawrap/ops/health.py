"""GPU health: drain a GPU that reports a reset-class error, resume it once it is clear again.

The monitor calls `HealthKeeper.cycle()` once per cycle (a service can call it the same way).
What it sees each cycle: the NVML events since the last (XID critical errors, double-bit
ECC) and the conditions that persist (a GPU lost to NVML, row remapping pending or failed).
`step()` turns that, the state so far and the [health] settings into transitions; it is pure.
Only `HealthKeeper` has effects: the health drain (drains.py, apart from an admin's), an
audit line, and the state file `cudawrap health` and the metrics read.

A drain covers the GPU and its MIG instances (an XID is the board's); its current holders
are left to finish. A health-drained GPU is resumed once its condition has been clear for
`recover_after_s`: no condition reported and no new drain-class event in that time.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .. import locations as loc
from ..base import rootfile
from ..policy.healthconf import XID_NAMES

log = logging.getLogger(__name__)

HEALTH_STATE = loc.RUNTIME_DIR + "/health.state"
STATE_VERSION = 1
HISTORY = 20  # events kept per GPU: a storm must not grow memory
MAX_EVENTS_PER_CYCLE = 2000  # the rest wait in the driver's queue for the next cycle

HEALTHY = "healthy"
DRAINED = "drained"

# nvmlEventType bits (nvml.h)
EVENT_DBE = 0x2
EVENT_XID = 0x8


@dataclass(frozen=True)
class Event:
    """One NVML event: KIND "xid" (with its number) or "dbe", on the GPU UUID, at AT."""

    uuid: str
    kind: str
    xid: int
    at: float
    instance: Optional[int] = None  # the GPU instance id, for an event in a MIG instance

    def describe(self) -> str:
        if self.kind == "dbe":
            return "double-bit ECC error"
        name = XID_NAMES.get(self.xid)
        return f"Xid {self.xid} ({name})" if name else f"Xid {self.xid} (not in the catalog)"


@dataclass(frozen=True)
class Policy:
    drain_xids: Tuple[int, ...]
    ignore_xids: Tuple[int, ...]
    unknown_xid: str  # "drain" or "ignore"
    recover_after_s: float
    leftover_action: str = "report"
    leftover_grace_s: float = 60.0
    idle_after_s: float = 1800.0
    idle_action: str = "report"

    @classmethod
    def from_config(cls, config: Any) -> "Policy":
        return cls(tuple(config["drain_xids"]), tuple(config["ignore_xids"]), config["unknown_xid"],
                   float(config["recover_after_s"]), config["leftover_action"], float(config["leftover_grace_s"]),
                   60.0 * float(config["idle_after_min"]), config["idle_action"])

    def drains(self, event: Event) -> bool:
        if event.kind == "dbe":
            return True
        if event.xid in self.drain_xids:
            return True
        if event.xid in self.ignore_xids:
            return False
        return self.unknown_xid == "drain"


@dataclass
class GpuHealth:
    """What is known of one GPU: its state, why, since when, and its last events."""

    uuid: str
    state: str = HEALTHY
    reason: str = ""
    since: float = 0.0
    last_bad: float = 0.0  # the last time its condition was seen (event or persisting)
    condition: str = ""  # what persists now ("" when nothing)
    events: Deque[Tuple[float, str, bool]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    notes: str = ""  # what is worth knowing but drains nothing (thermal slowdown)

    def to_tuple(self) -> tuple:
        return (self.uuid, self.state, self.reason, self.since, self.last_bad, self.condition,
                tuple(self.events), self.notes)

    @classmethod
    def from_tuple(cls, t: Sequence[Any]) -> "GpuHealth":
        uuid, state, reason, since, last_bad, condition, events, notes = t
        out = cls(str(uuid), str(state), str(reason), float(since), float(last_bad), str(condition),
                  notes=str(notes))
        out.events.extend((float(a), str(w), bool(d)) for a, w, d in events)
        return out


@dataclass(frozen=True)
class Transition:
    uuid: str
    to: str  # DRAINED or HEALTHY
    reason: str
    at: float


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def step(gpus: Dict[str, GpuHealth], events: Iterable[Event], conditions: Mapping[str, str],
         now: float, policy: Policy) -> List[Transition]:
    """Apply this cycle's EVENTS and persisting CONDITIONS (GPU UUID -> words) to GPUS, in
    place; the transitions that follow, at most one per GPU."""
    first: Dict[str, str] = {}  # uuid -> what drains it this cycle
    for event in events:
        gpu = gpus.setdefault(event.uuid, GpuHealth(event.uuid))
        drains = policy.drains(event)
        gpu.events.append((event.at, event.describe(), drains))
        if drains:
            gpu.last_bad = max(gpu.last_bad, event.at)
            first.setdefault(event.uuid, f"{event.describe()} at {_clock(event.at)}")
        elif event.kind == "xid" and event.xid not in policy.ignore_xids:
            log.warning("GPU %s: %s is not in [health] drain_xids or ignore_xids; unknown_xid = ignore",
                        event.uuid, event.describe())
    for uuid, gpu in gpus.items():
        gpu.condition = conditions.get(uuid, "")
        if gpu.condition:
            gpu.last_bad = now
            first.setdefault(uuid, f"{gpu.condition} at {_clock(now)}")
    out: List[Transition] = []
    for uuid, gpu in sorted(gpus.items()):
        if gpu.state == HEALTHY and uuid in first:
            gpu.state, gpu.reason, gpu.since = DRAINED, "health: " + first[uuid], now
            out.append(Transition(uuid, DRAINED, gpu.reason, now))
        elif gpu.state == DRAINED and not gpu.condition and now - gpu.last_bad >= policy.recover_after_s:
            reason = f"clear for {now - gpu.last_bad:.0f} s (recover_after_s = {policy.recover_after_s:g})"
            gpu.state, gpu.reason, gpu.since = HEALTHY, "", now
            out.append(Transition(uuid, HEALTHY, reason, now))
    return out


def comes_back(gpu: GpuHealth, policy: Policy, now: float) -> str:
    """What will bring a drained GPU back, in words."""
    if gpu.state != DRAINED:
        return ""
    if gpu.condition:
        return (f"once {gpu.condition!s} clears (a GPU reset or reboot) and stays clear "
                f"{policy.recover_after_s:g} s")
    left = policy.recover_after_s - (now - gpu.last_bad)
    return f"by itself in {max(left, 0):.0f} s if no new error comes (recover_after_s = {policy.recover_after_s:g})"


# --- the state file: `cudawrap health` and the metrics read it ---------------------------


def save(root: str, gpus: Mapping[str, GpuHealth], policy: Policy, now: float,
         leftovers: Sequence[Any] = (), idle: Optional[Mapping[str, Any]] = None) -> None:
    rootfile.write(loc.under(root, HEALTH_STATE), {
        "version": STATE_VERSION, "written": now,
        "gpus": [g.to_tuple() for g in gpus.values()],
        "back": {u: comes_back(g, policy, now) for u, g in gpus.items()},
        "leftovers": [left.to_tuple() for left in leftovers],
        "idle": {u: lease.to_tuple() for u, lease in (idle or {}).items()}, "idle_after_s": policy.idle_after_s,
    })


def load(root: str) -> Tuple[Dict[str, GpuHealth], Dict[str, str], float]:
    """The GPUs' health as the monitor last wrote it, what brings each back, and when written."""
    data = rootfile.read(root, loc.under(root, HEALTH_STATE), STATE_VERSION)
    if data is None:
        return {}, {}, 0.0
    try:
        gpus = {g.uuid: g for g in (GpuHealth.from_tuple(t) for t in data["gpus"])}
        return gpus, {str(k): str(v) for k, v in data["back"].items()}, float(data["written"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return {}, {}, 0.0


def idle_leases(root: str) -> Tuple[Dict[str, Any], float, float]:
    """Held device UUID -> idle.Lease as the monitor last sampled it, idle_after_s, and when."""
    from .idle import Lease

    data = rootfile.read(root, loc.under(root, HEALTH_STATE), STATE_VERSION)
    try:
        return ({str(u): Lease(*t) for u, t in (data or {}).get("idle", {}).items()},
                float((data or {}).get("idle_after_s", 0.0)), float((data or {}).get("written", 0.0)))
    except (TypeError, ValueError, AttributeError):
        return {}, 0.0, 0.0


def leftover_list(root: str) -> List[Any]:
    """The leftover processes (leftovers.Leftover) as the monitor last saw them."""
    from .leftovers import Leftover

    data = rootfile.read(root, loc.under(root, HEALTH_STATE), STATE_VERSION)
    try:
        return [Leftover(*t) for t in (data or {}).get("leftovers", ())]
    except (TypeError, ValueError):
        return []


def leftovers(root: str) -> Dict[str, List[str]]:
    """Device UUID -> its leftover processes as the monitor last saw them, in words."""
    out: Dict[str, List[str]] = {}
    for left in leftover_list(root):
        out.setdefault(left.uuid, []).append(left.describe())
    return out


# --- what NVML says: events and persisting conditions ------------------------------------


class Watch:
    """An NVML event set over every GPU, kept open across cycles (NVML stays initialised)."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._set: Any = None
        self._registered: Dict[str, Any] = {}  # GPU UUID -> handle

    def _open(self) -> bool:
        if self._set is not None:
            return True
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._set = pynvml.nvmlEventSetCreate()
        except Exception as exc:  # the library or the call may be missing: no events then
            log.debug("no NVML events: %s", exc)
            self._close()
            return False
        return True

    def _close(self) -> None:
        if self._nvml is not None:
            try:
                if self._set is not None:
                    self._nvml.nvmlEventSetFree(self._set)
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._nvml, self._set, self._registered = None, None, {}

    def register(self, gpu_uuids: Iterable[str]) -> None:
        """Listen to the GPUs not yet registered (a GPU may come back after a reset)."""
        if not self._open():
            return
        nv = self._nvml
        for uuid in gpu_uuids:
            if uuid in self._registered:
                continue
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(uuid)
                wanted = (EVENT_XID | EVENT_DBE) & nv.nvmlDeviceGetSupportedEventTypes(handle)
                if wanted:
                    nv.nvmlDeviceRegisterEvents(handle, wanted, self._set)
                self._registered[uuid] = handle
            except nv.NVMLError as exc:
                log.debug("GPU %s: no events: %s", uuid, exc)

    def events(self, now: float) -> List[Event]:
        """The events waiting now, without waiting; at most MAX_EVENTS_PER_CYCLE."""
        if self._set is None:
            return []
        nv = self._nvml
        out: List[Event] = []
        while len(out) < MAX_EVENTS_PER_CYCLE:
            try:
                data = nv.nvmlEventSetWait_v2(self._set, 0)
            except nv.NVMLError:  # NVML_ERROR_TIMEOUT: nothing more now
                break
            uuid = self._uuid_of(data.device)
            if uuid is None:
                continue
            kind = "dbe" if data.eventType & EVENT_DBE else "xid"
            gi = data.gpuInstanceId if data.gpuInstanceId != 0xFFFFFFFF else None
            out.append(Event(uuid, kind, int(data.eventData), now, gi))
        return out

    def _uuid_of(self, device: Any) -> Optional[str]:
        import ctypes

        key = ctypes.cast(device, ctypes.c_void_p).value
        for uuid, handle in self._registered.items():
            if ctypes.cast(handle, ctypes.c_void_p).value == key:
                return uuid
        return None

    def utilization(self, uuid: str) -> Optional[int]:
        """A whole GPU's utilisation %, or None where NVML gives none (MIG mode, no driver)."""
        if not self._open():
            return None
        nv = self._nvml
        try:
            return int(nv.nvmlDeviceGetUtilizationRates(nv.nvmlDeviceGetHandleByUUID(uuid)).gpu)
        except nv.NVMLError:
            return None

    def conditions(self, gpu_uuids: Iterable[str], lost: Iterable[str]) -> Tuple[Dict[str, str], Dict[str, str]]:
        """GPU UUID -> what persists that keeps it drained; and -> notes (clock slowdowns)."""
        out = {u: "GPU is lost to the driver (fallen off the bus)" for u in lost}
        notes: Dict[str, str] = {}
        if not self._open():
            return out, notes
        nv = self._nvml
        for uuid in gpu_uuids:
            if uuid in out:
                continue
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(uuid)
            except nv.NVMLError:
                continue
            rows = _query(nv, nv.nvmlDeviceGetRemappedRows, handle)
            if rows is not None and rows[3]:
                out[uuid] = "row remapping failed (the GPU needs service)"
            elif rows is not None and rows[2]:
                out[uuid] = "row remapping pending (a GPU reset applies it)"
            reasons = _query(nv, nv.nvmlDeviceGetCurrentClocksEventReasons, handle)
            if reasons:
                slow = [w for bit, w in SLOWDOWNS if reasons & bit]
                if slow:
                    notes[uuid] = "clocks slowed: " + ", ".join(slow)
        return out, notes


# nvmlClocksEventReason bits worth telling an admin about (not a reason to drain)
SLOWDOWNS = ((0x8, "hardware slowdown"), (0x20, "software thermal slowdown"),
             (0x40, "hardware thermal slowdown"), (0x80, "power brake"))


def _query(nv: Any, call: Any, handle: Any) -> Any:
    """CALL(HANDLE), or None where the GPU or driver does not support it."""
    try:
        return call(handle)
    except (nv.NVMLError, AttributeError):
        return None


# --- the monitor's part -------------------------------------------------------------------


class HealthKeeper:
    """Once per monitor cycle: read events and conditions, drain or resume, record it all."""

    def __init__(self, root: str, watch: Optional[Watch] = None, notes: Any = None) -> None:
        self.root = root
        self.watch = watch if watch is not None else Watch()
        self.notes = notes  # ledger.Notes: each transition goes into the ledger too
        self.by_index: Dict[int, str] = {}
        self.leftovers: Sequence[Any] = ()  # this cycle's leftover processes (leftovers.py), saved with the rest
        self.idle: Dict[str, Any] = {}  # this cycle's held devices and how long each has been quiet (idle.py)
        self.gpus: Dict[str, GpuHealth] = self._restore()

    def _restore(self) -> Dict[str, GpuHealth]:
        """The state so far: the file, and the health drains (which outlive a reboot)."""
        from ..sched.drains import health_drained

        gpus, _, _ = load(self.root)
        for uuid, drain in health_drained(self.root).items():
            gpu = gpus.setdefault(uuid, GpuHealth(uuid))
            if gpu.state != DRAINED:
                gpu.state, gpu.reason, gpu.since = DRAINED, drain.reason, drain.at
                gpu.last_bad = max(gpu.last_bad, drain.at)
        for uuid in [u for u, g in gpus.items() if g.state == DRAINED and u not in health_drained(self.root)]:
            gpus[uuid].state = HEALTHY  # an admin lifted it by hand (edited the drains file)
        return gpus

    def cycle(self, inventory: Any, policy: Policy, now: Optional[float] = None) -> List[Transition]:
        now = time.time() if now is None else now
        gpu_uuids = [g.uuid for g in inventory.gpus] if inventory is not None else []
        self.by_index.update({g.index: g.uuid for g in inventory.gpus} if inventory is not None else {})
        # NVML cannot name a lost GPU ("index N"): the UUID it had when last seen names it.
        lost = [self.by_index.get(int(u[6:]), u) if u.startswith("index ") and u[6:].isdigit() else u
                for u in (inventory.lost if inventory is not None else ())]
        lost = [u for u in lost if u.startswith("GPU-")]
        for uuid in gpu_uuids + lost:
            self.gpus.setdefault(uuid, GpuHealth(uuid))
        self.watch.register(u for u in gpu_uuids if u not in lost)
        events = self.watch.events(now)
        conditions, notes = self.watch.conditions(gpu_uuids, lost)
        transitions = step(self.gpus, events, conditions, now, policy)
        for uuid, gpu in self.gpus.items():
            gpu.notes = notes.get(uuid, "")
        for t in transitions:
            self._apply(t)
        save(self.root, self.gpus, policy, now, self.leftovers, self.idle)
        return transitions

    def _apply(self, t: Transition) -> None:
        from ..base import audit
        from ..sched.drains import health_drain, health_resume

        if t.to == DRAINED:
            health_drain(self.root, t.uuid, t.reason, t.at)
            audit.log("health-drain", "warning", device=t.uuid, reason=t.reason)
            log.warning("GPU %s drained: %s", t.uuid, t.reason)
        else:
            health_resume(self.root, t.uuid)
            audit.log("health-resume", device=t.uuid, reason=t.reason)
            log.warning("GPU %s resumed: %s", t.uuid, t.reason)
        if self.notes is not None:
            self.notes.add("health-drain" if t.to == DRAINED else "health-resume", t.uuid, t.at, reason=t.reason)


class MonitorHealth:
    """The monitor's hook: the [health] settings (re-read when the config changes) and a
    keeper fed the snapshot the monitor has just written."""

    def __init__(self, layout: Any) -> None:
        from .ledger import Notes

        self.layout = layout
        self.notes = Notes(layout)  # transitions, leftovers and idle spells, for the ledger
        self.ledger_limits = (64 << 20, 4)  # [ledger] max_mib and keep, re-read with [health]
        self.keeper = HealthKeeper(str(layout.root), notes=self.notes)
        from .eta import RunLengths

        self.run_lengths = RunLengths(layout)  # for "when will it start", which users cannot read the ledger for
        from .idle import IdleWatch
        from .leftovers import LeftoverWatch

        self.leftover_watch = LeftoverWatch(layout, self.notes)
        self.idle_watch = IdleWatch(self.notes, *idle_leases(str(layout.root))[::2])  # a spell outlives a restart
        self._signature: Any = None
        self.policy: Optional[Policy] = None
        self._reload(strict=True)  # a bad [health] value stops the monitor at start: one line, 78
        self._listen()

    def _listen(self) -> None:
        """Register for events now: NVML delivers only what happens after registration."""
        from ..devices import nvml
        from ..errors import NvmlUnavailable

        try:
            inventory = nvml.inventory()
        except NvmlUnavailable:
            return  # the first cycle with a driver registers
        self.keeper.by_index.update({g.index: g.uuid for g in inventory.gpus})
        self.keeper.watch.register(g.uuid for g in inventory.gpus)

    def _reload(self, strict: bool = False) -> None:
        import os

        from ..policy.config import load_config
        from ..errors import ConfigError

        try:
            st = os.stat(self.layout.config_file)
            signature: Any = (st.st_ino, st.st_size, st.st_mtime_ns)
        except OSError:
            signature = None
        if signature == self._signature and self.policy is not None:
            return
        self._signature = signature
        try:
            config = load_config(self.layout.config_file)
            self.policy = Policy.from_config(config)
            self.ledger_limits = (config["max_mib"] << 20, config["keep"])
        except ConfigError as exc:  # keep the last good settings; the shims say what is wrong
            if strict:
                raise
            log.warning("[health] settings not re-read: %s", exc.message)
            if self.policy is None:
                from ..policy.config import DEFAULTS

                self.policy = Policy.from_config(DEFAULTS)

    def cycle(self, now: Optional[float] = None) -> List[Transition]:
        try:
            return self._cycle(now)
        finally:
            problem = self.notes.flush(self.ledger_limits)
            if problem:
                log.warning("health notes kept for the next cycle: %s", problem)

    def _cycle(self, now: Optional[float]) -> List[Transition]:
        from ..devices import snapshot

        self._reload()
        try:
            self.run_lengths.cycle()
        except OSError as exc:
            log.warning("run lengths not recorded: %s", exc)
        inventory = snapshot.read_fresh(str(self.layout.root))
        if inventory is None:  # no NVML this cycle: nothing to judge the GPUs by
            return []
        assert self.policy is not None
        now = time.time() if now is None else now
        try:
            found = self.leftover_watch.cycle(inventory, self.policy.leftover_action,
                                              self.policy.leftover_grace_s, now)
            self.keeper.leftovers = sorted(found.values(), key=lambda left: (left.uuid, left.pid))
            self.keeper.idle = self.idle_watch.cycle(self.layout, inventory, self.keeper.watch.utilization,
                                                     self.policy.idle_after_s, self.policy.idle_action, now)
            return self.keeper.cycle(inventory, self.policy, now)
        except OSError as exc:  # a full disk must not stop the snapshot: next cycle again
            log.warning("GPU health not recorded: %s", exc)
            return []


# --- `cudawrap health`: what anyone may read -----------------------------------------------


def report(root: str, now: float) -> Dict[str, Any]:
    """Each GPU's health as the monitor last recorded it, for `cudawrap health` (any user)."""
    from ..devices import invcache
    from ..sched.drains import drained

    gpus, back, written = load(root)
    inventory = invcache.read(root)
    index = {g.uuid: g.index for g in inventory.gpus} if inventory is not None else {}
    drains = drained(root)
    left = leftovers(root)
    parents = _parents(inventory)
    rows = []
    for uuid, gpu in sorted(gpus.items(), key=lambda kv: (index.get(kv[0], 1 << 20), kv[0])):
        admin = drains.get(uuid)
        rows.append({
            "uuid": uuid, "index": index.get(uuid), "state": gpu.state, "reason": gpu.reason,
            "since": gpu.since, "condition": gpu.condition, "notes": gpu.notes,
            "back": back.get(uuid, ""),
            "admin_drain": admin.reason if admin is not None and admin.kind != "health" else None,
            "events": [{"at": at, "what": what, "drains": d} for at, what, d in gpu.events],
            "leftovers": [text for u, texts in left.items() if uuid in (u, parents.get(u)) for text in texts],
        })
    return {"written": written, "age_s": now - written if written else None, "gpus": rows}


def _parents(inventory: Any) -> Dict[str, str]:
    return {d.uuid: d.parent_uuid for d in inventory.devices} if inventory is not None else {}


def render(data: Mapping[str, Any]) -> List[str]:
    """`cudawrap health` as text lines."""
    if not data["gpus"]:
        return ["no GPU health recorded: the monitor (`cudawrap monitor`, root) records it every cycle"]
    lines: List[str] = []
    if data["age_s"] is not None and data["age_s"] > 30:
        lines.append(f"note: recorded {data['age_s']:.0f} s ago: is the monitor running?")
    for row in data["gpus"]:
        name = f"GPU {row['index']}" if row["index"] is not None else "GPU"
        state = row["state"].upper()
        lines.append(f"{name} {row['uuid']}: {state}" + (f" ({row['reason']})" if row["reason"] else ""))
        if row["condition"]:
            lines.append(f"  now: {row['condition']}")
        if row["back"]:
            lines.append(f"  back: {row['back']}")
        if row["admin_drain"] is not None:
            lines.append(f"  also drained by an admin ({row['admin_drain']}): `cudawrap resume` lifts that")
        if row["notes"]:
            lines.append(f"  note: {row['notes']}")
        lines += [f"  {text}" for text in row["leftovers"]]
        for event in row["events"][-5:]:
            effect = "drains" if event["drains"] else "changes nothing"
            lines.append(f"  {_clock(event['at'])} {event['what']}: {effect}")
    return lines
