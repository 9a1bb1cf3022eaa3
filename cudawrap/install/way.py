"""Which way an install runs, recorded once (docs/admin/ways.md): its service grants every
lease, or each run decides for itself. install.sh, the .deb and `cudawrap way` write the
file (paths.Layout.way_file, root's, 0644); sync, the general launch and doctor read it.
"""
from __future__ import annotations

import os
from typing import Optional

from ..paths import DAEMONLESS, SERVICE, WAYS, Layout, recorded_way

__all__ = ["DAEMONLESS", "SERVICE", "WAYS", "read_way", "write_way", "way_of_older_install", "record_way"]


def read_way(layout: Layout) -> Optional[str]:
    return recorded_way(str(layout.root))


def write_way(layout: Layout, way: str) -> None:
    """Record WAY for LAYOUT's install: written whole beside the file, then renamed over it,
    so a run reading it meanwhile sees the old way or the new, never half of one."""
    if way not in WAYS:
        raise ValueError(f"no way {way!r}")
    layout.state_dir.mkdir(parents=True, exist_ok=True)
    path = layout.way_file
    tmp = path.with_name(path.name + ".new")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, f"{way}\n".encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def way_of_older_install(layout: Layout) -> str:
    """How an install from before the way file ran: with the service as its only arbiter where
    its config said `[service] enforce = true`, or a service unit is enabled, or a service
    runs for it now; else daemonless (an upgrade keeps the way an install runs)."""
    from .. import locations as loc
    from ..base.daemon import running
    from .units import SERVICE_UNIT, unit_wants_link

    if running(loc.under(str(layout.root), loc.SERVICE_LOCK)) is not None:
        return SERVICE
    if unit_wants_link(layout, SERVICE_UNIT).is_symlink():
        return SERVICE
    try:
        from ..policy.config import load_config

        if load_config(layout.config_file)["enforce"] is True:
            return SERVICE
    except Exception:  # a broken config says so elsewhere; it decides no way here
        pass
    return DAEMONLESS


def record_way(layout: Layout, fresh: str) -> str:
    """The way LAYOUT's install runs, recorded if it was not: kept where recorded, an older
    install's (way_of_older_install) where it is installed already, else FRESH."""
    way = read_way(layout)
    if way is None:
        existed = layout.config_file.exists() or layout.registry_file.exists()
        way = way_of_older_install(layout) if existed else fresh
        write_way(layout, way)
    return way
