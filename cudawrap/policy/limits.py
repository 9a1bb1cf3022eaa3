"""Per-user device limits from the config's [limits] tables.

A user's limit: their [limits.users."NAME"] entry if there is one; otherwise the largest of
the [limits.groups."GROUP"] entries of groups they belong to (0 there means no limit);
otherwise [limits] max_devices_per_user. 0 = no limit. Root is a user like any other.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, Mapping, Tuple

NO_LIMITS: Dict[str, Any] = {"default": (0, "default"), "users": {}, "groups": {}}


def _group_names(name: str, gid: int) -> set:
    import grp
    import os

    names = set()
    try:
        gids = os.getgrouplist(name, gid)
    except (OSError, KeyError):
        gids = [gid]
    for g in gids:
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            pass
    return names


def limit_with_source(uid: int, limits: Mapping[str, Any]) -> Tuple[int, str]:
    """(most devices UID may hold, where that comes from); 0 = no limit."""
    users = limits.get("users", {})
    groups = limits.get("groups", {})
    default = limits.get("default", (0, "default"))
    if not users and not groups:
        return default
    import pwd

    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return default
    if entry.pw_name in users:
        return users[entry.pw_name]
    if groups:
        applying = [groups[g] for g in sorted(_group_names(entry.pw_name, entry.pw_gid)) if g in groups]
        if applying:
            if any(value == 0 for value, _src in applying):
                return next(item for item in applying if item[0] == 0)
            return max(applying)
    return default


def limit_for(uid: int, limits: Mapping[str, Any]) -> int:
    return limit_with_source(uid, limits)[0]
