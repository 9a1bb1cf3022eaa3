"""`cudawrap health`: each GPU's health, its last events and what brings a drained one back."""
from __future__ import annotations

import json
import time

from plumbum import cli

from ..paths import default_layout
from .app import Command, require_install


class HealthCommand(Command):
    """Each GPU's health as the monitor sees it: drained for an error, and what brings it back."""

    DESCRIPTION_MORE = ("Anyone may ask. A GPU that reports an error needing a reset (NVIDIA's XID catalog; "
                        "[health] in the configuration) is drained until it has been clear for recover_after_s.")

    as_json = cli.Flag(["--json"], help="machine-readable output")

    def main(self) -> int:
        from ..health.report import render, report

        data = report(str(default_layout().root), time.time())
        if self.as_json:
            print(json.dumps(data, indent=2))
        else:
            print("\n".join(render(data)))
        return 0


class WhyCommand(Command):
    """Why a run waits for a device, its place in line, and when it may start."""

    DESCRIPTION_MORE = ("Without PID: each of your waiting runs (root: everyone's). The reason is the scheduler's "
                        "own; the start is estimated from the holders' time so far and each program's median run "
                        "length over its last 20 runs in the ledger, or \"unknown\" with why.")
    USAGE = "    {progname} [--json] [PID]\n"

    as_json = cli.Flag(["--json"], help="machine-readable output")

    def main(self, pid: str = "") -> int:
        import os

        from ..errors import NotPermitted, UsageError
        from ..ops.status import machine_status
        from ..base.users import user_name

        if pid and not (pid.isascii() and pid.isdigit() and 0 < int(pid) < 1 << 22):
            raise UsageError(f"PID {pid[:20]!r}: not a process id", hint="`cudawrap status` lists the waiting runs")
        layout = default_layout()
        require_install(layout)
        me = user_name(os.getuid())
        rows = machine_status(layout)["waiting"]
        if pid:
            rows = [r for r in rows if r["pid"] == int(pid)]
            if not rows:
                raise UsageError(f"pid {pid} is not waiting for a device here",
                                 hint="`cudawrap status` lists the waiting runs and the holders")
            if os.geteuid() != 0 and rows[0]["user"] != me:
                raise NotPermitted(f"pid {pid} is {rows[0]['user']}'s run: you may ask about your own only")
        elif os.geteuid() != 0:
            rows = [r for r in rows if r["user"] == me]
        if self.as_json:
            print(json.dumps(rows, indent=2))
            return 0
        if not rows:
            print("no run of yours is waiting" if os.geteuid() != 0 else "no run is waiting")
        for r in rows:
            print(f"pid {r['pid']} ({r['user']}, {r['program']}, {r['count']} device{'s' if r['count'] != 1 else ''}): "
                  f"position {r['position'] or '?'} in line, waiting {r['waiting_s']:.0f} s")
            print(f"  why: {r['reason']}")
            print(f"  start: {r.get('start', 'unknown')} ({r.get('start_basis', '')})")
        return 0
