"""A device node's owner, mode and POSIX ACL: read, set for [confine] nodes = "leased", and put
back exactly as they were from a root-owned state file.

Closed, a node is root:root 0660 with a named USER entry (rw) for each account that may open
it; with none, no ACL at all (mode 0660 alone). Its group bits are the ACL's MASK (rw), so
`ls -l` shows crw-rw----+ and the owning group is root's. What it was before cudawrap first
touched it (owner, mode, the ACL xattr's bytes or none) is recorded in STATE before the
first change, and ``restore`` puts exactly that back, whoever changed the node since.

Paths are under a directory only root can write (/dev, or the one the root-owned config
names): a name cannot be swapped between the lstat and the change by anyone but root.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from typing import Dict, Iterable, Optional

from . import posixacl
from .rootfile import private_tmp

CLOSED_MODE = 0o660
RW = posixacl.READ | posixacl.WRITE
VERSION = 1

Saved = Dict[str, dict]  # path -> {"rdev", "uid", "gid", "mode", "acl": hex bytes or None}


def read_acl(path: str) -> Optional[bytes]:
    """PATH's access ACL xattr, None where it has none; OSError (EOPNOTSUPP: no ACLs there)."""
    try:
        return os.getxattr(path, posixacl.XATTR, follow_symlinks=False)
    except OSError as exc:
        if exc.errno == errno.ENODATA:
            return None
        raise


def closed_acl(uids: Iterable[int]) -> Optional[bytes]:
    """The ACL of a closed node opened to UIDS (None: no ACL, mode 0660 says it all)."""
    named = sorted(set(uids))
    if not named:
        return None
    base = [posixacl.Entry(posixacl.USER_OBJ, RW), posixacl.Entry(posixacl.GROUP_OBJ, RW),
            posixacl.Entry(posixacl.MASK, RW), posixacl.Entry(posixacl.OTHER, 0)]
    return posixacl.encode(base + [posixacl.Entry(posixacl.USER, RW, uid) for uid in named])


def _set_acl(path: str, acl: Optional[bytes]) -> None:
    if acl is None:
        try:
            os.removexattr(path, posixacl.XATTR, follow_symlinks=False)
        except OSError as exc:
            if exc.errno != errno.ENODATA:
                raise
    else:
        os.setxattr(path, posixacl.XATTR, acl, follow_symlinks=False)


def snapshot(path: str) -> Optional[dict]:
    """What PATH is now, as STATE keeps it; None if it is not a character device."""
    st = os.lstat(path)
    if not stat.S_ISCHR(st.st_mode):
        return None
    acl = read_acl(path)
    return {"rdev": st.st_rdev, "uid": st.st_uid, "gid": st.st_gid, "mode": stat.S_IMODE(st.st_mode),
            "acl": None if acl is None else acl.hex()}


def close(path: str, uids: Iterable[int]) -> bool:
    """PATH made root:root 0660 opened to UIDS alone; False if it is no character device (any
    more). Only what differs is written (a watch on the directory sees each write)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISCHR(st.st_mode):
        return False
    if st.st_uid != 0 or st.st_gid != 0:
        os.chown(path, 0, 0, follow_symlinks=False)
    want = closed_acl(uids)
    if read_acl(path) != want:
        _set_acl(path, want)  # sets the mode's bits from the ACL's too
    if stat.S_IMODE(os.lstat(path).st_mode) != CLOSED_MODE:
        os.chmod(path, CLOSED_MODE)  # a device node: never a link (lstat above)
    return True


def restore(saved: Saved) -> None:
    """Each node of SAVED put back as it was (owner, ACL, mode), where it is still the same device."""
    for path, was in saved.items():
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue  # gone with its driver: made afresh as the driver makes it
        if not stat.S_ISCHR(st.st_mode) or st.st_rdev != was["rdev"]:
            continue
        os.chown(path, was["uid"], was["gid"], follow_symlinks=False)
        _set_acl(path, None if was["acl"] is None else bytes.fromhex(was["acl"]))
        os.chmod(path, was["mode"])  # last: with an ACL, the group bits are its mask as saved


def load(state: str) -> Saved:
    """The nodes recorded in STATE (root's own file; empty if there is none)."""
    try:
        with open(state, "rb") as f:
            if os.fstat(f.fileno()).st_uid != 0 and os.geteuid() == 0:
                raise OSError(errno.EPERM, f"{state} is not root's: not trusted")
            data = json.loads(f.read())
    except FileNotFoundError:
        return {}
    if data.get("version") != VERSION:
        raise ValueError(f"{state}: not a version {VERSION} record of device nodes")
    return dict(data["nodes"])


def save(state: str, saved: Saved) -> None:
    """SAVED in STATE (0600, atomically, synced: a crash right after must find it); none when empty."""
    if not saved:
        try:
            os.unlink(state)
        except FileNotFoundError:
            pass
        return
    tmp = private_tmp(state)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps({"version": VERSION, "nodes": saved}, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, state)


def put_back(state: str) -> int:
    """Every node STATE records put back, then STATE removed: the number of nodes recorded."""
    saved = load(state)
    restore(saved)
    save(state, {})
    return len(saved)
