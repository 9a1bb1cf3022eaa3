"""The admin's TOML configuration: parsed strictly, with the origin of every value kept.

A typo in a key or a value of the wrong type is a ConfigError naming file, line and key,
raised from the shim as well as the CLI: a broken config must never silently change
which devices people get.
"""
from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..errors import ConfigError
from .healthconf import HEALTH_DEFAULTS, HEALTH_DESCRIPTIONS, health_keys

FOREVER = math.inf

PLACEMENTS = ("spread", "pack", "random")
FOREIGN_RULES = ("avoid", "ignore")
NO_DRIVER_RULES = ("run", "fail")
MULTI_MIG_RULES = ("refuse", "whole-gpus")

# The longest wait anyone can ask for in seconds; beyond it "forever" is the honest word
# (and setitimer overflows somewhere above 2**31).
MAX_WAIT_S = 10 * 365 * 86400
MAX_GPUS = 64


def _shown(value: Any) -> str:
    """VALUE for a one-line message: its repr, cut short (it may be 100 kB of environment)."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python will print
        return "a number that long"
    return text if len(text) <= 40 else text[:36] + "..."


def parse_wait(value: Any) -> float:
    """A wait limit: seconds (int, float or numeric string) >= 0, or "forever"."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("forever", "inf", "infinity", "none"):
            return FOREVER
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{_shown(value)} is not a number of seconds or 'forever'") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{_shown(value)} is not a number of seconds or 'forever'")
    # Not math.isnan(value) on an int: TOML integers are unbounded and float() overflows.
    if (isinstance(value, float) and math.isnan(value)) or value < 0:
        raise ValueError(f"{_shown(value)} is not a number of seconds >= 0")
    if value > MAX_WAIT_S:
        return FOREVER
    return float(value)


def parse_gpus(value: Any) -> int:
    """A device count per run: an integer from 1 to MAX_GPUS."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_shown(value)} is not a whole number of devices")
    if not 1 <= value <= MAX_GPUS:
        raise ValueError(f"{_shown(value)} is not between 1 and {MAX_GPUS}")
    return value


def _choice(choices: Tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{_shown(value)} is not one of {', '.join(choices)}")
        return value

    parse.choices = choices  # type: ignore[attr-defined]  # for shell completion
    return parse


def _non_negative_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{_shown(value)} is not a whole number >= 0")
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{_shown(value)} is not true or false")
    return value


def _uuid_list(value: Any) -> Tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a list of device UUID strings")
    bad = [v for v in value if not re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", v.strip())]
    if bad:
        raise ValueError(f"{_shown(bad[0])} is not a GPU-… or MIG-… UUID (or prefix)")
    return tuple(v.strip() for v in value)


def _percent(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
        raise ValueError(f"{_shown(value)} is not a whole percentage from 0 to 100")
    return value


def parse_model(value: Any) -> str:
    """A model filter: words each found, case-insensitively, in the product name ("" = any)."""
    if not isinstance(value, str) or len(value) > 200 or not value.isprintable():
        raise ValueError(f"{_shown(value)} is not a model name such as \"H100\" or \"A100 1g.10gb\"")
    return " ".join(value.split())


def parse_devices(value: Any) -> Tuple[Any, ...]:
    """Devices to choose among: GPU-/MIG- UUIDs or prefixes, and NVML indices (nvidia-smi's)."""
    if isinstance(value, str):  # the environment's and the switches' comma list
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list):
        raise ValueError(f"{_shown(value)} is not a list of device UUIDs and indices")
    out: List[Any] = []
    for item in value:
        if isinstance(item, str) and item.isascii() and item.isdigit() and len(item) <= 4:
            item = int(item)
        if isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= 9999:
            out.append(item)
        elif isinstance(item, str) and re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", item.strip()):
            out.append(item.strip())
        else:
            raise ValueError(f"{_shown(item)} is not a GPU-… or MIG-… UUID (or prefix) or an index")
    return tuple(out)


