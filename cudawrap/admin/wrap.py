"""Wrapping and unwrapping programs: the core under ``create-cudawrap`` and ``cudawrap unwrap``.

Never prints, never exits: every refusal is a CudawrapError naming the path. Unwrapping is
in unwrap.py, doctor's repairs of interrupted or outdated wraps in repairs.py.

The promise is that a wrapped name never stops being runnable, so no step removes or
renames the name itself; it is only ever *replaced* with ``rename``:

create ``/d/x`` (entry written first with phase "wrapping"):
  1. hard-link ``/d/x`` to ``/d/CUDAWRAP_x`` (same directory, so same file system);
  2. if dpkg ships ``/d/x``: ``dpkg-divert --no-rename --add`` (see divert.py for why not --rename);
  3. make the symlink ``/d/.cudawrap-tmp-x`` -> shim and rename it over ``/d/x``;
  4. entry phase "wrapped".
unwrap (entry phase "unwrapping" first):
  1. hard-link ``/d/CUDAWRAP_x`` to ``/d/.cudawrap-tmp-x`` and rename that over ``/d/x``;
  2. ``dpkg-divert --rename --remove`` (both names are one inode, so it just unlinks
     CUDAWRAP_x), or unlink ``/d/CUDAWRAP_x`` ourselves when there is no diversion;
  3. drop the entry.

Every intermediate state is an entry in phase "wrapping"/"unwrapping" plus a link path
that is the original program, the same inode as CUDAWRAP_x, or the shim link: each runs
the program, and :func:`repairs.finish` completes the operation from any of them. A stray
``.cudawrap-tmp-x`` is always a second name of something that still exists elsewhere.

A name that is a symlink to a program (``/usr/bin/recon -> /opt/recon-2.1/bin/recon``) is
wrapped by moving *the symlink itself* to ``CUDAWRAP_recon``: the target stays untouched
(other names may lead to it, and it may live on another file system), a relative link
still resolves because it stays in the same directory, and unwrap puts back the very
same symlink.
"""
from __future__ import annotations

import getpass
import logging
import os
import stat
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

from .. import __version__
from ..base import audit
from ..policy import registry
from .divert import PACKAGE, Dpkg, real_name, rpm_package
from ..errors import CudawrapError, NotPermitted, StateError, UsageError
from .inspect_wraps import (
    LINK_SHIM, canonical, facts_of, is_shim_link, link_kind,
    same_file,
    stamp_of, symlink_chain,
)
from ..paths import REAL_PREFIX, Layout
from ..policy.registry import WRAPPED, WRAPPING, Entry, Registry
from ..base.safepath import trusted_uids, unsafe_reason

log = logging.getLogger(__name__)

TMP_PREFIX = ".cudawrap-tmp-"
SAVED_SUFFIX = ".cudawrap-saved"
NAME_MAX = 255


def tmp_name(path: str) -> str:
    """The temporary name used next to PATH while replacing it."""
    head, tail = os.path.split(path)
    return os.path.join(head, TMP_PREFIX + tail)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def invoking_user() -> str:
    """Who asked: the sudo caller when run through sudo, else this process's user."""
    return os.environ.get("SUDO_USER") or getpass.getuser()


def _fsync_dir(path: str) -> None:
    try:
        registry.fsync_dir(path)
    except OSError as exc:  # the rename is done; durability is best effort here
        log.debug("fsync of %s failed: %s", path, exc)


