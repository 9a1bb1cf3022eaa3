"""A fresh view of the machine for the shim, kept by `cudawrap monitor` (root).

Importing pynvml and initialising NVML costs ~25 ms per launch on an idle machine and
seconds on GPUs without persistence mode; the monitor pays it once and rewrites this
snapshot every half second. The shim uses the snapshot only while it is fresh and was
written by root; otherwise it asks NVML itself. Correctness never depends on it: leases
are decided by flock alone, the snapshot only says where other people's processes run.

It records every process NVML lists, on every device, held or not: a foreign process on
a leased device must still count once the lease is free. It also records which of them
held that device's lease (their own descriptor owns the flock), so that a reader may
discount such a process once it has exited, and take a freed device at once instead
of waiting for the next snapshot. A lessee still alive (it closed its descriptor) keeps
counting: the snapshot can only make a launch more careful than NVML. A zombie does not:
its parent may reap it only when it next looks, and it holds nothing on the GPU.
"""
from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Iterable, Optional

from .. import locations as loc
from ..base import rootfile
from .model import Device, Inventory

VERSION = 2
PERIOD_S = 0.5
# Older than this, the monitor is presumed gone and the shim asks NVML itself.
MAX_AGE_S = 3.0


def write(root: str, inventory: Inventory, lessees: Dict[str, Iterable[int]]) -> None:
    """INVENTORY as NVML gave it; LESSEES: uuid -> the listed pids that held its lease."""
    data = {"version": VERSION, "written": time.monotonic(), "inventory": inventory.to_tuple(),
            "lessees": {uuid: tuple(pids) for uuid, pids in lessees.items()}}
    rootfile.write(loc.under(root, loc.USAGE_SNAPSHOT), data)


def _exited(pid: int) -> bool:
    """Whether PID has exited: gone, or a zombie not yet reaped by its parent (which holds no
    descriptor and no GPU context: the kernel released both before it became one)."""
    from ..proc import GONE, state

    return state(pid) in (GONE, b"Z", b"X")


def _without_exited_lessees(device: Device, lessees: Iterable[int]) -> Device:
    gone = {p for p in lessees if device.pids and p in device.pids and _exited(p)}
    if not gone:
        return device
    return Device(device.uuid, device.name, device.parent_uuid, device.gpu_index, device.mig_slot,
                  device.memory_total_mib, device.memory_used_mib,
                  tuple(p for p in device.pids if p not in gone))


def read_fresh(root: str, max_age: float = MAX_AGE_S) -> Optional[Inventory]:
    """The snapshot's inventory if root wrote it less than MAX_AGE seconds ago, else None.

    Processes that held a device's lease and have exited since are left out; every other
    process the snapshot lists stays.
    """
    data = rootfile.read(root, loc.under(root, loc.USAGE_SNAPSHOT), VERSION)
    try:
        if data is None or not 0 <= time.monotonic() - data["written"] < max_age:
            return None
        inventory = Inventory.from_tuple(data["inventory"])
        lessees = data["lessees"]
        devices = [_without_exited_lessees(d, lessees.get(d.uuid, ())) for d in inventory.devices]
        return Inventory(inventory.driver_version, inventory.gpus, devices, inventory.lost)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


class SnapshotRefresh:
    """Re-reading one device for a waiting shim: the newest snapshot, else NVML."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.nvml = False

    def __call__(self, device: Device) -> Optional[Device]:
        if not self.nvml:
            inventory = read_fresh(self.root)
            if inventory is not None:
                return inventory.by_uuid(device.uuid)
            self.nvml = True  # the monitor stopped: from now on ask NVML
        from . import nvml

        return nvml.refresh(device)
