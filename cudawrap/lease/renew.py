"""A lease or slot file replaced by a fresh one: every descriptor open on the old one guards nothing.

A flock belongs to the open file description, and SCM_RIGHTS passes that whole: a
descriptor the service handed out (or one opened before it made the directories root's)
cannot be taken back, and whoever kept it may lock it whenever they like. What can be
done is to rename a fresh file over the path: runs and the service lock the file the path
names, so the kept descriptor then names a file nobody reads. Done while holding the old
file's lock through a descriptor of our own, a file is replaced only when nobody holds it
(replacing a held lease would let a second run take the device beside its holder), except
by `cudawrap revoke`, whose point is to take a held lease from its holder.
"""
from __future__ import annotations

import fcntl
import os
from typing import Optional

from .files import OPEN_FLAGS

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAKE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def replace(path: str, held_too: bool = False) -> Optional[bool]:
    """Rename a fresh file (the old one's owner and mode) over PATH: True once done, False
    where someone holds its lock (unless HELD_TOO: replaced all the same), None where there
    is no such file (a sync removed it). Root's: only root writes the lease directories."""
    directory, name = os.path.split(path)
    dfd = os.open(directory, _DIR_FLAGS)
    try:
        try:
            fd = os.open(name, OPEN_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not held_too:
                    return False
            st = os.fstat(fd)
            fresh = f".{name}.fresh"  # not a device's name: no reader takes it for a lease
            try:
                os.unlink(fresh, dir_fd=dfd)  # left by a replace cut short
            except FileNotFoundError:
                pass
            made = os.open(fresh, _MAKE_FLAGS, 0o600, dir_fd=dfd)
            try:
                os.fchown(made, st.st_uid, st.st_gid)
                os.fchmod(made, st.st_mode & 0o7777)  # as the old one: the umask plays no part
            finally:
                os.close(made)
            os.rename(fresh, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            return True
        finally:
            os.close(fd)  # our lock, on the old file, goes with it
    finally:
        os.close(dfd)
