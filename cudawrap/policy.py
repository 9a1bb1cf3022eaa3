"""The effective policy of one run, and where each value came from.

Order, later wins: built-in defaults, the config's [policy], its [programs."NAME"], the
wrap's own flags (kept in the registry), then CUDAWRAP_WAIT for this run only.

Parsing TOML and JSON costs ~25 ms of imports, more than everything else a launch does,
so root (sync, wrap, unwrap, config) compiles the result into a ``marshal`` cache keyed
by the inode, size and mtime of both files. The shim uses it only when both keys still
match; otherwise it parses the files itself, so a stale cache can cost time but never
change a decision.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, Optional, Tuple

from . import locations as loc, rootfile
from .errors import UsageError

CACHE_VERSION = 2


def _signature(path: str) -> Optional[Tuple[int, int, int, int]]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _compile(root: str) -> Dict[str, Any]:
    """Parse config and registry into plain data: {"settings", "programs", "links"}."""
    from pathlib import Path

    from .config import load_config, validate_policy
    from .paths import Layout
    from .registry import load

    layout = Layout(Path(root))
    config = load_config(layout.config_file)
    links = {}
    for entry in load(layout).entries:
        link, raw = entry.link, dict(entry.policy)
        checked = validate_policy(raw, f"{layout.registry_file} (wrap of {link})")
        links[link] = {k: (s.value, s.source) for k, s in checked.items()}
    lim = config.limits
    return {
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


def _read_cache(root: str) -> Optional[Dict[str, Any]]:
    data = rootfile.read(root, loc.under(root, loc.LAUNCH_CACHE), CACHE_VERSION)
    if data is None or data.get("signatures") != _signatures(root):
        return None
    return data


def effective(root: str, link: Optional[str], environ: Any = None) -> Dict[str, Tuple[Any, str]]:
    """key -> (value, source) for a run of LINK (a wrapped program's path, or None)."""
    data = _read_cache(root) or _compile(root)
    merged: Dict[str, Tuple[Any, str]] = dict(data["settings"])
    merged["limits"] = (data["limits"], "[limits]")
    if link:
        name = link.rsplit("/", 1)[-1]
        for key in (name, link):
            merged.update(data["programs"].get(key, {}))
        merged.update(data["links"].get(link, {}))
    env = os.environ if environ is None else environ
    raw = env.get("CUDAWRAP_WAIT")
    if raw is not None and raw != "":
        from .config import parse_wait

        try:
            merged["wait"] = (parse_wait(raw), "CUDAWRAP_WAIT")
        except ValueError as exc:
            raise UsageError(f"CUDAWRAP_WAIT={raw[:40]!r}: {exc}",
                             hint="use a number of seconds (0 = do not wait) or 'forever'") from None
    return merged