def _clear_tmp(path: str) -> None:
    """Remove a stale temporary name: only ever a symlink or a second name of a file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink > 1):
        os.unlink(path)
    else:
        raise StateError(f"{path} is in the way and may be the only copy of a file; move it away")


def _replace(dest: str, make: Callable[[str], None]) -> None:
    """Create a name with MAKE(tmp) beside DEST, then rename it over DEST: DEST is replaced
    atomically, never missing for a moment."""
    tmp = tmp_name(dest)
    _clear_tmp(tmp)
    make(tmp)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(dest))


def _replace_with_link(source: str, dest: str) -> None:
    """Make DEST a hard link of SOURCE (a symlink itself, not its target)."""
    _replace(dest, lambda tmp: os.link(source, tmp, follow_symlinks=False))


def _replace_with_shim_link(layout: Layout, dest: str) -> None:
    """Make DEST a symlink to its own shim (written first)."""
    from ..install.installation import install_program_shim

    install_program_shim(layout, dest)
    _replace(dest, lambda tmp: os.symlink(os.fspath(layout.program_shim(dest)), tmp))


def _remove_own_shim(layout: Layout, link: str) -> None:
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


def _why(exc: BaseException) -> str:
    if isinstance(exc, CudawrapError):
        return exc.message
    if isinstance(exc, OSError):
        return exc.strerror or str(exc)
    return type(exc).__name__


def refresh_launch_cache(layout: Layout) -> None:
    """Rebuild the shim's policy cache after the registry changed.

    Best effort: a stale cache is only slower (the shim sees its signature no longer
    matches and parses the files itself), never wrong, so no wrap fails over it.
    """
    try:
        from ..policy.effective import write_cache
    except ImportError:
        return
    try:
        write_cache(os.fspath(layout.root))
    except (OSError, CudawrapError) as exc:
        log.warning("the launch cache was not rebuilt (%s); wrapped programs start a little slower "
                    "until 'cudawrap sync'", _why(exc))


def require_installed(layout: Layout) -> None:
    """Raise StateError unless LAYOUT has a shim to point links at and a state directory."""
    shim = os.fspath(layout.shim)
    if not (os.path.isfile(shim) and os.access(shim, os.X_OK)):
        raise StateError(f"the cudawrap shim {shim} is missing or not executable; "
                         "run install.sh (or 'cudawrap doctor') first")
    if not os.path.isdir(layout.state_dir):
        raise StateError(f"{layout.state_dir} does not exist; run install.sh first")


# --- create ------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A program that passed the checks for wrapping (no file was read or changed)."""

    link: str
    real: str
    symlink: Optional[str]  # the link text, when the name is a symlink to the program
    package: Optional[str]  # the dpkg package shipping it
    diversion: Optional[str]  # the name to divert (as dpkg knows it), when a package ships it
    rpm: Optional[str] = None  # the RPM package owning it, when wrapped with --force anyway
    owner: Optional[str] = None  # the user owning the program's file, when not root (or the prefix's owner)


@dataclass(frozen=True)
class Failure:
    path: str
    error: CudawrapError


@dataclass(frozen=True)
class WrapOutcome:
    wrapped: Tuple[Entry, ...]
    failed: Tuple[Failure, ...]
    warnings: Tuple[str, ...] = ()


def _packaged(link: str, name: str, dpkg: Dpkg, force: bool) -> Tuple[Optional[str], Optional[str], Optional[str]]:
    """(dpkg package, diversion name, RPM package) of LINK, one of NAME to be wrapped; raise
    where a package makes the wrap unsafe (see check_wrap)."""
    package = diversion = None
    owner = dpkg.owner(link)
    if owner is not None:
        package, diversion = owner
        system = dpkg.system_package(package)
        if system is not None and not force:
            raise StateError(f"{link}: belongs to {system[0]}, a package {system[1]} (part of the base "
                             f"system), so every run of {name} on this machine, by any user or script, "
                             "would take a device; wrap a CUDA program, or give --force if that is meant")
        diverter = dpkg.diverter(diversion)
        if diverter == PACKAGE:
            raise StateError(f"{link}: dpkg already diverts it for cudawrap but the registry has no "
                             "entry; run 'cudawrap doctor --repair' first")
        if diverter is not None:
            raise StateError(f"{link}: already diverted by {diverter} (dpkg-divert --list); "
                             "cudawrap cannot divert it a second time")
    rpm = rpm_package(link) if owner is None else None
    if rpm is not None and not force:
        raise StateError(f"{link}: belongs to the RPM package {rpm}, and rpm cannot divert files: an update "
                         f"of {rpm} would silently unwrap it; wrap a copy outside the package's files, or "
                         "give --force and wrap it again after every update")
    return package, diversion, rpm


