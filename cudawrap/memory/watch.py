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

Called by the monitor (``Watch.cycle``), and by whatever runs that loop later. Here is the
step and what it does (warn, signal, the ledger's memory columns); the rest lives below it,
one job a module: the decisions, pure over what one cycle saw (rule.py), the limits from
the config (config.py), the reading of the machine (read.py) and the snapshot file
status and the metrics read (snapshot.py).
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Set, Tuple

from ..paths import Layout
# Also the names the tests import from here: limit_for, Limit, owner, read_snapshot.
from .config import limit_for, memory_settings, share_limit  # noqa: F401
from .read import Run, members, process_memory, runs
from .rule import Action, Limit, Track, account, decide, ended_line, gib, owner  # noqa: F401
from .snapshot import read_snapshot, write_snapshot  # noqa: F401
from ..base.terminal import tell

log = logging.getLogger(__name__)


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
        from ..errors import ConfigError, CudawrapError

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
            if exc.message != self._problem and not isinstance(exc, ConfigError):  # a config's: the monitor says it
                log.warning("memory limits not applied: %s", exc.message)
            self._problem, settings = exc.message, self._config  # the last good settings (None: none yet)
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
                    limit = share_limit(settings, d, run.program)
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
        # [service] private_status (or a config that cannot be read): root's alone, as it names runs.
        write_snapshot(self.layout, snapshot, private=settings is None or settings["private_status"])
        return snapshot

    # -- settings
    def _settings(self) -> Dict[str, Any]:
        from ..policy.config import load_config
        from ..base.filestamp import file_signature

        path = self.layout.config_file
        signature = file_signature(path)
        if signature != self._signature or self._config is None:
            self._config = memory_settings(load_config(path))
            self._signature = signature
        return self._config

    # -- effects
    def _act(self, action: Action, run: Run, procs: Sequence[int]) -> None:
        from ..base import audit
        from ..base.users import user_name

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
        from ..ledger import looks as ledger, files as ledgerfile

        by_pid: Dict[int, int] = {}
        for row in rows:
            by_pid[row["pid"]] = by_pid.get(row["pid"], 0) + row["used_mib"]
        try:
            with ledgerfile.Locked(self.layout):
                path = self.layout.state_dir / ledgerfile.STATE
                state = ledger.load_state(path)
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
                    ledger.save_state(path, state)
        except OSError as exc:
            log.warning("cannot record memory in the ledger: %s", exc.strerror or exc)


def _signal(run: Run, procs: Sequence[int], signum: int) -> None:
    """SIGNUM to the run's holder and every process of it on a GPU, each checked to still be
    the run's (a pid is re-read as the run's user's process right before)."""
    from ..base.proc import real_uid

    for pid in dict.fromkeys([run.pid, *procs]):
        if real_uid(pid) == run.uid:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
