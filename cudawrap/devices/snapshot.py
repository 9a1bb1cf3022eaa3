"""A fresh view of the machine for the shim, kept by `cudawrap monitor` (root).

Importing pynvml and initialising NVML costs ~25 ms per launch on an idle machine and
seconds on GPUs without persistence mode; the monitor pays it once and rewrites this
snapshot every half second. The shim uses the snapshot only while it is fresh and was
written by root; otherwise it asks NVML itself. Correctness never depends on it: leases
are decided by flock alone, the snapshot only says where other people's processes run.

It records every process NVML lists, on every device, held or not: a foreign process on
a leased device must still count once the lease is free. For each listed process it could
see in /proc it also records when that process started, so that a reader may discount one
that has exited since (or whose pid now names another process), and take a freed device at
once instead of waiting for the next snapshot: NVML itself drops a process from its list as
the process exits. A process the monitor could not see (another pid namespace, whose pids
mean nothing here) keeps counting until NVML stops listing it, and so does every process
when the reader's pid namespace is not the monitor's. A process still alive keeps counting:
the snapshot can only make a launch more careful than NVML. A zombie does not: its parent
may reap it only when it next looks, and it holds nothing on the GPU.
"""

import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Iterable, Optional, Set

from .. import locations as loc
from ..base import rootfile
from .model import Device, Inventory

VERSION = 3
PERIOD_S = 0.5
# Older than this, the monitor is presumed gone and the shim asks NVML itself.
MAX_AGE_S = 3.0


def write(root: str, inventory: "Inventory") -> None:
    """INVENTORY as NVML gave it, with the start time of each listed process seen in /proc."""
    from ..base.proc import namespace, start_time

    started: "Dict[int, int]" = {}
    for device in inventory.devices:
        for pid in device.pids or ():
            if pid not in started:
                when = start_time(pid)  # (a zombie's too: readers discount it)
                if when is not None:
                    started[pid] = when
    data = {"version": VERSION, "written": time.monotonic(), "inventory": inventory.to_tuple(),
            "started": started, "namespace": namespace()}
    rootfile.write(loc.under(root, loc.USAGE_SNAPSHOT), data)


def _without_exited(device: "Device", exited: "Set[int]") -> "Device":
    if not device.pids or not exited.intersection(device.pids):
        return device
    return Device(device.uuid, device.name, device.parent_uuid, device.gpu_index, device.mig_slot,
                  device.memory_total_mib, device.memory_used_mib,
                  tuple(p for p in device.pids if p not in exited))


def _exited(started: "Dict[int, int]", listed: "Iterable[int]", recorded: object) -> "Set[int]":
    """Those of LISTED seen by the monitor (STARTED: pid -> start time) that are no longer
    the process it saw: exited, a zombie, or their pid reused. None where the pids of
    this process's namespace are not the monitor's (RECORDED)."""
    seen = [p for p in listed if p in started]
    if not seen:
        return set()  # no process on any device: base/proc.py stays off the launch's path
    from ..base.proc import namespace, started_as

    if namespace() != recorded:
        return set()
    return {p for p in seen if not started_as(p, started[p])}


# path -> (the file's bytes, its data, its inventory): a reader that looks again and again
# (the service, at each hand-over) parses each snapshot once. Compared by content, not by
# the file's identity: one rewritten within a tick of the clock looks unchanged.
_parsed: "Dict[str, tuple]" = {}


def _read(root: str) -> "Optional[tuple]":
    """(the snapshot's data, its inventory), or None where there is none root wrote."""
    path = loc.under(root, loc.USAGE_SNAPSHOT)
    raw = rootfile.read_raw(root, path)
    kept = _parsed.get(path)
    if raw is not None and kept is not None and kept[0] == raw:
        return kept[1:]
    data = rootfile.loads(raw, VERSION)
    if data is None:
        return None
    try:
        parsed = (data, Inventory.from_tuple(data["inventory"]))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    _parsed.clear()
    _parsed[path] = (raw,) + parsed
    return parsed


def read_fresh(root: str, max_age: float = MAX_AGE_S) -> "Optional[Inventory]":
    """The snapshot's inventory if root wrote it less than MAX_AGE seconds ago, else None.

    Processes the monitor saw that have exited since are left out; every other process
    the snapshot lists stays.
    """
    fresh = _fresh(root, max_age)
    if fresh is None:
        return None
    data, inventory = fresh
    devices = _current(data, inventory.devices)
    return None if devices is None else Inventory(inventory.driver_version, inventory.gpus, devices, inventory.lost)


def read_fresh_device(root: str, uuid: str, max_age: float = MAX_AGE_S) -> "tuple[bool, Optional[Device]]":
    """(whether root's snapshot is fresh, as read_fresh says; UUID's device in it, less the
    processes that have exited since, or None where it lists no such device).

    One device's processes are looked up in /proc, not every device's: the service reads a
    freed device this way at each hand-over, and on a machine of 56 MIG instances, each
    with its processes, read_fresh would look up every process on it (~15 us each, more on
    a cold CPU) to answer for one."""
    fresh = _fresh(root, max_age)
    if fresh is None:
        return False, None
    data, inventory = fresh
    device = inventory.by_uuid(uuid)
    if device is None:
        return True, None
    current = _current(data, [device])
    return (False, None) if current is None else (True, current[0])


def _fresh(root: str, max_age: float) -> "Optional[tuple]":
    """(the snapshot's data, its inventory) where root wrote it less than MAX_AGE s ago."""
    read = _read(root)
    if read is None:
        return None
    try:
        if not 0 <= time.monotonic() - read[0]["written"] < max_age:
            return None
    except (KeyError, TypeError):
        return None
    return read


def _current(data: dict, devices: "list[Device]") -> "Optional[list[Device]]":
    """DEVICES less the processes the monitor saw (DATA) that have exited since; None where
    DATA does not say (not a snapshot this version writes)."""
    try:
        listed = {p for d in devices for p in d.pids or ()}
        exited = _exited(data["started"], listed, tuple(data["namespace"]) if data["namespace"] else None)
        return [_without_exited(d, exited) for d in devices]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


class SnapshotRefresh:
    """Re-reading one device: the newest snapshot, else NVML. A waiting shim (STICKY) asks
    NVML from then on; the service, whose own child writes the snapshot, looks again next time."""

    def __init__(self, root: str, sticky: bool = True) -> None:
        self.root = root
        self.sticky = sticky
        self.nvml = False

    def __call__(self, device: "Device") -> "Optional[Device]":
        if not self.nvml:
            fresh, found = read_fresh_device(self.root, device.uuid)
            if fresh:
                return found
            self.nvml = self.sticky  # the monitor stopped: from now on ask NVML
        return self.fresh(device)

    def fresh(self, device: "Device") -> "Optional[Device]":
        """DEVICE as NVML says now (the snapshot may be half a second old)."""
        from . import nvml

        return nvml.refresh(device)
