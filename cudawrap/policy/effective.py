"""The effective policy of one run, and where each value came from.

Order, later wins: built-in defaults, the config's [policy], its [programs."NAME"], the
wrap's own flags (kept in the registry), then CUDAWRAP_WAIT for this run only.

A user's per-run asks (CUDAWRAP_GPUS, CUDAWRAP_MODEL, ... or the same as switches and
keyword arguments) only narrow: each filter becomes the stricter of the admin's and the
user's, and a count above the program's max_gpus is refused.

Parsing TOML and JSON costs ~25 ms of imports, more than everything else a launch does,
so root (sync, wrap, unwrap, config) compiles the result into a ``marshal`` cache keyed
by the inode, size and mtime of both files. The shim uses it only when both keys still
match; otherwise it parses the files itself, so a stale cache can cost time but never
change a decision.
"""

import posix

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from .. import locations as loc
from ..base import posixos, rootfile
from ..errors import ConfigError, NoDeviceError, UsageError

CACHE_VERSION = 4  # 2: the filter keys (model, min_memory_mib, ...) and max_gpus; 3: [limits], reserve_after;
# 4: [sharing] and share


class Settings:
    """The settings of one run: each key's value, and where it was set (a config line, the
    registry, an environment variable: what `cudawrap config` shows and a refusal names).

    The facts a launch goes by are attributes; any key is value(KEY) and source(KEY). A
    user's asks change it only through narrow(), ask() and ask_share() below."""

    __slots__ = ("_set",)

    def __init__(self, pairs: "Mapping[str, Tuple[Any, str]]") -> None:
        self._set: "Dict[str, Tuple[Any, str]]" = {k: (v, src) for k, (v, src) in pairs.items()}

    def __contains__(self, key: str) -> bool:
        return key in self._set

    def value(self, key: str, default: "Any" = None) -> "Any":
        return self._set[key][0] if key in self._set else default

    def source(self, key: str, default: str = "default") -> str:
        return self._set[key][1] if key in self._set else default

    def set(self, key: str, value: "Any", source: str) -> None:
        self._set[key] = (value, source)

    def values(self) -> "Dict[str, Any]":
        """Key -> value, for the code that decides (it has no use for sources)."""
        return {k: v for k, (v, _src) in self._set.items()}

    def keys(self) -> "Iterator[str]":
        return iter(self._set)

    @property
    def gpus(self) -> int:
        return self._set["gpus"][0]

    @property
    def wait(self) -> float:
        return self._set["wait"][0]

    @property
    def share(self) -> bool:
        return bool(self.value("share", False))

    @property
    def limits(self) -> "Any":
        """[limits] as the launch cache holds it (policy.limits reads it)."""
        return self.value("limits")

    @property
    def sharing(self) -> "Dict[str, Any]":
        """[sharing] as the launch cache holds it (lease.sharing reads it)."""
        return self._set["sharing"][0]

    @property
    def memory_limit_mib(self) -> "Optional[int]":
        return self.value("memory_limit_mib")


def _signature(path: str) -> "Optional[Tuple[int, int, int, int]]":
    try:
        st = posix.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _compile(root: str) -> "Dict[str, Any]":
    """Parse config and registry into plain data: {"settings", "programs", "links"}."""
    from pathlib import Path

    from .config import load_config, validate_policy
    from ..paths import Layout
    from .registry import load

    layout = Layout(Path(root))
    config = load_config(layout.config_file)
    links = {}
    for entry in load(layout).entries:
        link, raw = entry.link, dict(entry.policy)
        checked = validate_policy(raw, f"{layout.registry_file} (wrap of {link})")
        links[link] = {k: (s.value, s.source) for k, s in checked.items()}
    lim = config.limits
    sharing = {k: (s.value, s.source) for k, s in config.sharing.items() if k not in ("devices", "device_memory")}
    sharing["device_memory"] = ({n: {k: s.value for k, s in t.items()}
                                 for n, t in config.sharing.get("device_memory", {}).items()}, "[sharing.devices]")
    sharing["devices"] = {n: (s.value, s.source) for n, s in config.sharing["devices"].items()}
    return {
        "sharing": sharing,
        "limits": {"default": (lim["default"].value, lim["default"].source),
                   "users": {n: (v.value, v.source) for n, v in lim["users"].items()},
                   "groups": {n: (v.value, v.source) for n, v in lim["groups"].items()}},
        "settings": {k: (s.value, s.source) for k, s in config.settings.items()},
        "programs": {name: {k: (s.value, s.source) for k, s in table.items()}
                     for name, table in config.programs.items()},
        "links": links,
    }


