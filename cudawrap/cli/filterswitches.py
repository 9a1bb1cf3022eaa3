"""The device-filter switches, shared by `create-cudawrap` (a program's policy) and
`cudawrap run` (one run's asks), with their help from config.DESCRIPTIONS."""
from __future__ import annotations

from typing import Dict, Optional

from plumbum import cli

from ..policy.config import DESCRIPTIONS


class FilterSwitches:
    """Mixed into a plumbum Application: --model, --min-memory-mib, --min-free-memory-mib,
    --max-utilization, and --share (a shared run: a slot of a device, README "Sharing a GPU")."""

    model = cli.SwitchAttr(["--model"], str, argname="WORDS", help=DESCRIPTIONS["model"])
    min_memory = cli.SwitchAttr(["--min-memory-mib"], str, argname="MIB", help=DESCRIPTIONS["min_memory_mib"])
    min_free_memory = cli.SwitchAttr(["--min-free-memory-mib"], str, argname="MIB",
                                     help=DESCRIPTIONS["min_free_memory_mib"])
    max_utilization = cli.SwitchAttr(["--max-utilization"], str, argname="PERCENT",
                                     help=DESCRIPTIONS["max_utilization"])
    share = cli.Flag(["--share"], help=DESCRIPTIONS["share"])

    def filter_asks(self) -> Dict[str, Optional[str]]:
        """Setting key -> the switch's text, or None where it was not given."""
        return {"model": self.model, "min_memory_mib": self.min_memory,
                "min_free_memory_mib": self.min_free_memory, "max_utilization": self.max_utilization}
