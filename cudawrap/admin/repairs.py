"""The repairs `cudawrap doctor --repair` makes to wraps (see wrap.py for the states they
complete). Each returns what it did, in words; the caller holds the registry's lock."""
from __future__ import annotations

import logging
import os
from typing import Any, Optional, Tuple

from .. import __version__
from ..base import audit
from ..policy import registry
from ..errors import StateError
from ..paths import Layout
from ..policy.registry import UNWRAPPING, WRAPPED, Entry
from .divert import PACKAGE, Dpkg, real_name
from .inspect_wraps import (
    LINK_FILE, LINK_MISSING, LINK_SAME, LINK_SHIM, LINK_SYMLINK, facts_of, inspect_entry, is_original, link_kind,
    own_shim_state,
)
from .shimlinks import clear_tmp, remove_own_shim, replace, replace_with_link, replace_with_shim_link
from .unwrap import drop_diversion, saved_name, unwrap_one
from .wrap import utc_now

log = logging.getLogger(__name__)


def _record(layout: Layout, entry: Entry, **changes: Any) -> Entry:
    facts = facts_of(entry.real)
    new = entry.replace(sha256=facts.sha256, mode=facts.mode, uid=facts.uid, gid=facts.gid,
                        stat=facts.stamp, **changes)
    registry.update(layout, lambda reg: reg.put(new))
    return new


def _ensure_diversion(entry: Entry, dpkg: Dpkg) -> Tuple[Entry, Optional[str]]:
    """ENTRY with the diversion it needs in place (dpkg may have come to own the file)."""
    if entry.diversion is None:
        owner = dpkg.owner(entry.link)
        if owner is None:
            return entry, None
        entry = entry.replace(package=owner[0], diversion=owner[1])
    if dpkg.diverter(entry.diversion) == PACKAGE:  # type: ignore[arg-type]
        return entry, None
    dpkg.add(entry.diversion)  # type: ignore[arg-type]
    return entry, f"diverted {entry.diversion} (package {entry.package}) so upgrades cannot replace the link"


def finish(layout: Layout, entry: Entry, dpkg: Dpkg) -> str:
    """Complete an interrupted create or unwrap of ENTRY; returns what was done."""
    if entry.phase == UNWRAPPING:
        return unwrap_one(layout, entry, dpkg).message + " (finished an interrupted unwrap)"
    kind = link_kind(layout, entry)
    link, real = entry.link, entry.real
    if kind in (LINK_FILE, LINK_SYMLINK) and not os.path.lexists(real) and is_original(entry, link):
        os.link(link, real, follow_symlinks=False)
        kind = LINK_SAME
    if kind not in (LINK_SAME, LINK_SHIM, LINK_MISSING) or not os.path.lexists(real):
        raise StateError(f"{link}: cannot finish the interrupted create: "
                         f"{inspect_entry(layout, entry.replace(phase=WRAPPED)).detail}; "
                         f"'cudawrap unwrap --force {link}' gives up the wrap")
    entry, _ = _ensure_diversion(entry, dpkg)
    if kind != LINK_SHIM or own_shim_state(layout, link) != "own":
        replace_with_shim_link(layout, link)
    _record(layout, entry, phase=WRAPPED)
    log.info("finished the interrupted wrap of %s", link)
    return f"finished the interrupted wrap of {link}"


def _keep_old_real(entry: Entry) -> str:
    """A second name for ENTRY's real program before a new build replaces it; returns it."""
    saved = saved_name(entry.link)
    os.link(entry.real, saved, follow_symlinks=False)  # fails rather than overwrite
    return saved


def rewrap(layout: Layout, entry: Entry, dpkg: Dpkg) -> str:
    """The name holds a new binary (an upgrade or `install` replaced the shim link): make the
    new binary the real program, keep the old one beside it, and put the shim link back."""
    link, real = entry.link, entry.real
    old = entry.sha256
    saved = _keep_old_real(entry) if os.path.lexists(real) else None
    replace_with_link(link, real)  # the new binary is now also CUDAWRAP_x
    entry, _ = _ensure_diversion(entry, dpkg)
    replace_with_shim_link(layout, link)
    entry = _record(layout, entry)
    log.info("re-wrapped %s: new binary %s replaced %s (kept as %s)", link, entry.sha256, old, saved)
    audit.log("rewrap", program=link, sha256=entry.sha256, previous=old, kept=saved or "none")
    kept = f"; the previous real program (sha256 {old[:12]}...) was kept as {saved}" if saved else ""
    return (f"re-wrapped {link}: the new binary there became {real}, replacing the one wrapped "
            f"on {entry.wrapped_at}{kept}")