def check_wrap(layout: Layout, path: str, reg: Registry, dpkg: Dpkg, force: bool = False) -> Candidate:
    """Check that PATH can be wrapped; raise a CudawrapError naming it if not. FORCE wraps a
    program of the base system (every run of it would take a device) or one an RPM package
    owns (which an update of the package silently unwraps)."""
    if not path:
        raise UsageError("an empty path cannot be wrapped")
    if "\n" in path:
        raise UsageError(f"{path!r}: a name with a newline cannot be wrapped (dpkg cannot record it)")
    link = os.path.abspath(path)
    head, name = os.path.split(link)
    if name.startswith(REAL_PREFIX):
        raise StateError(f"{link}: the {REAL_PREFIX} prefix marks a program cudawrap already renamed; "
                         f"wrap {os.path.join(head, name[len(REAL_PREFIX):])} instead")
    try:
        st = os.lstat(link)
    except FileNotFoundError:
        raise StateError(f"{link}: no such file; give the path of an installed program") from None
    except OSError as exc:
        raise StateError(f"{link}: cannot examine it: {exc.strerror}") from None
    why = unsafe_reason(link, file=True, any_owner=True)
    if why is not None:
        raise StateError(f"{link}: {why}, so they could swap it for a symlink that root's commands would "
                         f"follow; put the program where only {_trusted_names()} can write (such as "
                         "/opt/app/bin) and wrap it there")
    found = reg.find(link)
    if found is not None and found.phase != WRAPPED:
        raise StateError(f"{link}: an earlier create or unwrap of it was interrupted; "
                         "run 'cudawrap doctor --repair' first")
    if found is not None or is_shim_link(layout, link):
        wrapped = {canonical(e.link): e.link for e in reg}
        through = [wrapped[p] for p in symlink_chain(link)[1:-1] if p in wrapped]
        if found is None and through:
            raise StateError(f"{link}: a symlink to the wrapped program {through[0]}, so it is already "
                             "wrapped through it (see 'cudawrap list')")
        raise StateError(f"{link}: already wrapped by cudawrap (see 'cudawrap list'); "
                         f"run 'cudawrap unwrap {link}' first to wrap it anew")
    if layout.is_shim_path(link):
        raise StateError(f"{link}: this is a cudawrap shim itself; wrap a CUDA program instead")
    symlink = None
    if stat.S_ISLNK(st.st_mode):
        symlink = os.readlink(link)
        try:
            st = os.stat(link)
        except OSError:
            raise StateError(f"{link}: a broken symlink (to {symlink}); "
                             "give the path of an installed program") from None
    what = f" (a symlink to {os.path.realpath(link)})" if symlink is not None else ""
    if not stat.S_ISREG(st.st_mode):
        raise StateError(f"{link}: not a regular file{what}; only programs can be wrapped")
    if not st.st_mode & 0o111:
        raise StateError(f"{link}: not executable{what} (mode {stat.S_IMODE(st.st_mode):04o}); "
                         "only programs can be wrapped")
    here = canonical(link)
    for other in reg:
        # A wrapped symlink's CUDAWRAP_ name still points at the program it pointed to;
        # wrapping that program too would send it back into the shim, in a loop.
        if other.symlink is not None and here in symlink_chain(other.real)[1:]:
            raise StateError(f"{link}: the wrapped {other.link} is a symlink to it; run 'cudawrap unwrap "
                             f"{other.link}' first, then wrap {link}, which covers both")
    real = real_name(link)
    if len(os.fsencode(TMP_PREFIX + name)) > NAME_MAX:
        raise StateError(f"{link}: the name is too long to add the {REAL_PREFIX} prefix "
                         f"({NAME_MAX - len(TMP_PREFIX)} bytes at most)")
    if os.path.lexists(real):
        raise StateError(f"{link}: {real} already exists; move it away (or run 'cudawrap doctor') "
                         "before wrapping")
    if not os.access(head, os.W_OK | os.X_OK):
        raise NotPermitted(f"{link}: cannot create files in {head} (read-only file system or no "
                           "write permission)")
    package, diversion, rpm = _packaged(link, name, dpkg, force)
    from ..base.users import user_name

    owner = None if st.st_uid in trusted_uids() else user_name(st.st_uid)
    return Candidate(link, real, symlink, package, diversion, rpm, owner)


