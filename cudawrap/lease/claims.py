"""Machine-wide device claims: one install manages each GPU, however many installs there are.

Each install keeps its own lease files, and a lease only excludes runs of the same install:
a prefix install beside the system install would hand out the same GPU again. So `sync`
(and the monitor, through it) first claims each device in a directory shared by every
install on the machine, ``/run/cudawrap-devices/<UUID>``, a small file naming the install
root that manages it, and creates lease files only for the devices it holds the claim of.
A device another live install manages is left out, and sync says so.

The claim directory belongs to the machine, not to an install: were it a setting of each
install's configuration, two installs could disagree about it and hand out a GPU twice.
``CUDAWRAP_DEVICE_CLAIMS`` names another one for a simulated machine (the test suite's,
whose fake GPUs are not this machine's).

Who may claim what:
* A claim is live while the install it names still has the device's lease file; a stale
  claim (the install was removed, or lost the device) is taken over.
* Root's sync honours only root's claims: what a user writes in the shared directory
  (sticky and world-writable, like /tmp, so that a user's prefix install can claim too)
  never keeps the system install from its devices.
* A user's sync honours every live claim but its own install's.
* Anything else under a device's name (a directory, a symlink, a FIFO, a file with other
  links: any user may make one) is no claim. Root replaces it (an empty directory is
  removed first); where it cannot (a directory with files in it), root's install still
  leases the device, without a claim, and sync names the object and its owner. A user's
  install leases no device whose name holds such an object of another user: it could not
  tell whether another install manages that device.
The files are opened with O_NOFOLLOW relative to the directory, read as untrusted, and
created with link(2), which never replaces anything; a stale claim is replaced by rename.
The temporary file each claim is written to has a random name, made with O_EXCL.
"""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

from .. import locations as loc
from ..base.safepath import create_new

CLAIMS_ENV = "CUDAWRAP_DEVICE_CLAIMS"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_CLAIM = 4096
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symlink", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a device node", stat.S_IFBLK: "a device node"}
# What cannot be renamed over: the name is taken by something this process may not replace.
_IN_THE_WAY = (errno.EEXIST, errno.EPERM, errno.EACCES, errno.EISDIR, errno.ENOTEMPTY, errno.EBUSY)

# What a device's name holds: (owner uid, install root, "") for a claim; (owner uid, "", what
# it is) for anything else (owner -1 where it cannot be told).
Found = Tuple[int, str, str]


def claims_dir(environ: Optional[Dict[str, str]] = None) -> str:
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    return environ.get(CLAIMS_ENV) or loc.CLAIMS_DIR


@dataclass
class Claims:
    """The outcome for one install: which devices it may lease, and why not the others."""

    mine: List[str] = field(default_factory=list)
    others: Dict[str, str] = field(default_factory=dict)  # uuid -> the install root managing it
    warning: Optional[str] = None  # claims could not be made at all (the devices are still managed)
    # uuid -> why no claim could be made for it (something that is no claim in the way);
    # root's install leases such a device all the same (it is in MINE), a user's install
    # only when that thing is its own user's.
    unclaimed: Dict[str, str] = field(default_factory=dict)


def _open_dir(path: str) -> int:
    """The claims directory, made sticky and world-writable by root if missing."""
    try:
        return os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        if os.geteuid() != 0:
            raise
    try:
        os.mkdir(path, 0o1777)
        os.chmod(path, 0o1777)  # whatever the umask: every install's owner may claim
    except FileExistsError:
        pass
    return os.open(path, _DIR_FLAGS)


def _what(st: os.stat_result) -> str:
    """What ST is, when it is not a claim; "" for a claim's shape (a file with one link)."""
    if stat.S_ISREG(st.st_mode):
        return "" if st.st_nlink == 1 else "a file with other links"
    return _KINDS.get(stat.S_IFMT(st.st_mode), "not a file")


