"""Devices a launch knows without asking NVML or deciding: the lease its wrapped parent
passed down (inherited_lease), and, while NVML is unusable, the devices the lease files name
(lease_file_inventory).

Apart from files.py because a usual launch needs neither (it takes its own leases, on what
NVML or the monitor says), and the shim pays for each line it loads.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Optional

from ..devices.model import Device, Gpu, Inventory
from ..errors import SetupError
from .files import SYNC_HINT, Lease, check_dir, lock_kind


def inherited_lease(lease_dir: str, marker: str) -> Optional[Lease]:
    """The lease a parent wrapped program passed down, if it is real and already ours.

    Each fd must be open on the lease file of its UUID and its open file description must
    already hold the exclusive lock when we look: one we inherited from the run that was
    granted it does. A descriptor a user opened on a free lease file and passed down with a
    hand-made marker does not, and it is not locked for them here either (trying the lock
    would take the device past the queue and the allow-list). Anything else yields None.
    """
    fds: Dict[str, int] = {}
    slots: Dict[str, int] = {}
    for item in marker.split(","):
        fd_text, _, rest = item.partition(":")
        uuid, _, slot_text = rest.partition(":")
        fd = _fd_number(fd_text)
        if fd is None or not uuid or "/" in uuid:
            return None
        if not slot_text:  # a whole device: our descriptor holds its exclusive lock
            if not _locked_file(fd, lease_dir + "/" + uuid, True):
                return None
        else:  # a share: the shared lock on the device, the exclusive lock on a slot file of it
            slot = _fd_number(slot_text)
            share_dir = os.path.dirname(lease_dir) + "/shares"
            if (slot is None or not _locked_file(fd, lease_dir + "/" + uuid, False)
                    or not _slot_of(slot, share_dir, uuid)):
                return None
            slots[uuid] = slot
        fds[uuid] = fd
    return Lease(fds, slots) if fds else None


def _fd_number(text: str) -> Optional[int]:
    # ASCII digits only ("²".isdigit() is true, int() refuses it) and a length int() and
    # fstat() accept: a forged marker means "no lease", never a traceback.
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 9 else None


def _locked_file(fd: int, path: str, exclusive: bool) -> bool:
    """Whether FD is open on the file at PATH and its open file description holds the lock."""
    try:
        mine = os.fstat(fd)
        current = os.stat(path, follow_symlinks=False)
        same = (mine.st_ino, mine.st_dev) == (current.st_ino, current.st_dev)
    except PermissionError:
        # The service arbitrates: the directory is root's, and only the service opens its files,
        # so a descriptor the kernel names by that path (not replaced since: no " (deleted)")
        # was granted by it.
        try:
            same = os.readlink(f"/proc/self/fd/{fd}") == os.path.realpath(os.path.dirname(path)) + "/" + \
                os.path.basename(path)
        except OSError:
            return False
    except OSError:
        return False
    return same and lock_kind(fd) is exclusive


def _slot_of(fd: int, share_dir: str, uuid: str) -> bool:
    """Whether FD holds the exclusive lock on one of UUID's slot files."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False
    name = os.path.basename(target)
    number = name[len(uuid) + 1:] if name.startswith(uuid + ".") else ""
    return (os.path.dirname(target) == os.path.realpath(share_dir) and number.isascii() and number.isdigit()
            and _locked_file(fd, target, True))


def lease_file_inventory(lease_dir: str) -> Optional[Inventory]:
    """The devices the lease files name, with nothing else known; None if there are none.

    For launches while NVML is unusable (a driver upgraded under a loaded module): the
    devices root last synced still get one lease each. A GPU- file stands for a whole GPU,
    a MIG- file for an instance of an unknown GPU; no index, processes or memory.
    """
    try:
        check_dir(lease_dir, "lease directory", SYNC_HINT)
        names = sorted(os.listdir(lease_dir))
    except (SetupError, OSError):
        return None
    gpus = [Gpu(n, -1, "?", False) for n in names if n.startswith("GPU-")]
    devices = [Device(n, "?", n, -1, 0 if n.startswith("MIG-") else None, 0, 0, None)
               for n in names if n.startswith(("GPU-", "MIG-"))]
    return Inventory("", gpus, devices) if devices else None