def _trusted_names() -> str:
    from ..base.users import user_name

    return " or ".join(sorted(user_name(u) for u in trusted_uids()))


def unsafe_dir(entry: Entry) -> Optional[str]:
    """Why ENTRY's directory is no longer safe for root to act in (made before wrapping
    refused such places, or handed to a user since), or None."""
    return unsafe_reason(os.path.dirname(entry.link))


def wrap_one(layout: Layout, cand: Candidate, policy: Mapping[str, Any], dpkg: Dpkg, user: str) -> Entry:
    """Wrap CAND (see the module doc for the steps). The caller holds the registry lock.

    On failure every step is undone and StateError says nothing was changed; if undoing
    fails too, the "wrapping" entry stays for `cudawrap doctor --repair`.
    """
    try:
        facts = facts_of(cand.link)
    except OSError as exc:
        raise StateError(f"{cand.link}: cannot read it: {exc.strerror}") from None
    entry = Entry(
        link=cand.link, real=cand.real, sha256=facts.sha256, mode=facts.mode, uid=facts.uid,
        gid=facts.gid, symlink=cand.symlink, package=cand.package, diversion=cand.diversion,
        policy=policy, wrapped_by=user, wrapped_at=utc_now(), cudawrap_version=__version__,
        phase=WRAPPING,
    )
    try:
        registry.update(layout, lambda reg: reg.put(entry))
    except CudawrapError as exc:
        raise StateError(f"{cand.link}: could not wrap it: {exc.message}; nothing was changed") from None
    undo: List[Callable[[], None]] = []

    def unlink_real() -> None:
        if same_file(cand.link, cand.real):  # never remove anything but our second name
            os.unlink(cand.real)

    try:
        os.link(cand.link, cand.real, follow_symlinks=False)
        undo.append(unlink_real)
        if cand.diversion is not None:
            dpkg.add(cand.diversion)
            undo.append(lambda: dpkg.remove(cand.diversion, rename=False))  # type: ignore[arg-type]
        undo.append(lambda: _remove_own_shim(layout, cand.link))
        _replace_with_shim_link(layout, cand.link)
    except BaseException as exc:
        try:
            for step in reversed(undo):
                step()
            registry.update(layout, lambda reg: reg.drop(cand.link))
        except BaseException as again:
            raise StateError(
                f"{cand.link}: wrapping failed ({_why(exc)}) and so did undoing it ({_why(again)}); "
                "the program still runs; run 'cudawrap doctor --repair' to finish"
            ) from exc
        if not isinstance(exc, Exception):
            raise
        raise StateError(f"{cand.link}: could not wrap it: {_why(exc)}; nothing was changed") from exc
    done = entry.replace(phase=WRAPPED, stat=stamp_of(os.stat(cand.real)))
    try:
        registry.update(layout, lambda reg: reg.put(done))
    except CudawrapError as exc:
        raise StateError(f"{cand.link}: wrapped, but recording that failed ({exc.message}); "
                         "run 'cudawrap doctor --repair' to record it") from None
    log.info("wrapped %s (real program %s, sha256 %s, policy %s, diverted: %s) by %s",
             done.link, done.real, done.sha256, dict(done.policy), done.diverted, user)
    audit.log("wrap", program=done.link, real=done.real, sha256=done.sha256, by=user,
              diversion=done.diversion or "none")
    return done


