"""The policy switches, generated from the key descriptions (config.DESCRIPTIONS): one a
policy key, named after it (--min-memory-mib for min_memory_mib) and held in the attribute
named as the key. The device filters are shared by `create-cudawrap` (a program's policy) and
`cudawrap run` (one run's asks); create-cudawrap adds the rest of a program's policy."""
from __future__ import annotations

from typing import Callable, Dict, Mapping, Optional, TypeVar

from plumbum import cli

from ..policy.config import DESCRIPTIONS

T = TypeVar("T", bound=type)

# The device filters: key -> its value's name in the help (None: a flag, the key a boolean).
FILTERS: Dict[str, Optional[str]] = {
    "model": "WORDS",
    "min_memory_mib": "MIB",
    "min_free_memory_mib": "MIB",
    "max_utilization": "PERCENT",
    "share": None,  # a shared run: a slot of a device, docs/admin/sharing.md
}


def switch_name(key: str) -> str:
    """The switch of policy KEY: --the-key."""
    return "--" + key.replace("_", "-")


def key_switches(argnames: Mapping[str, Optional[str]]) -> Callable[[T], T]:
    """A class decorator adding a switch for each policy key of ARGNAMES (key -> its value's
    name in the help; None: a flag), its help the key's description."""
    def add(cls: T) -> T:
        for key, argname in argnames.items():
            switch = (cli.Flag([switch_name(key)], help=DESCRIPTIONS[key]) if argname is None else
                      cli.SwitchAttr([switch_name(key)], str, argname=argname, help=DESCRIPTIONS[key]))
            setattr(cls, key, switch)
        return cls

    return add


@key_switches(FILTERS)
class FilterSwitches:
    """Mixed into a plumbum Application: --model, --min-memory-mib, --min-free-memory-mib,
    --max-utilization, and --share."""

    def filter_asks(self) -> Dict[str, Optional[str]]:
        """Setting key -> the switch's text, or None where it was not given (the flags left out)."""
        return {key: getattr(self, key) for key, argname in FILTERS.items() if argname is not None}
