"""Whether a path is under the admin's sole control, checked without following what a user planted.

Root's commands (create-cudawrap, unwrap, doctor --repair) rename and link files next to a
wrapped program. If any directory on the way were another user's, that user could swap it
for a symlink between our check and our rename, and root would act on a file elsewhere
(wrap a root-owned program, move another user's file in sticky /tmp). So each component is
opened relative to the one before with O_NOFOLLOW (``dir_fd``), a symlink is followed only
when a trusted user made it, and every directory must be owned by a trusted user and
writable by nobody else. A root-owned sticky directory such as /tmp may be passed through
(nobody else can rename what root owns in it) but never hold the program itself. Where
every component is trusted, no one else can change any of them, so the plain path
operations that follow act on what was checked.

Trusted users: root, and for a prefix install run by its owner, that owner too (they own
every file of the install anyway, and act only on their own files).
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Collection, FrozenSet, List, Optional

from .users import user_name

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 40  # the kernel's own limit on symlinks in one lookup


def trusted_uids() -> FrozenSet[int]:
    """Root, and the user running this command (the owner of a prefix install)."""
    return frozenset({0, os.geteuid()})


class Unsafe(Exception):
    """PATH (or a directory on the way) is another user's to change; ``why`` says which and how."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _who(uids: Collection[int]) -> str:
    return " or ".join(sorted(user_name(u) for u in uids))


_WRITERS = {0o020: "its group", 0o002: "others", 0o022: "its group and others"}


def _check(where: str, st: os.stat_result, trusted: Collection[int], last: bool, any_owner: bool = False) -> None:
    if st.st_uid not in trusted and not any_owner:
        raise Unsafe(f"{where} is owned by {user_name(st.st_uid)}, not {_who(trusted)}")
    if stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and not last:
        return  # like /tmp: others may add names, but not rename or remove ours
    if st.st_mode & 0o022:
        whom = _WRITERS[st.st_mode & 0o022]
        raise Unsafe(f"{where} is writable by {whom} (mode {stat.S_IMODE(st.st_mode):04o})")


def open_dir(path: str, trusted: Optional[Collection[int]] = None, *, sticky_ok: bool = False) -> int:
    """An O_DIRECTORY descriptor on PATH, reached one checked component at a time from /.

    Raises Unsafe when a directory on the way (PATH included) or a symlink followed is not a
    trusted user's, or is writable by others; OSError when PATH cannot be reached at all.
    STICKY_OK lets PATH itself be a trusted user's sticky directory that others may write
    (like /tmp): for files made there with create_new, which nobody else can replace.
    """
    trusted = trusted_uids() if trusted is None else trusted
    if not os.path.isabs(path):
        path = os.path.abspath(path)
    todo: List[str] = [p for p in path.split("/") if p and p != "."]
    fd = os.open("/", _DIR_FLAGS)
    where = "/"
    links = 0
    try:
        _check(where, os.fstat(fd), trusted, not todo and not sticky_ok)
        while todo:
            name = todo.pop(0)
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(40, "too many levels of symbolic links", path)
                if st.st_uid not in trusted:  # planted by someone else: never followed
                    raise Unsafe(f"{os.path.join(where, name)} is a symlink made by {user_name(st.st_uid)}")
                target = os.readlink(name, dir_fd=fd)
                todo[:0] = [p for p in target.split("/") if p and p != "."]
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", _DIR_FLAGS)
                    where = "/"
                continue
            nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
            where = os.path.normpath(os.path.join(where, name))
            _check(where, os.fstat(fd), trusted, not todo and not sticky_ok)
        return fd
    except BaseException:
        os.close(fd)
        raise


def create_new(dfd: int, prefix: str, data: bytes, suffix: str = "", mode: int = 0o644) -> str:
    """Write DATA to a new file in the directory DFD, named PREFIX, random letters, SUFFIX;
    its name. Made with O_EXCL and O_NOFOLLOW: nothing another user made there first (a file
    to have root write into, a symlink to have it write elsewhere) is ever opened."""
    for _ in range(100):
        name = f"{prefix}{secrets.token_hex(8)}{suffix}"
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                         dir_fd=dfd)
        except FileExistsError:
            continue
        try:
            os.write(fd, data)
            os.fchmod(fd, mode)  # whatever the umask
        except BaseException:
            os.close(fd)
            os.unlink(name, dir_fd=dfd)
            raise
        os.close(fd)
        return name
    raise FileExistsError(errno.EEXIST, "no free temporary name", prefix)


def unsafe_reason(path: str, trusted: Optional[Collection[int]] = None, *, file: bool = False,
                  any_owner: bool = False) -> Optional[str]:
    """Why PATH is not safe for root to act on, or None if it is.

    PATH is a directory, or with FILE a file whose directory is checked and which itself
    (and what a symlink at PATH leads to) must be a trusted user's and writable by nobody else.
    With ANY_OWNER the file (not a symlink, not a directory) may be another user's: in a
    trusted directory its owner can change its contents, but not rename it or swap it for a
    link, so what root's commands rename is still what they checked.
    """
    trusted = trusted_uids() if trusted is None else trusted
    try:
        if not file:
            os.close(open_dir(path, trusted))
            return None
        head, tail = os.path.split(os.path.abspath(path))
        fd = open_dir(head, trusted)
        try:
            st = os.stat(tail, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in trusted:
                raise Unsafe(f"{path} is a symlink made by {user_name(st.st_uid)}")
            return unsafe_reason(os.path.realpath(path), trusted, file=True, any_owner=any_owner)
        _check(path, st, trusted, True, any_owner)
    except Unsafe as exc:
        return exc.why
    except OSError:
        return None  # missing or unreadable: the callers' own checks say so in their words
    return None