def _read(dfd: int, uuid: str) -> Optional[Found]:
    """What UUID's name holds in the claims directory; None if nothing."""
    try:
        st = os.stat(uuid, dir_fd=dfd, follow_symlinks=False)
        if _what(st):
            return (st.st_uid, "", _what(st))
        fd = os.open(uuid, _READ_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError:  # unreadable, or swapped since: garbage, not a claim
        return (-1, "", "unreadable")
    try:
        st = os.fstat(fd)
        if _what(st):
            return (st.st_uid, "", _what(st))
        text = os.read(fd, _MAX_CLAIM).decode("utf-8", "surrogateescape")
    finally:
        os.close(fd)
    return (st.st_uid, text.strip(), "")


def _live(root: str, uuid: str) -> bool:
    """Whether the install at ROOT still manages UUID: it has its lease file."""
    if not root.startswith("/"):
        return False
    try:
        return stat.S_ISREG(os.lstat(loc.under(root, loc.LEASE_DIR) + "/" + uuid).st_mode)
    except OSError:
        return False


def _write(dfd: int, uuid: str, root: str, replace: bool) -> bool:
    """Claim UUID for ROOT; False if another claim got there first or what is there cannot
    be replaced."""
    tmp = create_new(dfd, ".new.", (root + "\n").encode("utf-8", "surrogateescape"))
    try:
        if replace:
            os.rename(tmp, uuid, src_dir_fd=dfd, dst_dir_fd=dfd)
            return True
        os.link(tmp, uuid, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        return True
    except OSError as exc:
        if exc.errno in _IN_THE_WAY:
            return False
        raise
    finally:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass


def _honoured(found: Optional[Found], uuid: str, me: int) -> bool:
    """Whether the claim FOUND on UUID keeps this process's install off the device."""
    return (found is not None and not found[2] and found[0] >= 0 and (found[0] == 0 or me != 0)
            and _live(found[1], uuid))


def _clear(dfd: int, uuid: str, found: Optional[Found], me: int) -> None:
    """Remove an empty directory in the way of UUID's claim, if this process may (root, or
    its maker): rename can replace anything else, never a directory."""
    if found is not None and found[2] == "a directory" and (me == 0 or found[0] == me):
        try:
            os.rmdir(uuid, dir_fd=dfd)
        except OSError:
            pass  # not empty, or gone: the rename below says which


def _in_the_way(directory: str, uuid: str, found: Found) -> str:
    from ..base.users import user_name

    who = "someone" if found[0] < 0 else user_name(found[0])
    return f"{directory}/{uuid} is {found[2]} made by {who}, not a claim"


def elsewhere(root: str, uuids: Iterable[str], directory: Optional[str] = None) -> Dict[str, str]:
    """uuid -> the other live install that manages it, for UUIDS (reading only)."""
    try:
        dfd = os.open(claims_dir() if directory is None else directory, _DIR_FLAGS)
    except OSError:
        return {}
    me = os.geteuid()
    out: Dict[str, str] = {}
    try:
        if me == 0 and os.fstat(dfd).st_uid != 0:
            return out
        for uuid in uuids:
            if not uuid or "/" in uuid or uuid.startswith("."):
                continue
            found = _read(dfd, uuid)
            if found is not None and found[1] != root and _honoured(found, uuid, me):
                out[uuid] = found[1]
    finally:
        os.close(dfd)
    return out


def claim(root: str, uuids: Iterable[str], directory: Optional[str] = None) -> Claims:
    """Claim each of UUIDS for the install at ROOT where no other live install has."""
    directory = claims_dir() if directory is None else directory
    out = Claims()
    uuids = [u for u in uuids if u and "/" not in u and not u.startswith(".")]
    try:
        dfd = _open_dir(directory)
    except OSError as exc:
        out.mine = list(uuids)
        out.warning = (f"cannot use the machine-wide claims in {directory} ({exc.strerror}): another "
                       "cudawrap install on this machine could hand out the same devices")
        return out
    me = os.geteuid()
    try:
        owner = os.fstat(dfd).st_uid
        if me == 0 and owner != 0:  # made by a user where one could: root trusts none of it
            out.mine = list(uuids)
            out.warning = (f"the claims directory {directory} belongs to uid {owner}, not root; machine-wide "
                           "claims not used: another cudawrap install could hand out the same devices")
            return out
        for uuid in uuids:
            _claim_one(dfd, directory, uuid, root, me, out)
    finally:
        os.close(dfd)
    return out


def _claim_one(dfd: int, directory: str, uuid: str, root: str, me: int, out: Claims) -> None:
    """Claim UUID for ROOT, noting in OUT whether it is this install's to lease."""
    found: Optional[Found] = None
    for _ in range(3):  # another sync may claim between our look and our write
        found = _read(dfd, uuid)
        if found is not None and not found[2] and found[1] == root:
            break
        if _honoured(found, uuid, me):
            out.others[uuid] = found[1]  # type: ignore[index]
            return
        _clear(dfd, uuid, found, me)
        if _write(dfd, uuid, root, replace=found is not None):
            found = None
            break
        if found is not None and _read(dfd, uuid) == found:
            break  # what is there we may not replace (root's stale claim, another user's object)
    if found is not None and found[2]:
        out.unclaimed[uuid] = _in_the_way(directory, uuid, found)
        if me != 0 and found[0] != me:
            return  # perhaps another install's device: a user's install leaves it
    out.mine.append(uuid)


def release(root: str, directory: Optional[str] = None) -> List[str]:
    """Remove the install at ROOT's claims (its uninstall): the UUIDs released.

    Only a claim this process's user made and that names ROOT: another install's claim, or
    what another user put under a device's name, stays. A claim replaced between the read
    and the removal (by a sync taking it over) could be another install's: the name is
    removed only while it still leads to the file read."""
    directory = claims_dir() if directory is None else directory
    try:
        dfd = os.open(directory, _DIR_FLAGS)
    except OSError:
        return []
    me = os.geteuid()
    out: List[str] = []
    try:
        for uuid in sorted(os.listdir(dfd)):
            if uuid.startswith("."):
                continue
            try:
                fd = os.open(uuid, _READ_FLAGS, dir_fd=dfd)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                mine = (not _what(st) and st.st_uid == me
                        and os.read(fd, _MAX_CLAIM).decode("utf-8", "surrogateescape").strip() == root)
                if mine:
                    now = os.stat(uuid, dir_fd=dfd, follow_symlinks=False)
                    if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                        os.unlink(uuid, dir_fd=dfd)
                        out.append(uuid)
            except OSError:
                continue
            finally:
                os.close(fd)
    finally:
        os.close(dfd)
    return out
