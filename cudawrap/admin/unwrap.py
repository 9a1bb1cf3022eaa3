"""Unwrapping programs: the core under ``cudawrap unwrap`` (the steps are in wrap.py's
docstring). Never prints, never exits: every refusal is a CudawrapError naming the path."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..base import audit
from ..errors import CudawrapError, StateError, UsageError
from ..paths import Layout
from ..policy import registry
from ..policy.registry import UNWRAPPING, WRAPPED, Entry, Registry
from .divert import PACKAGE, Dpkg
from .inspect_wraps import (
    INTERRUPTED, LINK_FILE, LINK_MISSING, LINK_SAME, LINK_SHIM, LINK_SYMLINK, OK, WrapStatus, inspect_entry,
    is_original, link_kind, same_file,
)
from .shimlinks import fsync_dir, remove_own_shim, replace_with_link
from .wrap import SAVED_SUFFIX, Failure, failure_reason, invoking_user, refresh_launch_cache, unsafe_dir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unwrapped:
    link: str
    message: str  # what was done, one line for the admin
    saved: Optional[str] = None  # where a real program was kept when its name was taken


@dataclass(frozen=True)
class UnwrapOutcome:
    unwrapped: Tuple[Unwrapped, ...]
    failed: Tuple[Failure, ...]


def saved_name(link: str) -> str:
    """A free name next to LINK for a real program that cannot go back to LINK."""
    candidate = link + SAVED_SUFFIX
    number = 1
    while os.path.lexists(candidate):
        number += 1
        candidate = f"{link}{SAVED_SUFFIX}.{number}"
    return candidate


def _force_effect(status: WrapStatus) -> str:
    """What --force would do for STATUS, for the refusal message."""
    link = status.entry.link
    if not status.real_present:
        if status.link == LINK_SHIM:
            return "removes the shim link (no real program is left to restore)"
        return "drops the registry entry (no real program is left to restore)"
    if status.link in (LINK_SHIM, LINK_MISSING, LINK_SAME):
        return f"puts {status.entry.real} back as {link} as it is now"
    return f"leaves {link} as it is and keeps the wrapped program as {saved_name(link)}"


def check_unwrap(layout: Layout, entry: Entry, force: bool) -> WrapStatus:
    """Raise StateError unless ENTRY can be unwrapped (with FORCE: unless it can at all)."""
    status = inspect_entry(layout, entry)
    why = unsafe_dir(entry)
    if why is not None:
        if force:
            return status
        raise StateError(f"{entry.link}: {why}; nothing was changed: cudawrap no longer acts there; "
                         "'cudawrap unwrap --force' drops its entry and shim and leaves the files there "
                         "to their owner")
    if status.state == OK or force:
        return status
    if status.state == INTERRUPTED:
        # Finishing an interrupted operation by unwrapping is safe from the states the
        # steps leave behind: the name is the shim link or the same file as the real one.
        if status.link in (LINK_SHIM, LINK_SAME) and status.real_present:
            return status
        if status.link in (LINK_FILE, LINK_SYMLINK) and not status.real_present and is_original(entry, entry.link):
            return status
    raise StateError(f"{entry.link}: {status.state}: {status.detail or 'disk differs from the registry'}; "
                     f"nothing was changed; 'cudawrap unwrap --force' {_force_effect(status)}")


def drop_diversion(entry: Entry, dpkg: Dpkg, rename: bool) -> None:
    """Remove ENTRY's dpkg diversion, if cudawrap's is in place; RENAME moves the diverted
    file back to the name (dpkg-divert --rename)."""
    if entry.diversion is not None and dpkg.diverter(entry.diversion) == PACKAGE:
        dpkg.remove(entry.diversion, rename=rename)


@dataclass
class _Progress:
    """How far an unwrap got: before any file changed, a failure is undone."""

    started: bool = False


def unwrap_one(layout: Layout, entry: Entry, dpkg: Dpkg) -> Unwrapped:
    """Put ENTRY's real program back under its name; the caller holds the lock and has
    called :func:`check_unwrap`. Never deletes a real program: when the name now holds
    something else, both are kept and the message says where."""
    if unsafe_dir(entry) is not None:
        return _let_go(layout, entry, dpkg)
    original = entry
    entry = entry.replace(phase=UNWRAPPING)
    try:
        registry.update(layout, lambda reg: reg.put(entry))
    except CudawrapError as exc:
        raise StateError(f"{entry.link}: could not unwrap it: {exc.message}; nothing was changed") from None
    link = entry.link
    kind = link_kind(layout, entry)
    real_present = os.path.lexists(entry.real)
    progress = _Progress()
    try:
        message, saved = _put_back(layout, entry, dpkg, (kind, real_present), progress)
    except (OSError, CudawrapError) as exc:
        raise _failed(layout, original, progress, exc) from exc
    try:
        registry.update(layout, lambda reg: reg.drop(link))
    except CudawrapError as exc:
        raise StateError(f"{link}: unwrapped, but recording that failed ({exc.message}); "
                         "run 'cudawrap doctor --repair' to record it") from None
    log.info("unwrapped %s (%s)", link, message)
    audit.log("unwrap", program=link, by=invoking_user(), result=message)
    return Unwrapped(link, message, saved)


def _put_back(layout: Layout, entry: Entry, dpkg: Dpkg, found: Tuple[str, bool],
              progress: _Progress) -> Tuple[str, Optional[str]]:
    """The file steps of unwrap_one from what was FOUND (what stands at the link, whether the
    real program exists): (what was done, where a real program was kept)."""
    link, real = entry.link, entry.real
    kind, real_present = found
    saved = None
    if real_present and kind in (LINK_SHIM, LINK_MISSING):
        replace_with_link(real, link)
        progress.started, kind = True, LINK_SAME
    if kind == LINK_SAME:
        drop_diversion(entry, dpkg, rename=True)  # unlinks CUDAWRAP_x: one inode with x
        progress.started = True
        if same_file(link, real):
            os.unlink(real)
        message = f"unwrapped {link}"
    elif real_present:
        saved = saved_name(link)
        os.link(real, saved, follow_symlinks=False)  # link+unlink: never overwrites
        progress.started = True
        os.unlink(real)
        drop_diversion(entry, dpkg, rename=False)
        message = f"unwrapped {link}: left what is there now; the wrapped program was kept as {saved}"
    else:
        if kind == LINK_SHIM:
            os.unlink(link)
            progress.started = True
            message = f"unwrapped {link}: removed the shim link; there was no real program to restore"
        elif kind in (LINK_FILE, LINK_SYMLINK) and is_original(entry, link):
            message = f"unwrapped {link}"  # an interrupted unwrap had already put it back
        else:
            message = f"unwrapped {link}: dropped the entry; there was no real program to restore"
        drop_diversion(entry, dpkg, rename=False)
    fsync_dir(os.path.dirname(link))
    if link_kind(layout, entry) != LINK_SHIM:
        remove_own_shim(layout, link)
    return message, saved


def _failed(layout: Layout, original: Entry, progress: _Progress, exc: BaseException) -> StateError:
    """The error for an unwrap of ORIGINAL that failed with EXC: nothing was changed (the entry
    put back as it was) when no file had changed yet, else it stopped half-way."""
    link = original.link
    if not progress.started and original.phase == WRAPPED:
        try:
            registry.update(layout, lambda reg: reg.put(original))
        except CudawrapError:
            pass
        else:
            return StateError(f"{link}: could not unwrap it: {failure_reason(exc)}; nothing was changed")
    return StateError(f"{link}: unwrap stopped half-way ({failure_reason(exc)}); the program still runs; "
                      "run 'cudawrap doctor --repair' to finish")


def _let_go(layout: Layout, entry: Entry, dpkg: Dpkg) -> Unwrapped:
    """Forget ENTRY without touching its directory, which another user controls (unwrap --force)."""
    remove_own_shim(layout, entry.link)
    drop_diversion(entry, dpkg, rename=False)
    registry.update(layout, lambda reg: reg.drop(entry.link))
    message = (f"unwrapped {entry.link}: dropped its entry and shim; {os.path.dirname(entry.link)} is not "
               f"root's, so its files were left as they are ({entry.real} is the real program)")
    log.info("%s", message)
    audit.log("unwrap", program=entry.link, by=invoking_user(), result=message)
    return Unwrapped(entry.link, message)


def unwrap_programs(
    layout: Layout,
    paths: Sequence[str],
    *,
    everything: bool = False,
    force: bool = False,
    dpkg: Optional[Dpkg] = None,
) -> UnwrapOutcome:
    """Unwrap PATHS (link or CUDAWRAP_ paths), or every entry with EVERYTHING.

    As for wrapping, all are checked before any is changed; a refusal changes nothing.
    """
    dpkg = Dpkg.from_environment() if dpkg is None else dpkg

    def check_all(reg: Registry) -> Tuple[List[Entry], List[Failure]]:
        good: List[Entry] = []
        bad: List[Failure] = []
        wanted: List[Tuple[str, Optional[Entry]]] = (
            [(e.link, e) for e in reg] if everything
            else [(p, reg.find(os.path.abspath(p)) if p else None) for p in paths]
        )
        for path, entry in wanted:
            try:
                if entry is None:
                    raise StateError(f"{os.path.abspath(path) if path else repr(path)}: not wrapped by "
                                     "cudawrap (see 'cudawrap list')")
                if entry in good:
                    raise UsageError(f"{entry.link}: given twice")
                check_unwrap(layout, entry, force)
                good.append(entry)
            except CudawrapError as exc:
                bad.append(Failure(path, exc))
        return good, bad

    _, bad = check_all(registry.load(layout))
    if bad:
        return UnwrapOutcome((), tuple(bad))
    done: List[Unwrapped] = []
    failed: List[Failure] = []
    with registry.lock(layout):
        good, failed = check_all(registry.load(layout))
        for entry in good:
            try:
                done.append(unwrap_one(layout, entry, dpkg))
            except CudawrapError as exc:
                failed.append(Failure(entry.link, exc))
        if done:
            refresh_launch_cache(layout)
    return UnwrapOutcome(tuple(done), tuple(failed))
