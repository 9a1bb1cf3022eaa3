"""The machine's device layout as root last enumerated it, for launches without the monitor.

Which GPUs and MIG instances exist changes only when MIG is reconfigured or the driver
changes, and both require `cudawrap sync` (new devices get lease files there, so nothing
can be leased before it runs anyway). Sync and the monitor write the layout here; a
launch without a fresh usage snapshot then reads NVML only for the devices it is about
to take, found by UUID (``nvml.refresh``), instead of enumerating the machine.

The cache can never hand out a device that is gone: ``nvml.matches`` checks the GPU
count and driver version (a mismatch or NVML error sends the launch to a full
enumeration), and a device is taken only after NVML found it by its UUID and showed no
foreign process on it. It holds no usage data: processes and memory are always read at
launch. With a GPU lost, no cache is written (lost GPUs are handled by the full
enumeration).
"""

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Optional

from .. import locations as loc
from ..base import rootfile
from .model import Device, Inventory

VERSION = 1


def layout_of(inventory: "Inventory") -> "Inventory":
    """INVENTORY without usage: no process list (unknown), no memory used."""
    devices = [Device(d.uuid, d.name, d.parent_uuid, d.gpu_index, d.mig_slot, d.memory_total_mib, 0, None)
               for d in inventory.devices]
    return Inventory(inventory.driver_version, inventory.gpus, devices)


def write(root: str, inventory: "Inventory") -> None:
    """Keep INVENTORY's layout for launches; removes the cache instead while a GPU is lost."""
    path = loc.under(root, loc.INVENTORY_CACHE)
    if inventory.lost:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    data = {"version": VERSION, "inventory": layout_of(inventory).to_tuple()}
    if rootfile.read(root, path, VERSION) != data:  # the monitor calls this every cycle
        rootfile.write(path, data)


def read(root: str) -> "Optional[Inventory]":
    """The layout if root wrote a usable cache, else None."""
    data = rootfile.read(root, loc.under(root, loc.INVENTORY_CACHE), VERSION)
    try:
        return None if data is None else Inventory.from_tuple(data["inventory"])
    except (KeyError, TypeError, ValueError):
        return None
