"""`cudawrap mps start|stop|status`: the NVIDIA MPS control daemons of the shared devices."""
from __future__ import annotations

import json
import sys
from typing import List

from plumbum import cli

from ..base import audit
from ..errors import MpsUnavailable, NvmlUnavailable
from ..ops.mps import Outcome
from ..paths import Layout, default_layout
from .app import Command, Group


class MpsCommand(Group):
    """One NVIDIA MPS control daemon per shared device, for [sharing] mode = "mps"."""

    DESCRIPTION_MORE = ("Each device shared through MPS (2 or more [sharing] slots) gets a control daemon of its "
                        "own, so that MPS's one user at a time holds per device, as cudawrap gives out shares. "
                        "The cudawrap-mps unit runs `cudawrap mps start` at boot.")


class MpsStartCommand(Command):
    """Start the control daemon of each shared device that has none running (root)."""

    def main(self) -> int:
        from ..ops.mps import start
        from ..base.privilege import require_admin

        layout = default_layout()
        require_admin(layout, "start MPS control daemons")
        outcomes = start(layout)
        if not outcomes:
            print("no device of this install has 2 or more [sharing] slots: no MPS control daemon to start")
            return 0
        return _report(layout, outcomes, "mps-start", "started", "did not start")


class MpsStopCommand(Command):
    """Quit every MPS control daemon of this install (root); each first waits for its running clients."""

    def main(self) -> int:
        from ..ops.mps import stop
        from ..base.privilege import require_admin

        layout = default_layout()
        require_admin(layout, "stop MPS control daemons")
        outcomes = stop(layout, notice=lambda line: print(line, flush=True))
        if not outcomes:
            print("no MPS control daemon to stop")
            return 0
        return _report(layout, outcomes, "mps-stop", "stopped", "did not stop")


class MpsStatusCommand(Command):
    """Each shared device's MPS control daemon: running or not, its server's user and clients."""

    as_json = cli.Flag(["--json"], help="machine-readable output")

    def main(self) -> int:
        from ..ops.mps import render, status

        report = status(default_layout())
        if self.as_json:
            print(json.dumps(report, indent=2))
            return 0
        for line in render(report):
            print(line)
        if report["nvml_error"]:
            raise NvmlUnavailable(f"cannot list the devices: {report['nvml_error']}",
                                  "install or load the NVIDIA driver (`nvidia-smi` should work)")
        return 0


def _report(layout: Layout, outcomes: List[Outcome], event: str, done: str, failed: str) -> int:
    """A line per device (failures on stderr), the audit line; MpsUnavailable if any failed."""
    bad = [o for o in outcomes if not o.ok]
    for outcome in outcomes:
        print(f"{outcome.uuid}: {outcome.what}", file=sys.stderr if not outcome.ok else sys.stdout)
    changed = [o.uuid for o in outcomes if o.ok and o.what == done]
    if changed:
        audit.log(event, devices=",".join(changed))
    if bad:
        raise MpsUnavailable(f"{len(bad)} of {len(outcomes)} MPS control daemon(s) {failed}",
                             hint=f"see the lines above, and each daemon's {layout.mps_log_dir}/UUID/control.log")
    return 0


for _name, _target in (("start", MpsStartCommand), ("stop", MpsStopCommand), ("status", MpsStatusCommand)):
    MpsCommand.subcommand(_name, _target)