def _path_or_empty(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{_shown(value)} is not a path string")
    if value and not value.startswith("/"):
        raise ValueError(f"{_shown(value)} is not an absolute path")
    return value


# Settings a single program may override, by [programs."NAME"] in the config or by
# create-cudawrap's flags (kept in the registry).
POLICY_KEYS: Dict[str, Callable[[Any], Any]] = {
    "gpus": parse_gpus,
    "wait": parse_wait,
    "placement": _choice(PLACEMENTS),
    "foreign": _choice(FOREIGN_RULES),
    "busy_memory_mib": _non_negative_int,
    "no_driver": _choice(NO_DRIVER_RULES),
    "multi_mig": _choice(MULTI_MIG_RULES),
    "reserve_after": parse_wait,
    "max_gpus": parse_gpus,
    "model": parse_model,
    "min_memory_mib": _non_negative_int,
    "min_free_memory_mib": _non_negative_int,
    "max_utilization": _percent,
    "devices": parse_devices,
    "share": _bool,
}

DEVICE_KEYS: Dict[str, Callable[[Any], Any]] = {
    "allow": _uuid_list,
    "allow_file": _path_or_empty,
}

def _mib(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
        raise ValueError(f"{_shown(value)} is not a whole number of MiB from 1 to {1 << 20}")
    return value


def _connections(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 16:
        raise ValueError(f"{_shown(value)} is not a whole number from 1 to {1 << 16}")
    return value


# The monitor's accounting and metrics, the service's bounds: root's settings, not a run's.
# Section -> its keys.
OPS_SECTIONS: Dict[str, Dict[str, Callable[[Any], Any]]] = {
    "metrics": {"textfile": _path_or_empty},
    "ledger": {"max_mib": _mib, "keep": _non_negative_int},
    "service": {"private_status": _bool, "max_connections_per_uid": _connections},
    "health": health_keys(_choice),
}

DEFAULTS: Dict[str, Any] = {
    "gpus": 1,
    "wait": FOREVER,
    "placement": "spread",
    "foreign": "avoid",
    "busy_memory_mib": 1024,
    "no_driver": "run",
    "multi_mig": "refuse",
    "reserve_after": 300.0,
    "max_gpus": MAX_GPUS,
    "model": "",
    "min_memory_mib": 0,
    "min_free_memory_mib": 0,
    "max_utilization": 100,
    "devices": (),
    "share": False,
    "allow": (),
    "allow_file": "",
    "textfile": "",
    "max_mib": 64,
    "keep": 4,
    "private_status": False,
    "max_connections_per_uid": 1000,
    **HEALTH_DEFAULTS,
}

DESCRIPTIONS: Dict[str, str] = {
    "gpus": "devices given to each run",
    "wait": "seconds to wait for a free device, or \"forever\"; 0 = do not wait",
    "placement": "spread (across physical GPUs), pack (fill one GPU first) or random",
    "foreign": "avoid or ignore devices running processes cudawrap did not start",
    "busy_memory_mib": "where process lists are hidden, more memory used than this is busy",
    "no_driver": "without an NVIDIA driver or NVML: run the program (leased by its lease file where one exists), or fail",
    "multi_mig": "more than one MIG instance on a driver before R570: refuse, or whole-gpus",
    "reserve_after": "seconds a run waits before free devices are kept for it until it has enough, or \"forever\"",
    "max_gpus": "the most devices one run may ask for (CUDAWRAP_GPUS, run -n, acquire(N))",
    "model": "only devices whose product name holds these words, e.g. \"H100\", \"A100 1g.10gb\"",
    "min_memory_mib": "only devices with at least this much memory in all (MiB)",
    "min_free_memory_mib": "only devices with at least this much memory free (MiB)",
    "max_utilization": "only devices busy at most this % (MIG: not reported, never excluded)",
    "devices": "only these devices: UUIDs, prefixes, NVML indices; empty = all",
    "share": "runs share a device with other shared runs ([sharing] slots per device) instead of taking it whole",
    "allow": "device UUIDs (or prefixes) cudawrap may hand out; empty = all",
    "allow_file": "file with one allowed UUID a line (the getgpu ids format), or \"\"",
    "textfile": "Prometheus text file the monitor rewrites every cycle (node_exporter's textfile "
                "directory, *.prom), or \"\" for none",
    "max_mib": "size at which the ledger of leases is rotated (MiB)",
    "keep": "rotated ledger files kept (ledger.1 is the newest)",
    "private_status": "with `cudawrap serve`: status through it shows a user others' leases and waits "
                      "without their names, pids and programs (root sees all)",
    "max_connections_per_uid": "with `cudawrap serve`: the most connections one user may keep open to it, "
                               "so runs waiting at once (root is not limited)",
    **HEALTH_DESCRIPTIONS,
}


# What `cudawrap config` adds below the table when a setting is in force.
NOTES: Dict[str, str] = {
    "max_utilization": "NVML reports no utilisation for MIG instances (nor for a GPU in MIG mode), "
                       "so max_utilization never excludes them; it applies to whole GPUs only",
}


@dataclass(frozen=True)
class Setting:
    value: Any
    source: str  # "default", "FILE:LINE", "registry", "CUDAWRAP_WAIT", ...


LIMIT_KEYS: Dict[str, Callable[[Any], Any]] = {"max_devices_per_user": _non_negative_int}
LIMIT_ENTRY_KEYS: Dict[str, Callable[[Any], Any]] = {"max_devices": _non_negative_int}
LIMIT_DESCRIPTIONS: Dict[str, str] = {
    "max_devices_per_user": "most devices one user may hold at once; 0 = no limit",
    "max_devices": "in [limits.users.\"NAME\"] or [limits.groups.\"GROUP\"]: that user's or group's limit",
}


# The most runs one device can be shared by: MPS serves at most 48 clients per device on
# Volta and later, and time slices thinner than that leave each run next to nothing.
MAX_SLOTS = 48
SHARING_MODES = ("time-slicing", "mps")


def _slots(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SLOTS:
        raise ValueError(f"{_shown(value)} is not a whole number of slots from 1 (no sharing) to {MAX_SLOTS}")
    return value


def _share_percentage(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise ValueError(f"{_shown(value)} is not a whole percentage from 1 to 100")
    return value


def _memory_limit(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1 << 24:
        raise ValueError(f"{_shown(value)} is not a whole number of MiB from 0 (no limit) to {1 << 24}")
    return value


def _fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{_shown(value)} is not a fraction of a device above 0 and at most 1")
    return float(value)


def _seconds(zero_ok: bool) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not (number and (0 <= value if zero_ok else 0 < value) and value <= 86400):  # NaN fails too
            raise ValueError(f"{_shown(value)} is not a number of seconds {'from 0' if zero_ok else 'above 0'} "
                             f"to 86400")
        return float(value)
    return parse


# A shared run's memory limit and what exceeding it does (README "Memory of shared runs"); also
# per device ([sharing.devices."UUID"]) and per program ([programs."NAME"]).
MEMORY_KEYS: Dict[str, Callable[[Any], Any]] = {
    "memory_limit_mib": _memory_limit,
    "memory_action": _choice(("warn", "terminate")),
    "grace_s": _seconds(False),
    "kill_after_s": _seconds(True),
}

# [sharing]: how shared runs share a device (README "Sharing a GPU"). Absent optional keys
# mean "derived from slots" (thread share, memory limit, what a share counts as).
SHARING_KEYS: Dict[str, Callable[[Any], Any]] = {
    "slots": _slots,
    "mode": _choice(SHARING_MODES),
    "thread_percentage": _share_percentage,
    "counts_as": _fraction,
    **MEMORY_KEYS,
}
SHARING_DEVICE_KEYS: Dict[str, Callable[[Any], Any]] = {"slots": _slots, **MEMORY_KEYS}
SHARING_DESCRIPTIONS: Dict[str, str] = {
    "slots": "shared runs one device takes at once; 1 = no sharing",
    "mode": "time-slicing (CUDA's own) or mps (NVIDIA MPS; `cudawrap mps start`)",
    "thread_percentage": "MPS: % of the device's SMs one shared run may use (default 100/slots)",
    "memory_limit_mib": "device memory one shared run may use, MiB (MPS pins it); 0 = none (default memory/slots)",
    "counts_as": "what one share counts as towards a user's device limit (default 1/slots)",
    "memory_action": "a time-slicing share over memory_limit_mib: warn (default) or terminate",
    "grace_s": "seconds a share may stay over its memory limit before memory_action (default 5)",
    "kill_after_s": "seconds from SIGTERM to SIGKILL for a share ended for its memory (default 10)",
}


# Every table the file may hold and its keys; "*" is a name the admin chooses. The default
# file (cudawrap.policy.defaults) shows each of them.
SCHEMA: Dict[str, Mapping[str, Callable[[Any], Any]]] = {
    "devices": DEVICE_KEYS, "policy": POLICY_KEYS, "limits": LIMIT_KEYS,
    "limits.users.*": LIMIT_ENTRY_KEYS, "limits.groups.*": LIMIT_ENTRY_KEYS,
    "sharing": SHARING_KEYS, "sharing.devices.*": SHARING_DEVICE_KEYS,
    "programs.*": {**POLICY_KEYS, **MEMORY_KEYS},
    **OPS_SECTIONS,
}


def no_sharing() -> Dict[str, Any]:
    return {"slots": Setting(1, "default"), "mode": Setting("time-slicing", "default"), "devices": {}}


@dataclass(frozen=True)
class Config:
    path: Path
    settings: Mapping[str, Setting]
    programs: Mapping[str, Mapping[str, Setting]] = field(default_factory=dict)
    # [limits]: "default" -> Setting; "users"/"groups" -> name -> Setting
    limits: Mapping[str, Any] = field(default_factory=lambda: {
        "default": Setting(0, "default"), "users": {}, "groups": {}})
    # [sharing]: key -> Setting, and "devices" -> UUID or prefix -> Setting (slots)
    sharing: Mapping[str, Any] = field(default_factory=no_sharing)

    def __getitem__(self, key: str) -> Any:
        return self.settings[key].value

    def for_program(self, link: Optional[str]) -> Dict[str, Setting]:
        """Global settings overlaid with [programs."NAME"] where NAME is the link's path or name."""
        merged = dict(self.settings)
        if link:
            for name in (Path(link).name, link):
                merged.update(self.programs.get(name, {}))
        return merged


def _load_toml(text: str) -> Dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.9/3.10 only
        import tomli as tomllib
    return tomllib.loads(text)


def _norm_table(name: str) -> str:
    return name.replace('"', "").replace("'", "").replace(" ", "")


def _line_of(lines: List[str], table: Optional[str], key: str) -> int:
    """Line number of KEY inside [TABLE] ("" = above any header), or of the header [KEY]
    when TABLE is None.

    tomllib keeps no positions, so this scans the text; 0 when not found.
    """
    current = ""
    key_re = re.compile(r"""^\s*["']?""" + re.escape(key) + r"""["']?\s*=""")
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("["):
            current = _norm_table(stripped.split("#")[0].strip().strip("[]"))
            header = _norm_table(key)  # a label such as limits.users."NAME" as written in a header
            if table is None and (current == header or current.startswith(header + ".")):
                return number
        elif table is not None and current == _norm_table(table) and key_re.match(line):
            return number
    return 0


def _where(path: Path, lines: List[str], table: Optional[str], key: str) -> str:
    line = _line_of(lines, table, key)
    return f"{path}:{line}" if line else str(path)


def _parse_table(
    path: Path,
    lines: List[str],
    table_name: str,
    table: Any,
    allowed: Mapping[str, Callable[[Any], Any]],
) -> Dict[str, Setting]:
    if not isinstance(table, dict):
        raise ConfigError(f"{_where(path, lines, None, table_name)}: [{table_name}] must be a table")
    out: Dict[str, Setting] = {}
    for key, raw in table.items():
        where = _where(path, lines, table_name, key)
        parse = allowed.get(key)
        if parse is None:
            known = ", ".join(sorted(allowed))
            raise ConfigError(
                f"{where}: unknown key '{key}' in [{table_name}]",
                hint=f"known keys there: {known}",
            )
        try:
            out[key] = Setting(parse(raw), where)
        except ValueError as exc:
            raise ConfigError(f"{where}: bad value for '{key}': {exc}") from None
    return out


def parse_config(path: Path, text: str) -> Config:
    """Parse TEXT (the contents of PATH) into a Config, or raise ConfigError."""
    try:
        data = _load_toml(text)
    except ValueError as exc:  # tomllib.TOMLDecodeError says "(at line N, column M)"
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ConfigError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None
    lines = text.splitlines()
    settings: Dict[str, Setting] = {k: Setting(v, "default") for k, v in DEFAULTS.items()}
    programs: Dict[str, Dict[str, Setting]] = {}
    limits: Dict[str, Any] = {"default": Setting(0, "default"), "users": {}, "groups": {}}
    sharing = no_sharing()
    for section, table in data.items():
        if section == "limits":
            limits = _parse_limits(path, lines, table)
        elif section == "sharing":
            sharing = _parse_sharing(path, lines, table)
        elif section == "devices":
            settings.update(_parse_table(path, lines, "devices", table, DEVICE_KEYS))
        elif section == "policy":
            settings.update(_parse_table(path, lines, "policy", table, POLICY_KEYS))
        elif section in OPS_SECTIONS:
            settings.update(_parse_table(path, lines, section, table, OPS_SECTIONS[section]))
        elif section == "programs":
            if not isinstance(table, dict):
                raise ConfigError(f"{_where(path, lines, None, 'programs')}: [programs] must hold tables")
            for name, sub in table.items():
                label = f'programs."{name}"'
                if not name or "\0" in name:
                    raise ConfigError(f"{_where(path, lines, None, 'programs')}: empty program name")
                programs[name] = _parse_table(path, lines, label, sub, {**POLICY_KEYS, **MEMORY_KEYS})
        elif not isinstance(table, dict) and (section in POLICY_KEYS or section in DEVICE_KEYS):
            home = "policy" if section in POLICY_KEYS else "devices"
            line = _line_of(lines, "", section)
            raise ConfigError(f"{path}:{line}: '{section}' belongs in [{home}]" if line
                              else f"{path}: '{section}' belongs in [{home}]",
                              hint=f"put it below a [{home}] line")
        else:
            raise ConfigError(
                f"{_where(path, lines, None, section)}: unknown section [{section}]",
                hint="known sections: " + ", ".join("[" + name.replace("*", '"NAME"') + "]"
                                                    for name in SCHEMA if name.count(".") < 2),
            )
    return Config(path=path, settings=settings, programs=programs, limits=limits, sharing=sharing)


def _parse_sharing(path: Path, lines: List[str], table: Any) -> Dict[str, Any]:
    """[sharing] slots, mode, ... and [sharing.devices."UUID or prefix"] slots = N."""
    if not isinstance(table, dict):
        raise ConfigError(f"{_where(path, lines, None, 'sharing')}: [sharing] must be a table")
    out = no_sharing()
    out.update(_parse_table(path, lines, "sharing", {k: v for k, v in table.items() if k != "devices"},
                            SHARING_KEYS))
    sub = table.get("devices", {})
    if not isinstance(sub, dict):
        raise ConfigError(f"{_where(path, lines, 'sharing', 'devices')}: sharing.devices must hold "
                          f"tables such as [sharing.devices.\"GPU-8f3a\"]")
    for name, entry in sub.items():
        label = f'sharing.devices."{name}"'
        if not re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", name):
            raise ConfigError(f"{_where(path, lines, None, label)}: [{label}] does not name a device",
                              hint="use a GPU-... or MIG-... UUID or a prefix of one")
        values = _parse_table(path, lines, label, entry, SHARING_DEVICE_KEYS)
        if not values:
            raise ConfigError(f"{_where(path, lines, None, label)}: [{label}] needs slots = N "
                              f"or a memory key ({', '.join(MEMORY_KEYS)})")
        if "slots" in values:
            out["devices"][name] = values["slots"]
        memory = {k: v for k, v in values.items() if k in MEMORY_KEYS}
        if memory:  # kept apart: the launch cache carries [sharing] as key -> Setting
            out.setdefault("device_memory", {})[name] = memory
    return out


def _parse_limits(path: Path, lines: List[str], table: Any) -> Dict[str, Any]:
    """[limits] max_devices_per_user, [limits.users."NAME"] and [limits.groups."GROUP"]."""
    if not isinstance(table, dict):
        raise ConfigError(f"{_where(path, lines, None, 'limits')}: [limits] must be a table")
    out: Dict[str, Any] = {"default": Setting(0, "default"), "users": {}, "groups": {}}
    plain = {k: v for k, v in table.items() if k not in ("users", "groups")}
    parsed = _parse_table(path, lines, "limits", plain, LIMIT_KEYS)
    if "max_devices_per_user" in parsed:
        out["default"] = parsed["max_devices_per_user"]
    for kind in ("users", "groups"):
        sub = table.get(kind, {})
        if not isinstance(sub, dict):
            raise ConfigError(f"{_where(path, lines, 'limits', kind)}: limits.{kind} must hold "
                              f"tables such as [limits.{kind}.\"NAME\"]")
        for name, entry in sub.items():
            label = f'limits.{kind}."{name}"'
            if not name or "\0" in name:
                raise ConfigError(f"{_where(path, lines, None, 'limits')}: empty name in [limits.{kind}]")
            values = _parse_table(path, lines, label, entry, LIMIT_ENTRY_KEYS)
            if "max_devices" not in values:
                raise ConfigError(f"{_where(path, lines, None, label)}: [{label}] needs max_devices = N")
            out[kind][name] = values["max_devices"]
    return out


def load_config(path: Path) -> Config:
    """The config at PATH; a missing file means all defaults."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return Config(path=path, settings={k: Setting(v, "default") for k, v in DEFAULTS.items()})
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the configuration: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    return parse_config(path, text)


def validate_policy(policy: Mapping[str, Any], source: str) -> Dict[str, Setting]:
    """Check per-program policy from another source (the registry, a CLI flag)."""
    out: Dict[str, Setting] = {}
    for key, raw in policy.items():
        parse = POLICY_KEYS.get(key)
        if parse is None:
            raise ConfigError(f"{source}: unknown policy key '{key}'")
        try:
            out[key] = Setting(parse(raw), source)
        except ValueError as exc:
            raise ConfigError(f"{source}: bad value for '{key}': {exc}") from None
    return out


def format_wait(value: float) -> str:
    return "forever" if value == FOREVER else f"{value:g}"
