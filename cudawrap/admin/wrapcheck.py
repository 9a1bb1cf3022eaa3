"""The checks before a program is wrapped: each refusal is a CudawrapError naming the path,
raised before any file was read or changed (wrap.py wraps what passes)."""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Optional, Tuple

from ..base.safepath import trusted_uids, unsafe_reason
from ..errors import NotPermitted, StateError, UsageError
from ..paths import REAL_PREFIX, Layout
from ..policy.registry import WRAPPED, Registry
from .divert import PACKAGE, Dpkg, real_name, rpm_package
from .inspect_wraps import canonical, is_shim_link, symlink_chain
from .shimlinks import TMP_PREFIX

NAME_MAX = 255


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


def trusted_names() -> str:
    """The accounts trusted to write where programs are wrapped, for a message ("root or x")."""
    from ..base.users import user_name

    return " or ".join(sorted(user_name(u) for u in trusted_uids()))


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


def _named(path: str) -> str:
    """PATH made absolute, if it is a name cudawrap can wrap at all."""
    if not path:
        raise UsageError("an empty path cannot be wrapped")
    if "\n" in path:
        raise UsageError(f"{path!r}: a name with a newline cannot be wrapped (dpkg cannot record it)")
    link = os.path.abspath(path)
    head, name = os.path.split(link)
    if name.startswith(REAL_PREFIX):
        raise StateError(f"{link}: the {REAL_PREFIX} prefix marks a program cudawrap already renamed; "
                         f"wrap {os.path.join(head, name[len(REAL_PREFIX):])} instead")
    return link


def _examined(link: str) -> os.stat_result:
    """LINK's own lstat, if it exists where only trusted accounts can swap it."""
    try:
        st = os.lstat(link)
    except FileNotFoundError:
        raise StateError(f"{link}: no such file; give the path of an installed program") from None
    except OSError as exc:
        raise StateError(f"{link}: cannot examine it: {exc.strerror}") from None
    why = unsafe_reason(link, file=True, any_owner=True)
    if why is not None:
        raise StateError(f"{link}: {why}, so they could swap it for a symlink that root's commands would "
                         f"follow; put the program where only {trusted_names()} can write (such as "
                         "/opt/app/bin) and wrap it there")
    return st


def _not_wrapped(layout: Layout, link: str, reg: Registry) -> None:
    """Raise unless LINK is neither wrapped (by itself or through a symlink) nor a shim."""
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


def _program(link: str, st: os.stat_result) -> Tuple[Optional[str], os.stat_result]:
    """(the link text when LINK is a symlink, the program's stat), if it is an executable file."""
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
    return symlink, st


def _room(link: str, reg: Registry) -> str:
    """The CUDAWRAP_ name for LINK, if nothing wrapped leads to it and the name can be made."""
    head, name = os.path.split(link)
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
    return real


def check_wrap(layout: Layout, path: str, reg: Registry, dpkg: Dpkg, force: bool = False) -> Candidate:
    """Check that PATH can be wrapped; raise a CudawrapError naming it if not. FORCE wraps a
    program of the base system (every run of it would take a device) or one an RPM package
    owns (which an update of the package silently unwraps)."""
    link = _named(path)
    st = _examined(link)
    _not_wrapped(layout, link, reg)
    symlink, st = _program(link, st)
    real = _room(link, reg)
    package, diversion, rpm = _packaged(link, os.path.basename(link), dpkg, force)
    from ..base.users import user_name

    owner = None if st.st_uid in trusted_uids() else user_name(st.st_uid)
    return Candidate(link, real, symlink, package, diversion, rpm, owner)