def adopt_build(layout: Layout, entry: Entry) -> str:
    """A deploy copied a new build through ENTRY's link into its own shim: make that build the
    real program (the old one kept beside it) and write the shim anew."""
    link, real = entry.link, entry.real
    shim = os.fspath(layout.program_shim(link))
    old = entry.sha256
    saved = _keep_old_real(entry) if os.path.lexists(real) else None

    def copy(tmp: str) -> None:
        import shutil

        # A copy, not a link: the shim directory may be on another file system.
        shutil.copyfile(shim, tmp, follow_symlinks=False)
        shutil.copymode(shim, tmp)

    replace(real, copy)
    from ..install.installation import install_program_shim

    install_program_shim(layout, link)
    entry = _record(layout, entry)
    log.info("adopted the build copied through %s as %s (kept the old one as %s)", link, real, saved)
    audit.log("adopt-build", program=link, sha256=entry.sha256, previous=old, kept=saved or "none")
    kept = f"; the previous real program (sha256 {old[:12]}...) was kept as {saved}" if saved else ""
    return f"made the new build {real} and restored the shim{kept}"


def relink(layout: Layout, entry: Entry) -> str:
    """Recreate a missing shim link (or the missing shim it leads to)."""
    replace_with_shim_link(layout, entry.link)
    log.info("recreated the shim link %s", entry.link)
    return f"recreated the shim link {entry.link}"


def forget(layout: Layout, entry: Entry, dpkg: Dpkg) -> str:
    """The real program is gone: remove our shim link (it leads nowhere), the diversion
    and the entry."""
    removed = ""
    if link_kind(layout, entry) == LINK_SHIM:
        os.unlink(entry.link)
        removed = " and the shim link"
    remove_own_shim(layout, entry.link)
    drop_diversion(entry, dpkg, rename=False)
    registry.update(layout, lambda reg: reg.drop(entry.link))
    log.info("forgot %s: real program %s is gone", entry.link, entry.real)
    return f"removed the registry entry{removed} of {entry.link}: its real program {entry.real} is gone"


def accept(layout: Layout, entry: Entry) -> str:
    """Record the real program as it is now (after an upgrade through the diversion)."""
    new = _record(layout, entry)
    log.info("recorded the new checksum of %s: %s (was %s)", entry.real, new.sha256, entry.sha256)
    return f"recorded {entry.real} as it is now (sha256 {new.sha256[:12]}..., was {entry.sha256[:12]}...)"


def ensure_diversion(layout: Layout, entry: Entry, dpkg: Dpkg) -> str:
    """Add a diversion ENTRY lacks; returns what was done."""
    new, done = _ensure_diversion(entry, dpkg)
    if not done:
        return "the diversion was already in place"
    registry.update(layout, lambda reg: reg.put(new))
    log.info("%s", done)
    return done


def remove_tmp(path: str) -> str:
    """Remove a temporary name an interrupted command left (never an only copy)."""
    clear_tmp(path)
    return "removed it"


def drop_stray_diversion(dpkg: Dpkg, name: str) -> str:
    """Remove a diversion cudawrap made for a program it no longer wraps."""
    dpkg.remove(name, rename=False)
    log.info("removed the stray diversion of %s", name)
    return "removed the diversion"


def adopt(layout: Layout, link: str, dpkg: Dpkg) -> str:
    """Register a shim link whose CUDAWRAP_ program exists but has no entry."""
    real = real_name(link)
    name = dpkg.name_of(link)
    diversion = name if name is not None and dpkg.diverter(name) == PACKAGE else None
    owner = dpkg.owner(link) if diversion else None
    facts = facts_of(real)
    entry = Entry(
        link=link, real=real, sha256=facts.sha256, mode=facts.mode, uid=facts.uid, gid=facts.gid,
        symlink=facts.symlink, package=owner[0] if owner else None, diversion=diversion, policy={},
        wrapped_by="cudawrap doctor", wrapped_at=utc_now(), cudawrap_version=__version__,
        phase=WRAPPED, stat=facts.stamp,
    )
    registry.update(layout, lambda reg: reg.put(entry))
    log.info("registered the unregistered wrap %s", link)
    return f"registered {link} (its per-program policy was lost; wrap it anew to set one)"

