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
The files are opened with O_NOFOLLOW relative to the directory, read as untrusted, and
created with link(2), which never replaces anything; a stale claim is replaced by rename.
"""
from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

from . import locations as loc

CLAIMS_ENV = "CUDAWRAP_DEVICE_CLAIMS"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_CLAIM = 4096


def claims_dir(environ: Optional[Dict[str, str]] = None) -> str:
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    return environ.get(CLAIMS_ENV) or loc.CLAIMS_DIR


@dataclass
class Claims:
    """The outcome for one install: which devices it may lease, and why not the others."""

    mine: List[str] = field(default_factory=list)
    others: Dict[str, str] = field(default_factory=dict)  # uuid -> the install root managing it
    warning: Optional[str] = None  # claims could not be made at all (the devices are still managed)


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


def _read(dfd: int, uuid: str) -> Optional[tuple]:
    """(owner uid, install root) of UUID's claim; None if there is none."""
    try:
        fd = os.open(uuid, _READ_FLAGS, dir_fd=dfd)
    except FileNotFoundError:
        return None
    except OSError:  # a symlink, a FIFO without writer, unreadable: garbage, not a claim
        return (-1, "")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return (-1, "")
        text = os.read(fd, _MAX_CLAIM).decode("utf-8", "surrogateescape")
    finally:
        os.close(fd)
    return (st.st_uid, text.strip())


def _live(root: str, uuid: str) -> bool:
    """Whether the install at ROOT still manages UUID: it has its lease file."""
    if not root.startswith("/"):
        return False
    try:
        return stat.S_ISREG(os.lstat(loc.under(root, loc.LEASE_DIR) + "/" + uuid).st_mode)
    except OSError:
        return False


def _write(dfd: int, uuid: str, root: str, replace: bool) -> bool:
    """Claim UUID for ROOT; False if another claim got there first or cannot be replaced."""
    tmp = f".new.{os.getpid()}.{uuid}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dfd)
    try:
        os.write(fd, (root + "\n").encode("utf-8", "surrogateescape"))
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)
    try:
        if replace:
            os.rename(tmp, uuid, src_dir_fd=dfd, dst_dir_fd=dfd)
            return True
        os.link(tmp, uuid, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        return True
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.EPERM, errno.EACCES):
            return False
        raise
    finally:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except FileNotFoundError:
            pass


def _honoured(found: Optional[tuple], uuid: str, me: int) -> bool:
    """Whether the claim FOUND on UUID keeps this process's install off the device."""
    return (found is not None and found[0] >= 0 and (found[0] == 0 or me != 0)
            and _live(found[1], uuid))


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
            for _ in range(3):  # another sync may claim between our look and our write
                found = _read(dfd, uuid)
                if found is not None and found[1] == root:
                    break
                if _honoured(found, uuid, me):
                    out.others[uuid] = found[1]  # type: ignore[index]
                    break
                if _write(dfd, uuid, root, replace=found is not None):
                    break
                if found is not None and _read(dfd, uuid) == found:
                    break  # a stale claim we may not replace (root's, in the sticky directory)
            if uuid not in out.others:
                out.mine.append(uuid)
    finally:
        os.close(dfd)
    return out