def _signatures(root: str) -> tuple:
    return (_signature(loc.under(root, loc.CONFIG_FILE)), _signature(loc.under(root, loc.REGISTRY_FILE)))


file_signature = _signature  # one file's identity, as files_signature takes each


def files_signature(root: str) -> tuple:
    """What effective() reads, as file identities: equal, it gives the same settings."""
    return (_signature(loc.under(root, loc.LAUNCH_CACHE)),) + _signatures(root)


def write_cache(root: str) -> str:
    """Compile the policy cache for the shim (root runs this); returns its path."""
    before = _signatures(root)
    data = _compile(root)
    if _signatures(root) != before:
        return ""  # changed while we read: leave it to the next writer
    data["version"] = CACHE_VERSION
    data["signatures"] = before
    path = loc.under(root, loc.LAUNCH_CACHE)
    rootfile.write(path, data)
    return path


def cache_is_current(root: str) -> bool:
    return _read_cache(root) is not None


def _read_cache(root: str) -> "Optional[Dict[str, Any]]":
    data = rootfile.read(root, loc.under(root, loc.LAUNCH_CACHE), CACHE_VERSION)
    if data is None or data.get("signatures") != _signatures(root):
        return None
    return data


# The filters (filters.py), in the order they are checked, and so the order in which
# filters.explain() names them, with the values that filter nothing. Kept here so that a
# launch without any filter need not import filters.py.
FILTER_KEYS = ("devices", "model", "min_memory_mib", "min_free_memory_mib", "max_utilization")
UNFILTERED: "Dict[str, Any]" = {
    "devices": (), "model": "", "min_memory_mib": 0, "min_free_memory_mib": 0, "max_utilization": 100,
}


def filtered(value: "Dict[str, Any]") -> bool:
    """Whether VALUE (key -> value, the policy in force) sets any filter."""
    return any(value.get(k, UNFILTERED[k]) != UNFILTERED[k] for k in FILTER_KEYS)


def narrowed(key: str, admin: "Any", user: "Any") -> "Any":
    """KEY's value when the admin set ADMIN and a user asks USER: the stricter of the two.

    A user may narrow what the admin allows, never widen it: model words add up (every
    one must match), memory floors take the higher, the utilisation ceiling the lower.
    """
    if key == "model":
        words = admin.split()
        return " ".join(words + [w for w in user.split() if w not in words])
    if key in ("min_memory_mib", "min_free_memory_mib"):
        return max(admin, user)
    if key == "max_utilization":
        return min(admin, user)
    raise KeyError(f"{key} is not a filter a run may narrow")


# key -> the environment variable a user sets to ask for it in one run.
RUN_ENV = (
    ("gpus", "CUDAWRAP_GPUS"),
    ("model", "CUDAWRAP_MODEL"),
    ("min_memory_mib", "CUDAWRAP_MIN_MEMORY_MIB"),
    ("min_free_memory_mib", "CUDAWRAP_MIN_FREE_MEMORY_MIB"),
    ("max_utilization", "CUDAWRAP_MAX_UTILIZATION"),
)


def _parse_ask(key: str, raw: "Any") -> "Any":
    """RAW (text from the environment or a switch, or a Python value) checked as KEY."""
    from .config import POLICY_KEYS

    if isinstance(raw, str) and key != "model":
        text = raw.strip()
        digits = text[1:] if text.startswith("-") else text
        if not (digits.isascii() and digits.isdigit()) or len(text) > 12:
            raise ValueError(f"{raw[:40]!r} is not a whole number")
        raw = int(text)
    return POLICY_KEYS[key](raw)


def check_count(settings: "Settings", count: int) -> None:
    """Refuse (75) a run asking for more devices than its program's max_gpus allows."""
    ceiling, source = settings.value("max_gpus", count), settings.source("max_gpus", "")
    if count > ceiling:
        raise NoDeviceError(f"{count} devices asked for, but a run of this program may have at most "
                            f"{ceiling} (max_gpus, {source})",
                            hint="ask for fewer devices, or ask an admin to raise max_gpus")


def narrow(settings: "Settings", key: str, raw: "Any", source: str) -> None:
    """Apply a user's ask RAW for KEY, made by SOURCE, to SETTINGS; ValueError if malformed.

    The count replaces the program's (within max_gpus); a filter becomes the stricter of
    the admin's and the user's, so a user can never widen what the admin set.
    """
    value = _parse_ask(key, raw)
    if key == "gpus":
        check_count(settings, value)
        settings.set(key, value, source)
        return
    admin, admin_source = settings.value(key, UNFILTERED[key]), settings.source(key)
    combined = narrowed(key, admin, value)
    if combined == admin and admin != UNFILTERED[key]:
        return  # the admin's is already as strict
    both = admin != UNFILTERED[key] and combined != value
    settings.set(key, combined, f"{admin_source} and {source}" if both else source)


