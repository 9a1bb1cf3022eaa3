"""The directories of an install root, with their modes, and the runtime area on /run."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Optional

from ..paths import Layout
from .shimfile import install_shim


def ensure_dir(path: Path, mode: int) -> None:
    """PATH as a directory of MODE: made (with its parents) where missing, its mode set where it
    differs; NotADirectoryError where a symlink or a file stands there."""
    path.mkdir(parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def sealed(layout: Layout) -> bool:
    """Whether only the service may open the lease, slot and queue directories: where the
    install runs it (its recorded way), and wherever it runs now, however started
    (docs/admin/ways.md): one arbiter at a time, never the service beside runs that go around it."""
    from .. import locations as loc
    from ..base.daemon import running
    from ..paths import SERVICE, recorded_way

    return (recorded_way(str(layout.root)) == SERVICE
            or running(loc.under(str(layout.root), loc.SERVICE_LOCK)) is not None)


def prepare_runtime(layout: Layout, seal: Optional[bool] = None) -> None:
    """The tmpfs part (/run/cudawrap): lease, slot and queue directories and the queue lock.

    SEAL (None: as sealed() says): the lease, slot and queue directories are root's
    alone, so no user can open a lease file to flock it, nor queue a claim: only the
    service (root) opens them, and hands a run the descriptors it granted. Otherwise users
    open the lease files and queue themselves (the daemonless way). MPS pipe directories
    likewise: reachable by the service's sharers alone (lease/mpsaccess.py), or by everyone."""
    if seal is None:
        seal = sealed(layout)
    ensure_dir(layout.runtime_dir, 0o755)
    ensure_dir(layout.lease_dir, 0o700 if seal else 0o755)
    ensure_dir(layout.share_dir, 0o700 if seal else 0o755)
    # Sticky and world-writable like /tmp: everyone may queue, nobody may unqueue others.
    ensure_dir(layout.queue_dir, 0o1700 if seal else 0o1777)
    fd = os.open(layout.queue_lock, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    os.fchmod(fd, 0o644)
    os.close(fd)
    from ..lease.mpsaccess import prepare as prepare_mps

    prepare_mps(layout, seal)  # each MPS pipe directory: 0700 for the service's ACLs, or 0755


def prepare(layout: Layout, python: str = sys.executable) -> None:
    """Every directory of an install root, the runtime area and the shim."""
    ensure_dir(layout.etc_dir, 0o755)
    ensure_dir(layout.state_dir, 0o755)
    prepare_runtime(layout)
    install_shim(layout, python)
    ensure_dir(layout.shim_dir, 0o755)
