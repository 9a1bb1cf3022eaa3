"""The memory limit of a share, from the config: ``memory_limit_mib``, ``memory_action``,
``grace_s`` and ``kill_after_s`` of the program's table, the device's (``[sharing.devices]``,
longest prefix) or ``[sharing]``; by default the device's memory over its slots. Plain
values in, plain values out; `limit_problems()` is what sync and doctor say of them.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from .rule import Limit

ACTIONS = ("warn", "terminate")
# A first release only warns: a limit that was always advisory must not start ending runs on
# an upgrade; an admin who wants it enforced says so.
DEFAULT_ACTION = "warn"
DEFAULT_GRACE_S = 5.0
DEFAULT_KILL_AFTER_S = 10.0
MEMORY_KEYS = ("memory_limit_mib", "memory_action", "grace_s", "kill_after_s")


def _pick(layers: Sequence[Mapping[str, Any]], key: str, default: Any) -> Any:
    for layer in layers:
        if key in layer:
            return layer[key]
    return default


def limit_for(sharing: Mapping[str, Any], device_tables: Mapping[str, Mapping[str, Any]],
              programs: Mapping[str, Mapping[str, Any]], uuid: str, parent: str, program: str,
              total_mib: Optional[int], slots: int) -> Limit:
    """The limit of one share of UUID (a MIG instance also matches by its GPU PARENT) for a
    run of PROGRAM: the program's keys, then the device's (longest prefix), then [sharing]'s;
    the memory limit by default the device's memory over its SLOTS. Plain values. Pure."""
    device = next((t for name, t in sorted(device_tables.items(), key=lambda i: -len(i[0]))
                   if uuid.startswith(name) or (parent and parent.startswith(name))), {})
    layers = [programs.get(program, {}), device, sharing]
    limit = _pick(layers, "memory_limit_mib", None)
    if limit is None:
        limit = (total_mib // max(slots, 1)) if total_mib else 0
    return Limit(int(limit), _pick(layers, "memory_action", DEFAULT_ACTION),
                 float(_pick(layers, "grace_s", DEFAULT_GRACE_S)),
                 float(_pick(layers, "kill_after_s", DEFAULT_KILL_AFTER_S)))


def limit_problems(config: Any, devices: Iterable[Any]) -> List[str]:
    """A line for each memory_limit_mib above the memory of a shared device it applies to
    (CONFIG: a loaded Config; DEVICES: the inventory's). Such a share is never held back. Pure."""
    sharing = config.sharing
    slots = sorted(((n, s.value) for n, s in sharing["devices"].items()), key=lambda i: -len(i[0]))
    tables = sharing.get("device_memory", {})
    out = []
    for d in devices:
        matches = [n for n, _s in slots if d.uuid.startswith(n) or d.parent_uuid.startswith(n)]
        count = dict(slots)[matches[0]] if matches else sharing["slots"].value
        if count <= 1 or not d.memory_total_mib:
            continue
        found = [("[sharing]", sharing["memory_limit_mib"].value)] if "memory_limit_mib" in sharing else []
        found += [(f'[sharing.devices."{n}"]', t["memory_limit_mib"].value) for n, t in sorted(tables.items())
                  if "memory_limit_mib" in t and (d.uuid.startswith(n) or d.parent_uuid.startswith(n))]
        found += [(f'[programs."{n}"]', t["memory_limit_mib"].value) for n, t in sorted(config.programs.items())
                  if "memory_limit_mib" in t]
        out += [f"memory_limit_mib = {limit} in {where} is above the {d.memory_total_mib} MiB of {d.uuid}: "
                f"a share there is never held back" for where, limit in found if limit > d.memory_total_mib]
    return out


def memory_settings(config: Any) -> Dict[str, Any]:
    """The memory keys of a loaded Config as plain values: [sharing]'s, each device table's and
    each program's, and the slots (by device prefix, and the default) a share is one of."""
    sharing = {k: s.value for k, s in config.sharing.items() if k in MEMORY_KEYS}
    tables = {n: {k: s.value for k, s in t.items()}
              for n, t in config.sharing.get("device_memory", {}).items()}
    programs = {n: {k: s.value for k, s in t.items() if k in MEMORY_KEYS}
                for n, t in config.programs.items()}
    slots = {n: s.value for n, s in config.sharing["devices"].items()}
    return {"sharing": sharing, "devices": tables, "programs": programs, "slots": slots,
            "default_slots": config.sharing["slots"].value, "private_status": bool(config["private_status"])}


def share_limit(settings: Mapping[str, Any], d: Any, program: str) -> Limit:
    """The limit of a share of the inventory's device D for a run of PROGRAM under SETTINGS
    (memory_settings'): D's slots by the longest prefix that names it, or the default."""
    slots = next((n for name, n in sorted(settings["slots"].items(), key=lambda i: -len(i[0]))
                  if d.uuid.startswith(name) or d.parent_uuid.startswith(name)), settings["default_slots"])
    return limit_for(settings["sharing"], settings["devices"], settings["programs"], d.uuid,
                     d.parent_uuid, program, d.memory_total_mib, slots)