def ask(settings: "Settings", key: str, raw: "Any", source: str, shown: str) -> None:
    """narrow(), with a malformed RAW refused as a usage error (64) that names SHOWN."""
    try:
        narrow(settings, key, raw, source)
    except ValueError as exc:
        raise UsageError(f"{shown}: {exc}",
                         hint="`cudawrap config` lists the settings and what they take") from None


def ask_share(settings: "Settings", raw: "Any", source: str, shown: str) -> None:
    """A user's ask to share a device for one run (1/true) or not (0/false).

    Sharing only narrows what a run takes, so anyone may ask for it; asking for a whole
    device where the admin made a program shared is refused (a user may not widen).
    """
    text = str(raw).strip().lower() if not isinstance(raw, bool) else ("1" if raw else "0")
    if text not in ("1", "0", "true", "false", "yes", "no"):
        raise UsageError(f"{shown}: not 1 or 0", hint="CUDAWRAP_SHARE=1 shares a device for this run")
    wanted = text in ("1", "true", "yes")
    current, where = settings.share, settings.source("share")
    if current and not wanted:
        raise UsageError(f"{shown}: this program shares its device ({where}); a run may not take it whole",
                         hint="ask an admin, or unset CUDAWRAP_SHARE")
    if wanted and not current:
        settings.set("share", True, source)


def _check_ceiling(merged: "Settings") -> None:
    if "max_gpus" in merged and merged.gpus > merged.value("max_gpus"):
        gpus, where = merged.gpus, merged.source("gpus")
        ceiling, ceiling_where = merged.value("max_gpus"), merged.source("max_gpus")
        raise ConfigError(f"{where}: gpus = {gpus} is above max_gpus = {ceiling} ({ceiling_where})",
                          hint="a program's own count must be within its max_gpus")


def queue_bounds(root: str) -> "Tuple[float, int]":
    """(the shortest reserve_after, the largest max_gpus) the admin's config and wraps give
    any run. Queue entries are written by users: whatever one claims, its reservation starts
    no sooner and its count is served no larger (schedule.Bounds). Read from the files, never
    from the settings a caller passes (the API's launch.obtain takes any)."""
    from .config import DEFAULTS

    data = _read_cache(root) or _compile(root)
    tables = [data["settings"], *data["programs"].values(), *data["links"].values()]
    floors = [t["reserve_after"][0] for t in tables if "reserve_after" in t] or [DEFAULTS["reserve_after"]]
    ceilings = [t["max_gpus"][0] for t in tables if "max_gpus" in t] or [DEFAULTS["max_gpus"]]
    return min(floors), max(ceilings)


def effective(root: str, link: "Optional[str]", environ: "Any" = None) -> "Settings":
    """The settings of a run of LINK (a wrapped program's path, or None)."""
    data = _read_cache(root) or _compile(root)
    merged: "Dict[str, Tuple[Any, str]]" = dict(data["settings"])
    merged["limits"] = (data["limits"], "[limits]")
    merged["sharing"] = (data["sharing"], "[sharing]")
    if link:
        name = link.rsplit("/", 1)[-1]
        for key in (name, link):
            merged.update(data["programs"].get(key, {}))
        merged.update(data["links"].get(link, {}))
    settings = Settings(merged)
    env = posixos.environ() if environ is None else environ
    raw = env.get("CUDAWRAP_WAIT")
    if raw is not None and raw != "":
        from .config import parse_wait

        try:
            settings.set("wait", parse_wait(raw), "CUDAWRAP_WAIT")
        except ValueError as exc:
            raise UsageError(f"CUDAWRAP_WAIT={raw[:40]!r}: {exc}",
                             hint="use a number of seconds (0 = do not wait) or 'forever'") from None
    _check_ceiling(settings)
    raw = env.get("CUDAWRAP_SHARE")
    if raw is not None and raw != "":
        ask_share(settings, raw, "environment (CUDAWRAP_SHARE)", f"CUDAWRAP_SHARE={raw[:40]!r}")
    for key, name in RUN_ENV:
        raw = env.get(name)
        if raw is not None and raw != "":
            ask(settings, key, raw, f"environment ({name})", f"{name}={raw[:40]!r}")
    return settings