def wrap_programs(
    layout: Layout,
    paths: Sequence[str],
    policy: Mapping[str, Any],
    *,
    dpkg: Optional[Dpkg] = None,
    user: Optional[str] = None,
    force: bool = False,
) -> WrapOutcome:
    """Wrap each of PATHS with POLICY (raw, already validated).

    Every path is checked before any is touched: if one fails the checks, nothing at all
    is changed and the outcome lists the failures. Then each is wrapped under the lock,
    checked again there (another admin may have been quicker); one that fails then is
    reported and the others still go ahead.
    """
    dpkg = Dpkg.from_environment() if dpkg is None else dpkg
    user = invoking_user() if user is None else user
    require_installed(layout)

    def check_all(reg: Registry) -> Tuple[List[Candidate], List[Failure]]:
        good: List[Candidate] = []
        bad: List[Failure] = []
        seen = set()
        for path in paths:
            try:
                cand = check_wrap(layout, path, reg, dpkg, force)
                if cand.link in seen:
                    raise UsageError(f"{cand.link}: given twice")
                seen.add(cand.link)
                good.append(cand)
            except CudawrapError as exc:
                bad.append(Failure(path, exc))
        # A symlink to another program of this same command would end up pointing at the
        # shim (see check_wrap); wrapping its target alone covers it.
        targets = {canonical(c.link): c.link for c in good}
        for cand in [c for c in good if c.symlink is not None]:
            through = [targets[p] for p in symlink_chain(cand.link)[1:] if p in targets]
            if through:
                good.remove(cand)
                bad.append(Failure(cand.link, StateError(
                    f"{cand.link}: it is a symlink to {through[0]}, which this command wraps; "
                    f"wrapping {through[0]} covers it, so leave {cand.link} out")))
        return good, bad

    # First without the lock: a refusal must leave every file alone, the lock file included.
    _, bad = check_all(registry.load(layout))
    if bad:
        return WrapOutcome((), tuple(bad))
    wrapped: List[Entry] = []
    failed: List[Failure] = []
    with registry.lock(layout):
        good, failed = check_all(registry.load(layout))
        for cand in good:
            try:
                wrapped.append(wrap_one(layout, cand, policy, dpkg, user))
            except CudawrapError as exc:
                failed.append(Failure(cand.link, exc))
        if wrapped:
            refresh_launch_cache(layout)
    done = [c for c in good if any(e.link == c.link for e in wrapped)]
    warnings = tuple(
        f"warning: {c.link} belongs to the RPM package {c.rpm}: an update of {c.rpm} silently unwraps it; "
        f"run 'create-cudawrap --force {c.link}' again after every update"
        for c in done if c.rpm is not None) + tuple(
        f"warning: {c.link} is owned by {c.owner}, who can still change what it runs (its contents), "
        f"though not rename or replace it: only {_trusted_names()} can write in {os.path.dirname(c.link)}"
        for c in done if c.owner is not None) + tuple(
        f"note: {c.link} has no #! line, so each run runs it with /bin/sh, as a shell runs such a script; "
        "give it a #! line (such as #!/bin/bash) if it needs another interpreter"
        for c in done if runs_with_sh(c.real))
    return WrapOutcome(tuple(wrapped), tuple(failed), warnings)


def runs_with_sh(path: str) -> bool:
    """Whether the kernel cannot run PATH itself (neither #! nor ELF) and the shim then runs
    it with /bin/sh (launch.run_with_sh): text without a #! line."""
    from ..launch import is_script_text

    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return not head.startswith((b"#!", b"\x7fELF")) and is_script_text(path)


# --- shims after an upgrade (the installer) and for doctor's repairs -------------------


def own_shim(layout: Layout, entry: Entry) -> str:
    """Give ENTRY its own shim (it leads to the shared one, or its own is stale or missing)."""
    _replace_with_shim_link(layout, entry.link)
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
