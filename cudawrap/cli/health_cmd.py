"""`cudawrap health`: each GPU's health, its last events and what brings a drained one back."""
from __future__ import annotations

import json
import time

from plumbum import cli

from ..paths import default_layout
from . import Command


class HealthCommand(Command):
    """Each GPU's health as the monitor sees it: drained for an error, and what brings it back."""

    DESCRIPTION_MORE = ("Anyone may ask. A GPU that reports an error needing a reset (NVIDIA's XID catalog; "
                        "[health] in the configuration) is drained until it has been clear for recover_after_s.")

    as_json = cli.Flag(["--json"], help="machine-readable output")

    def main(self) -> int:
        from ..health import render, report

        data = report(str(default_layout().root), time.time())
        if self.as_json:
            print(json.dumps(data, indent=2))
        else:
            print("\n".join(render(data)))
        return 0
