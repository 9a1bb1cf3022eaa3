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

Here is the monitor's part; the rest lives below it, one job a module: the rule
(rule.py, pure), what NVML says (nvml.py), the state file (state.py) and
`cudawrap health`'s report of it (report.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence

# The rule's and the state file's names stay importable from here (the tests, bench/).
from .rule import DRAINED, HEALTHY, HISTORY, Event, GpuHealth, Policy, Transition, comes_back, step  # noqa: F401
from .state import HEALTH_STATE, idle_leases, leftover_list, leftovers, load, save  # noqa: F401
from .nvml import Watch

log = logging.getLogger(__name__)


class HealthKeeper:
    """Once per monitor cycle: read events and conditions, drain or resume, record it all."""

    def __init__(self, root: str, watch: Optional[Watch] = None, notes: Any = None) -> None:
        self.root = root
        self.watch = watch if watch is not None else Watch()
        self.notes = notes  # ledgerfile.Notes: each transition goes into the ledger too
        self.by_index: Dict[int, str] = {}
        self.leftovers: Sequence[Any] = ()  # this cycle's leftover processes (leftovers.py), saved with the rest
        self.idle: Dict[str, Any] = {}  # this cycle's held devices and how long each has been quiet (idle.py)
        self.private = False  # [service] private_status: the state file root's, a copy naming nobody for users
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
        save(self.root, self.gpus, policy, now, self.leftovers, self.idle, self.private)
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

    def __init__(self, layout: Any, strict: bool = True) -> None:
        from ..ledger.files import Notes

        self.layout = layout
        self.notes = Notes(layout)  # transitions, leftovers and idle spells, for the ledger
        self.ledger_limits = (64 << 20, 4)  # [ledger] max_mib and keep, re-read with [health]
        self.keeper = HealthKeeper(str(layout.root), notes=self.notes)
        from ..ledger.eta import RunLengths

        self.run_lengths = RunLengths(layout)  # for "when will it start", which users cannot read the ledger for
        from .idle import IdleWatch
        from .leftovers import LeftoverWatch

        self.leftover_watch = LeftoverWatch(layout, self.notes)
        self.idle_watch = IdleWatch(self.notes, *idle_leases(str(layout.root))[::2])  # a spell outlives a restart
        self._signature: Any = None
        self.policy: Optional[Policy] = None
        self._reload(strict)  # STRICT: a bad [health] value stops the monitor at start: one line, 78
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
        from ..policy.config import load_config
        from ..errors import ConfigError
        from ..base.filestamp import file_signature

        signature = file_signature(self.layout.config_file)
        if signature == self._signature and self.policy is not None:
            return
        self._signature = signature
        try:
            config = load_config(self.layout.config_file)
            self.policy = Policy.from_config(config)
            self.ledger_limits = (config["max_mib"] << 20, config["keep"])
            self.keeper.private = bool(config["private_status"])
        except ConfigError:  # keep the last good settings; the shims say what is wrong, the monitor once
            if strict:
                raise
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
