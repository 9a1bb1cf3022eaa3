"""The admin's TOML configuration: parsed strictly, with the origin of every value kept.

A typo in a key or a value of the wrong type is a ConfigError naming file, line and key,
raised from the shim as well as the CLI: a broken config must never silently change
which devices people get. The values' parsers are in values.py, the tables and their keys
in keys.py; their names are exported here too, where callers have always found them.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..errors import ConfigError
from .keys import (  # noqa: F401 - re-exported
    DEFAULTS, DESCRIPTIONS, DEVICE_KEYS, FOREIGN_RULES, LIMIT_DESCRIPTIONS, LIMIT_ENTRY_KEYS, LIMIT_KEYS,
    MEMORY_KEYS, MULTI_MIG_RULES, NO_DRIVER_RULES, NOTES, OPS_SECTIONS, RETIRED, PLACEMENTS, POLICY_KEYS, SCHEMA,
    SHARING_DESCRIPTIONS, SHARING_DEVICE_KEYS, SHARING_KEYS, SHARING_MODES,
)
from .values import (  # noqa: F401 - re-exported
    FOREVER, MAX_GPUS, MAX_SLOTS, MAX_WAIT_S, format_wait, parse_devices, parse_gpus, parse_model, parse_wait,
)

@dataclass(frozen=True)
class Setting:
    value: Any
    source: str  # "default", "FILE:LINE", "registry", "CUDAWRAP_WAIT", ...


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


# tomllib's (and tomli's) words for a table declared twice: "Cannot declare ('policy',) twice".
_TWICE = re.compile(r"Cannot declare \((.*?),?\) twice \(at line (\d+)")


def _declared_twice(path: Path, lines: List[str], error: str) -> Optional[ConfigError]:
    """ERROR, tomllib's for a table declared twice, said with the line where the table
    already is and what to do; None for any other error."""
    found = _TWICE.search(error)
    if found is None:
        return None
    parts = [part.strip().strip("'\"") for part in found.group(1).split(",")]
    name = ".".join(p if re.fullmatch(r"[A-Za-z0-9_-]+", p) else f'"{p}"' for p in parts if p)
    first = _line_of(lines, None, name)
    if not name or not first or first >= int(found.group(2)):
        return None
    return ConfigError(f"{path}:{found.group(2)}: [{name}] appears twice: it is already at line {first}",
                       hint=f"put these settings below the [{name}] of line {first} and remove this "
                            f"[{name}] line (a TOML table may appear only once)")


def _home_of(key: str) -> Optional[str]:
    """The table of the main settings that KEY belongs in, if any."""
    for table, keys in (("devices", DEVICE_KEYS), ("policy", POLICY_KEYS), *OPS_SECTIONS.items()):
        if key in keys:
            return table
    return None


def _header_hint(lines: List[str], table: str) -> str:
    """What to do with a key that belongs in [TABLE]: uncomment the default file's #[TABLE]."""
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if stripped.startswith("#") and _norm_table(stripped[1:].strip().strip("[]")) == table \
                and stripped[1:].strip().startswith("["):
            return f"remove the '#' before the #[{table}] of line {number}, or put it below a [{table}] line"
    return f"put it below a [{table}] line"


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
            home = _home_of(key)
            raise ConfigError(
                f"{where}: unknown key '{key}' in [{table_name}]",
                hint=f"'{key}' belongs in [{home}]: {_header_hint(lines, home)}" if home
                else f"known keys there: {known}",
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
        twice = _declared_twice(path, text.splitlines(), str(exc))
        if twice is not None:
            raise twice from None
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
                              hint=_header_hint(lines, home))
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


def retired_notes(config: Config) -> List[str]:
    """One line per retired key CONFIG sets (keys.RETIRED), where it sets it."""
    return [f"{config.settings[key].source}: {why}" for key, why in RETIRED.items()
            if key in config.settings and config.settings[key].source != "default"]


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
