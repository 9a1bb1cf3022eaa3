"""The commented default configuration that install.sh writes to ``etc/cudawrap/config.toml``.

Generated from ``config.DEFAULTS`` and ``config.DESCRIPTIONS`` so the file can never
list a setting the parser does not know, or miss one it does. Every setting appears
commented out with its default: removing the ``#`` before a setting line gives the same
behaviour as before, so an admin edits values, never spelling. A table's header is
commented out too, unless a key of it is set: a table may appear only once in TOML, so an
uncommented header would make the most natural edit, appending ``[policy]`` and a key at
the end, an error (issue 51).
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, Iterable, List, Mapping, Tuple

from .config import DEFAULTS, DESCRIPTIONS, DEVICE_KEYS, OPS_SECTIONS, POLICY_KEYS, RETIRED, SHARING_DESCRIPTIONS

HEADER = """\
# cudawrap configuration.
#
# Every setting is listed below, commented out, with its default value: remove the "#"
# in front of a setting line and in front of its table's header (such as #[policy]), and
# change the value to use another one; or add the table and the setting at the end of the
# file (a table may appear once). install.sh wrote this file once and never overwrites it
# (an upgrade leaves your edits alone).
#
# After an edit, check it with `cudawrap config`: it prints the settings in force and
# where each one came from. A mistake here (an unknown key, a value of the wrong type)
# makes every wrapped program stop with exit code 78 and FILE:LINE: what is wrong, so a
# typo can never quietly change which devices people get.
#
# Precedence, later wins: these defaults, [devices] and [policy] below, a
# [programs."NAME"] table, the flags given to `create-cudawrap` for that program, and
# CUDAWRAP_WAIT in the environment of one run.
"""

PROGRAMS_EXAMPLE = """\
# Per-program settings: a table per wrapped program, by its name (the file name, as in
# "recon") or its full path (as in "/opt/app/bin/recon"; the path wins over the name).
# Any [policy] key may appear there, and [sharing]'s memory_limit_mib, memory_action, grace_s
# and kill_after_s for its shared runs; create-cudawrap's flags for a program win over it.
#
#[programs."recon"]
#gpus = 2
#wait = 600
"""


LIMITS_EXAMPLE = """\
# Per-user limits: the most devices one user may hold at once (0 = no limit). A run that
# would go over its user's limit waits until one of that user's runs ends. A user's limit
# is their [limits.users."NAME"] entry if any, else the largest of their groups' entries,
# else max_devices_per_user. Root is limited too unless it has an entry of its own.
#[limits]
# most devices one user may hold at once; 0 = no limit
#max_devices_per_user = 0
#
#[limits.users."alice"]
#max_devices = 4
#
#[limits.groups."gpu-heavy"]
#max_devices = 8
"""


# [sharing]'s optional keys have no fixed default: absent, each is derived from the device's
# slots. The value shown is what it is with slots = 1, so uncommenting one changes nothing.
SHARING_SHOWN = {"slots": "1", "mode": '"time-slicing"', "thread_percentage": "100",
                 "memory_limit_mib": "0", "counts_as": "1.0", "memory_action": '"warn"', "grace_s": "5",
                 "kill_after_s": "10"}

SHARING_EXAMPLE = """\
# One device's slots, by its UUID or a prefix (a GPU- prefix covers its MIG instances).
# Run `cudawrap sync` after changing slots.
#
#[sharing.devices."GPU-8f3a"]
#slots = 4
# ... and its shares' memory: memory_limit_mib, memory_action, grace_s, kill_after_s as in
# [sharing] (a [programs."NAME"] table may set them too, and wins).
#memory_limit_mib = 20480
#memory_action = "terminate"
#grace_s = 5
#kill_after_s = 10
"""


def _sharing_table() -> List[str]:
    lines = ["# How shared runs share a device (docs: \"Sharing and MPS\"); runs share only with",
             "# share = true (a program's policy, `cudawrap run --share` or CUDAWRAP_SHARE=1).",
             "#[sharing]"]
    for key, what in SHARING_DESCRIPTIONS.items():
        lines += [f"# {what}", f"#{key} = {SHARING_SHOWN[key]}"]
    return lines


def toml_value(value: Any) -> str:
    """VALUE written as a TOML literal the config parser reads back to the same value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return '"forever"'
    if isinstance(value, (int, float)):
        return f"{value:g}" if isinstance(value, float) else str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a TOML basic string for any text
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {value!r}")


# What an install that runs the service writes into a new configuration, and why.
CONFINED: Mapping[str, Tuple[Any, str]] = {
    "runs": (True, "set at install, as the service runs here and this host can confine runs: each granted "
                   "run opens its own GPUs only"),
}


def install_choices(confinable: bool) -> Dict[str, Tuple[Any, str]]:
    """What an install that runs the service writes into a new configuration: [confine] runs
    where the host can confine (CONFINABLE); nodes stays "open"."""
    return {**(CONFINED if confinable else {})}


def _table(name: str, keys: Iterable[str], chosen: Mapping[str, Tuple[Any, str]]) -> List[str]:
    keys = list(keys)
    lines = [f"[{name}]" if any(key in chosen for key in keys) else f"#[{name}]"]
    for key in keys:
        lines.append(f"# {DESCRIPTIONS[key]}")
        if key in chosen:
            value, why = chosen[key]
            lines += [f"# ({why})", f"{key} = {toml_value(value)}"]
        else:
            lines.append(f"#{key} = {toml_value(DEFAULTS[key])}")
    return lines


def sections() -> Dict[str, List[str]]:
    """Section name -> its keys, in DEFAULTS order."""
    return {
        "devices": [k for k in DEFAULTS if k in DEVICE_KEYS],
        "policy": [k for k in DEFAULTS if k in POLICY_KEYS],
        **{name: [k for k in DEFAULTS if k in keys and k not in RETIRED] for name, keys in OPS_SECTIONS.items()},
    }


def render_config(chosen: Mapping[str, Tuple[Any, str]] = {}) -> str:  # noqa: B006 - read only
    """The full text of the default configuration file: every key commented out at its
    default, but those CHOSEN (key -> (value, why)), set."""
    parts = [HEADER]
    for name, keys in sections().items():
        parts.append("\n".join(_table(name, keys, chosen)) + "\n")
    parts.append(LIMITS_EXAMPLE)
    parts.append("\n".join(_sharing_table()) + "\n" + "#\n" + SHARING_EXAMPLE)
    parts.append(PROGRAMS_EXAMPLE)
    return "\n".join(parts)
