"""`cudawrap sync`, `cudawrap status` and `cudawrap run`: the commands about devices and leases."""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Optional

from plumbum import cli

from .. import launch, policy
from ..config import parse_gpus, parse_wait
from ..errors import NvmlUnavailable, ProgramNotFound, UsageError
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
        from ..status import render

        layout = default_layout()
        status = machine_status(layout)
        if self.as_json:
            print(json.dumps(status, indent=2))  # nvml_error says when there is no driver
            return 0
        for line in render(status):
            print(line)
        if status["nvml_error"]:
            # The devices are unknown: the table shows at most the lease files of the last sync.
            raise NvmlUnavailable(f"cannot list the devices: {status['nvml_error']}",
                                  "install or load the NVIDIA driver (`nvidia-smi` should work), then run "
                                  "`cudawrap sync`")
        return 0


def _shown(value: str) -> str:
    """A switch's value for a one-line message: control characters replaced, cut short."""
    text = "".join(c if c.isprintable() else "?" for c in value[:40])
    return text + ("..." if len(value) > 40 else "")


class RunCommand(Command):
    """Run any command on free device(s), as a wrapped program would: cudawrap run [-n N] -- CMD ARGS…"""

    gpus = cli.SwitchAttr(["-n", "--gpus"], str, argname="N", help="devices to lease (default: the config's gpus)")
    wait = cli.SwitchAttr(["--wait"], str, argname="SECONDS|forever", help="seconds to wait for a free device, or 'forever'")

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
