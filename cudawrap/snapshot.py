"""A fresh view of the machine for the shim, kept by `cudawrap monitor` (root).

Importing pynvml and initialising NVML costs ~25 ms per launch on an idle machine and
seconds on GPUs without persistence mode; the monitor pays it once and rewrites this
snapshot every half second. The shim uses the snapshot only while it is fresh and was
written by root; otherwise it asks NVML itself. Correctness never depends on it: leases
are decided by flock alone, the snapshot only says where other people's processes run.

Devices whose lease was held when the snapshot was taken are recorded with no processes:
whatever ran there was the lessee's, so once the lease is free the device is free, without
waiting for the next snapshot.
"""
from __future__ import annotations

import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Iterable, Optional

from . import locations as loc, rootfile
from .devices import Device, Inventory

VERSION = 1
PERIOD_S = 0.5
# Older than this, the monitor is presumed gone and the shim asks NVML itself.
MAX_AGE_S = 3.0


def write(root: str, inventory: Inventory, held: Iterable[str]) -> None:
    held = set(held)
    devices = []
    for d in inventory.devices:
        if d.uuid in held:
            d = Device(d.uuid, d.name, d.parent_uuid, d.gpu_index, d.mig_slot,
                       d.memory_total_mib, 0, ())
        devices.append(d)
    view = Inventory(inventory.driver_version, inventory.gpus, devices, inventory.lost)
    data = {"version": VERSION, "written": time.monotonic(), "inventory": view.to_tuple()}
    rootfile.write(loc.under(root, loc.USAGE_SNAPSHOT), data)


def read_fresh(root: str, max_age: float = MAX_AGE_S) -> Optional[Inventory]:
    """The snapshot's inventory if root wrote it less than MAX_AGE seconds ago, else None."""
    data = rootfile.read(root, loc.under(root, loc.USAGE_SNAPSHOT), VERSION)
    try:
        if data is None or not 0 <= time.monotonic() - data["written"] < max_age:
            return None
        return Inventory.from_tuple(data["inventory"])
    except (KeyError, TypeError, ValueError):
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
