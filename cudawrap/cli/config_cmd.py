"""`cudawrap config [--program NAME|PATH]`: the settings in force and where each came from.

The values are exactly what a launch would use (``policy.effective``, the function the
shim calls), so a broken config file fails here the same way, with exit 78 and
FILE:LINE: what is wrong.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

from plumbum import cli

from ..admin.confinecheck import NOT_SERVED
from ..ledger.looks import service_running
from ..policy import effective as policy
from ..policy.config import DEFAULTS, NOTES, OPS_SECTIONS, RETIRED, format_wait
from ..policy.defaults import toml_value
from ..errors import UsageError
from ..policy.limits import NO_LIMITS
from ..paths import Layout, default_layout
from .app import Command


def resolve_program(layout: Layout, program: str) -> Tuple[str, Optional[str]]:
    """The link path a launch of PROGRAM would look up, and a note for stderr (or None).

    PROGRAM is a wrapped program's name or a path: a path is followed the way the shim
    follows it (through symlinks to the wrapped name, or from CUDAWRAP_<name> to the
    name); a bare name is matched against the names of the wrapped programs.
    """
    from ..policy import registry
    from ..launch import find_link

    reg = registry.load(layout)
    if "/" not in program:
        matches = sorted(e.link for e in reg if os.path.basename(e.link) == program)
        if len(matches) > 1:
            raise UsageError(f"--program {program}: several wrapped programs have that name: "
                             f"{', '.join(matches)}", hint="give the full path of one of them")
        if matches:
            return matches[0], None
        return program, (f"note: no wrapped program is named {program}; showing the settings a "
                         f"program of that name would get once wrapped")
    path = os.path.abspath(program)
    if os.path.lexists(path):
        path = os.path.abspath(find_link(path, os.fspath(layout.shim)))
    entry = reg.find(path)
    if entry is not None:
        return entry.link, None
    return path, f"note: {path} is not a wrapped program; showing the settings it would get once wrapped"


def display(key: str, value: Any) -> str:
    if key in ("wait", "reserve_after") and isinstance(value, (int, float)):
        return format_wait(value)
    if isinstance(value, (list, tuple)):
        return toml_value(list(value)) if value else ("[] (all devices)" if key in ("allow", "devices") else "[]")
    if isinstance(value, str) and not value:
        return '""'
    return str(value)


def source_text(source: str) -> str:
    return "environment (CUDAWRAP_WAIT)" if source == "CUDAWRAP_WAIT" else source


class ConfigCommand(Command):
    """Print the settings in force and where each came from (anyone may run it)."""

    DESCRIPTION_MORE = (
        "Sources: default, FILE:LINE of the config file, the registry (create-cudawrap's flags "
        "for a program) or the environment (CUDAWRAP_WAIT). With --program, the settings that "
        "program gets, its [programs.\"NAME\"] table and flags included.")

    program = cli.SwitchAttr(["-p", "--program"], str, argname="NAME|PATH",
                             help="show the settings of this wrapped program")
    as_json = cli.Flag(["--json"], help="print JSON for scripts instead of a table")

    def main(self) -> int:
        layout = default_layout()
        link: Optional[str] = None
        note: Optional[str] = None
        if self.program is not None:
            if not self.program.strip():
                raise UsageError("--program: empty name", hint="give a wrapped program's name or path")
            link, note = resolve_program(layout, self.program)
        settings = policy.effective(os.fspath(layout.root), link)
        limits = settings.limits or NO_LIMITS
        share_rows = _sharing_rows(settings.sharing)
        tables = ("limits", "sharing")  # shown as tables of their own below
        keys = [k for k in DEFAULTS if k in settings and k not in tables and k not in RETIRED] + sorted(
            k for k in settings.keys() if k not in DEFAULTS and k not in tables)
        limit_rows = _limit_rows(limits)
        if self.as_json:
            out: Dict[str, Any] = {
                "config_file": os.fspath(layout.config_file),
                "program": link,
                "settings": {k: {"value": _jsonable(settings.value(k)), "source": settings.source(k)}
                             for k in keys},
                "limits": [{"applies_to": who, "max_devices": n, "source": src}
                           for who, n, src in limit_rows],
                "sharing": [{"setting": key, "value": value, "source": src} for key, value, src in share_rows],
            }
            print(json.dumps(out, indent=2))
            return 0
        if note:
            print(note, file=sys.stderr)
        title = f"settings for {link}" if link else "settings"
        exists = layout.config_file.exists()
        print(f"# {title} (config file: {layout.config_file}{'' if exists else ', absent: all defaults'})")
        rows: List[Tuple[str, str, str]] = [("SETTING", "VALUE", "SOURCE")]
        for key in keys:
            value, source = settings.value(key), settings.source(key)
            rows.append((key, display(key, value), source_text(source)))
        rows.append(("", "", ""))
        rows.append(("LIMIT", "MAX DEVICES", "SOURCE"))
        for who, n, src in limit_rows:
            rows.append((who, str(n) if n else "0 (no limit)", source_text(src)))
        rows.append(("", "", ""))
        rows.append(("SHARING", "VALUE", "SOURCE"))
        rows += [(key, str(value), source_text(src)) for key, value, src in share_rows]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        for key, note in NOTES.items():
            if key in settings and settings.value(key) != DEFAULTS[key]:
                print(f"# note: {key}: {note}")
        for key, why in RETIRED.items():
            if key in settings and settings.source(key) != "default":
                print(f"# note: {source_text(settings.source(key))}: {why}")
        if not service_running(layout) and any(settings.value(k) != DEFAULTS[k] for k in OPS_SECTIONS["confine"]):
            print(f"# note: confine: {NOT_SERVED}")
        if any(n for _who, n, _src in limit_rows):
            print(f"# note: limits: {LIMITS_NOTE}")
        return 0


# What a limit cannot catch without a root process between users and their leases.
LIMITS_NOTE = ("through the service a lease counts for the user it was granted to while its lock is held, "
               "wherever its descriptor went; a run deciding for itself counts its user's leases from the "
               "kernel's locks and the descriptors it may read, so there a lease handed to a setuid program or "
               "to another user's process after the process that took it exited counts for nobody (the user "
               "guide, \"Limits and filters\")")


def _sharing_rows(sharing: Dict[str, Any]) -> List[Tuple[str, Any, str]]:
    """(setting, value, source) of [sharing]: its keys, derived ones said as such, then devices."""
    from ..policy.config import SHARING_KEYS

    derived = {"thread_percentage": "100/slots", "memory_limit_mib": "device memory/slots",
               "counts_as": "1/slots", "memory_action": "warn", "grace_s": 5, "kill_after_s": 10}
    rows: List[Tuple[str, Any, str]] = []
    for key in SHARING_KEYS:
        if key in sharing:
            rows.append((key, sharing[key][0], sharing[key][1]))
        else:
            rows.append((key, derived.get(key, ""), "default"))
    rows += [(f"slots of {name}", v, src) for name, (v, src) in sorted((sharing.get("devices") or {}).items())]
    tables, src = sharing.get("device_memory", ({}, ""))
    rows += [(f"{key} of {name}", v, src) for name, table in sorted(tables.items()) for key, v in table.items()]
    return rows


def _limit_rows(limits: Dict[str, Any]) -> List[Tuple[str, int, str]]:
    """(who, max devices, source) for every limit: everyone, then users, then groups."""
    value, source = limits["default"]
    rows = [("every user (max_devices_per_user)", value, source)]
    rows += [(f"user {name}", v, src) for name, (v, src) in sorted(limits["users"].items())]
    rows += [(f"group {name}", v, src) for name, (v, src) in sorted(limits["groups"].items())]
    return rows


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "forever"
    if isinstance(value, tuple):
        return list(value)
    return value
