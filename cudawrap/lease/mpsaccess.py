"""Who may reach a device's MPS control daemon: its pipe directory's mode and POSIX ACL.

An MPS client connects to a socket in its device's pipe directory (``sharing.mps_pipe_dir``),
and the MPS server the daemon starts for it runs with its uid and works there too. The
daemon's sockets are open to everyone (NVIDIA makes them 0777), so the directory decides.

* Where no service arbitrates (the daemonless way): root's, 0755, no ACL. Every user reaches every daemon;
  MPS's one user at a time still holds, and a client without a share shows in status.
* With it: root's, 0700, plus an access ACL naming, with rwx, exactly the uids that hold a
  share of that device through the service (``Grants``): set when the service confirms a
  share's locks, taken away when that uid's last share of the device ends, rebuilt from
  the grants the service follows when it starts. Root's tools (sync, ``mps start``) make a
  directory without an ACL 0700 and leave an ACL the service set alone.

A filesystem without ACLs (EOPNOTSUPP) leaves the directory as it is, 0755: the
service cannot keep users off the daemons, and says so once in its log.
"""
from __future__ import annotations

import errno
import os
import re
from typing import Callable, Dict, Iterable, Set

from ..base import posixacl
from .sharing import mps_pipe_dir
from ..paths import Layout

OPEN_MODE = 0o755
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_DEVICE_NAME = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]+")


def pipe_dirs(layout: Layout) -> Dict[str, str]:
    """UUID -> pipe directory, for every device directory under the MPS directory."""
    try:
        names = sorted(os.listdir(layout.mps_dir))
    except FileNotFoundError:
        return {}
    root = str(layout.root)
    return {name: mps_pipe_dir(root, name) for name in names
            if _DEVICE_NAME.fullmatch(name) and os.path.isdir(mps_pipe_dir(root, name))}


def restrict(path: str, uids: Iterable[int]) -> None:
    """PATH (a directory) for root and UIDS alone, rwx each; no UIDS: 0700, no ACL.
    OSError as the kernel says (FileNotFoundError, EOPNOTSUPP...)."""
    fd = os.open(path, _OPEN)
    try:
        # One write sets the mode bits with the ACL; one with no named user is stored as 0700.
        os.setxattr(fd, posixacl.XATTR, posixacl.owner_and_users(posixacl.RWX, uids))
    finally:
        os.close(fd)


def named(path: str) -> Set[int]:
    """The uids PATH's access ACL names (none: no ACL, or no ACLs here)."""
    try:
        return set(posixacl.users(os.getxattr(path, posixacl.XATTR, follow_symlinks=False)))
    except (OSError, ValueError):
        return set()


def open_up(path: str) -> None:
    """PATH back to 0755 without an ACL (back to the daemonless way)."""
    fd = os.open(path, _OPEN)
    try:
        try:
            os.removexattr(fd, posixacl.XATTR)
        except OSError as exc:
            if exc.errno != errno.ENODATA and exc.errno not in _UNSUPPORTED:
                raise
        os.fchmod(fd, OPEN_MODE)
    finally:
        os.close(fd)


def seal(path: str) -> None:
    """Root's tools where the service arbitrates: PATH 0700 unless the service gave users access (an ACL
    naming them: the shares it follows); left as it is where ACLs are not supported."""
    if named(path):
        return
    try:
        restrict(path, ())
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise


def prepare(layout: Layout, sealed: bool) -> None:
    """Every pipe directory sealed (SEALED) or open to all (sync and the service's start)."""
    for path in pipe_dirs(layout).values():
        (seal if sealed else open_up)(path)


class PipeAccess:
    """The service's side: each shared device's pipe directory open to its sharers alone."""

    def __init__(self, layout: Layout, say: Callable[[str], None]) -> None:
        self.layout = layout
        self.say = say
        self.unsupported = False

    def set(self, uuid: str, uids: Set[int]) -> None:
        """UUID's pipe directory for UIDS alone (no daemon directory: nothing to do)."""
        path = mps_pipe_dir(str(self.layout.root), uuid)
        try:
            restrict(path, uids)
        except FileNotFoundError:
            pass  # no daemon for UUID (mps start makes its directory 0700)
        except OSError as exc:
            if exc.errno in _UNSUPPORTED:
                if not self.unsupported:
                    self.unsupported = True
                    self.say(f"warning: {path}: no POSIX ACLs on this filesystem ({exc.strerror}), so every "
                             f"user reaches the MPS daemons, shares or not; put the runtime directory on "
                             f"a filesystem with ACLs (tmpfs has them)")
            else:
                self.say(f"warning: cannot set who may reach {path}: {exc.strerror or exc}")

    def rebuild(self, sharers: Dict[str, Set[int]]) -> None:
        """Every pipe directory for SHARERS (uuid -> uids) alone: the service's start."""
        for uuid in sorted(set(pipe_dirs(self.layout)) | set(sharers)):
            self.set(uuid, sharers.get(uuid, set()))
