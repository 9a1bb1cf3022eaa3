"""A wrapped name's shim link and its own shim: made, replaced and removed without the name
ever missing for a moment (the steps of wrap.py's docstring, unwrap and doctor's repairs).

A name is only ever *replaced*, with ``rename`` from a temporary name beside it; a stray
temporary name is always a second name of something that still exists elsewhere.
"""
from __future__ import annotations

import logging
import os
import stat
from typing import Callable, List

from ..errors import StateError
from ..paths import Layout
from ..policy import registry
from ..policy.registry import WRAPPED, Entry
from .inspect_wraps import LINK_SHIM, link_kind

log = logging.getLogger(__name__)

TMP_PREFIX = ".cudawrap-tmp-"


def tmp_name(path: str) -> str:
    """The temporary name used next to PATH while replacing it."""
    head, tail = os.path.split(path)
    return os.path.join(head, TMP_PREFIX + tail)


def fsync_dir(path: str) -> None:
    """Make a rename in PATH durable, as far as the file system lets us (never raises)."""
    try:
        registry.fsync_dir(path)
    except OSError as exc:  # the rename is done; durability is best effort here
        log.debug("fsync of %s failed: %s", path, exc)


def clear_tmp(path: str) -> None:
    """Remove a stale temporary name: only ever a symlink or a second name of a file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink > 1):
        os.unlink(path)
    else:
        raise StateError(f"{path} is in the way and may be the only copy of a file; move it away")


def replace(dest: str, make: Callable[[str], None]) -> None:
    """Create a name with MAKE(tmp) beside DEST, then rename it over DEST: DEST is replaced
    atomically, never missing for a moment."""
    tmp = tmp_name(dest)
    clear_tmp(tmp)
    make(tmp)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(dest))


def replace_with_link(source: str, dest: str) -> None:
    """Make DEST a hard link of SOURCE (a symlink itself, not its target)."""
    replace(dest, lambda tmp: os.link(source, tmp, follow_symlinks=False))


def replace_with_shim_link(layout: Layout, dest: str) -> None:
    """Make DEST a symlink to its own shim (written first)."""
    from ..install.installation import install_program_shim

    install_program_shim(layout, dest)
    replace(dest, lambda tmp: os.symlink(os.fspath(layout.program_shim(dest)), tmp))


def remove_own_shim(layout: Layout, link: str) -> None:
    """Remove LINK's own shim once nothing leads to it; a file that is no longer a shim (a
    build copied through the link) is kept."""
    from ..install.installation import shim_version

    shim = layout.program_shim(link)
    if shim_version(shim):
        try:
            os.unlink(shim)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a leftover shim is harmless: nothing leads to it any more
            log.warning("could not remove the shim %s: %s", shim, exc.strerror)


# --- shims after an upgrade (the installer) and for doctor's repairs -------------------


def own_shim(layout: Layout, entry: Entry) -> str:
    """Give ENTRY its own shim (it leads to the shared one, or its own is stale or missing)."""
    replace_with_shim_link(layout, entry.link)
    log.info("gave %s its own shim %s", entry.link, layout.program_shim(entry.link))
    return f"wrote its own shim {layout.program_shim(entry.link)} and pointed {entry.link} at it"


def refresh_shims(layout: Layout) -> List[str]:
    """After an upgrade: rewrite every wrapped program's own shim and give programs wrapped
    by older versions (a link to the shared shim) their own. A shim a deploy overwrote is
    left for `cudawrap doctor --repair`, which adopts the build. Returns what was done."""
    from ..install.installation import install_program_shim, shim_version

    done: List[str] = []
    if not layout.registry_file.exists():
        return done
    with registry.lock(layout):
        for entry in registry.load(layout):
            if entry.phase != WRAPPED or link_kind(layout, entry) != LINK_SHIM:
                continue
            own = layout.program_shim(entry.link)
            if os.path.realpath(entry.link) != os.path.realpath(own):
                done.append(own_shim(layout, entry))
            elif shim_version(own) and install_program_shim(layout, entry.link):
                done.append(f"refreshed the shim of {entry.link}")
    return done
