"""`cudawrap sync`, `cudawrap status` and `cudawrap run`: the commands about devices and leases."""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import List, Optional

from plumbum import cli

from .. import launch, policy
from ..config import parse_gpus, parse_wait
from ..errors import ProgramNotFound, UsageError
from ..paths import default_layout
from ..status import machine_status
from . import Command


class SyncCommand(Command):
    """Create the runtime directory, a lease file per current device, and the launch cache (root)."""

    quiet = cli.Flag(["-q", "--quiet"], help="print nothing when there is nothing to say")

    def main(self) -> int:
        from ..privilege import require_admin
        from ..sync import sync

        layout = default_layout()
        require_admin(layout, "create lease files")
        report = sync(layout)
        _record(layout, "cudawrap sync")
        for line in report.lines:
            if not self.quiet or line.startswith("warning"):
                print(line)
        return os.EX_UNAVAILABLE if report.nvml_error else 0


class MonitorCommand(Command):
    """Keep the launch snapshot fresh so launches skip NVML (root; the cudawrap-monitor service)."""

    once = cli.Flag(["--once"], help="write one snapshot and exit")
    period = cli.SwitchAttr(["--period"], float, default=0.5, help="seconds between snapshots")

    def main(self) -> int:
        from ..monitor import refresh_once, run
        from ..privilege import require_admin

        layout = default_layout()
        require_admin(layout, "run the monitor")
        if not 0.05 <= self.period <= 60:
            raise UsageError(f"--period {self.period}: choose between 0.05 and 60 seconds")
        if self.once:
            error = refresh_once(layout)
            if error:
                print(f"cudawrap monitor: {error}", file=sys.stderr)
                return os.EX_UNAVAILABLE
            return 0
        run(layout, self.period)
        return 0


class StatusCommand(Command):
    """Every device with its lease holder, other processes and memory; then who is waiting."""

    as_json = cli.Flag(["--json"], help="machine-readable output")

    def main(self) -> int:
        layout = default_layout()
        _record(layout, "cudawrap status")
        status = machine_status(layout)
        if self.as_json:
            print(json.dumps(status, indent=2))
            return 0
        if status["nvml_error"]:
            print(f"warning: {status['nvml_error']}", file=sys.stderr)
        rows = [("DEVICE", "NAME", "GPU", "MEMORY", "LEASE", "OTHER PROCESSES")]
        for d in status["devices"]:
            holder = d["holder"]
            lease = "free" if holder is None else (
                f"pid {holder['pid']} {holder['user']} {holder['command'][:30]} since {holder['since']}")
            if not d["lease_file"]:
                lease = "no lease file (run `cudawrap sync`)"
            others = d["foreign_pids"]
            other = "unknown" if others is None else (",".join(map(str, others)) or "-")
            rows.append((d["uuid"], d["name"], str(d["gpu_index"]),
                         f"{d['memory_used_mib']}/{d['memory_total_mib']} MiB", lease, other))
        _table(rows)
        if status["drained"]:
            print()
            _table([("DRAINED", "SINCE", "BY", "REASON")] + [
                (uuid, d["at"], d["by"], d["reason"] or "-") for uuid, d in sorted(status["drained"].items())])
        if status["waiting"]:
            print()
            _table([("WAITING", "USER", "PID", "DEVICES", "PROGRAM")] + [
                (str(n), w["user"], str(w["pid"]), str(w["count"]), w["program"])
                for n, w in enumerate(status["waiting"], 1)])
        holder = status.get("queue_lock_holder")
        if holder:
            print(f"\nqueue lock held by pid {holder['pid']} {holder['user']} {holder['command'][:30]} "
                  f"since {holder['since']}")
        return 0


def _record(layout, seen_by: str) -> None:  # type: ignore[no-untyped-def]
    """As root, record in the ledger what changed since the last look (the monitor may not run)."""
    from ..ledger import look

    obs = look(layout, seen_by)
    if obs is not None and obs.error:
        print(f"warning: {obs.error}", file=sys.stderr)


def _shown(value: str) -> str:
    """A switch's value for a one-line message: control characters replaced, cut short."""
    text = "".join(c if c.isprintable() else "?" for c in value[:40])
    return text + ("..." if len(value) > 40 else "")


def _table(rows: List[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


class RunCommand(Command):
    """Run any command on free device(s), as a wrapped program would: cudawrap run [-n N] -- CMD ARGS…"""

    gpus = cli.SwitchAttr(["-n", "--gpus"], str, help="devices to lease (default: the config's gpus)")
    wait = cli.SwitchAttr(["--wait"], str, help="seconds to wait for a free device, or 'forever'")

    def main(self, *command: str) -> int:
        if not command:
            raise UsageError("no command given", hint="cudawrap run [-n N] [--wait S] -- CMD ARGS…")
        layout = default_layout()
        settings = policy.effective(str(layout.root), None)
        count: Optional[int] = None
        if self.gpus is not None:
            try:
                count = parse_gpus(self.gpus)
            except ValueError as exc:
                raise UsageError(f"--gpus {_shown(self.gpus)}: {exc}") from None
        if self.wait is not None:
            try:
                settings["wait"] = (parse_wait(self.wait), "--wait")
            except ValueError as exc:
                raise UsageError(f"--wait {_shown(self.wait)}: {exc}") from None
        path = command[0] if "/" in command[0] else shutil.which(command[0])
        if not path or not os.path.exists(path):
            raise ProgramNotFound(f"{command[0]}: command not found")
        prog = os.path.basename(command[0])
        grant = launch.obtain(str(layout.root), prog, settings, os.environ, count=count)
        launch.exec_program(path, list(command), grant.apply(launch.original_environ()), grant)
        return 0  # not reached: exec_program replaces this process
