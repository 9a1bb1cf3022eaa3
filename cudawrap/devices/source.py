"""Where a launch reads the machine from: one interface, one implementation per source.

As Slurm's gpu plugins (gpu/nvml reads the hardware, gpu/generic knows devices by name
only), a launch asks a DeviceSource for the machine (inventory()) and, while it decides or
waits, for one device again (refresh()). The sources, cheapest first (choose()):

- SnapshotSource: the monitor's fresh snapshot; no NVML at all while it stays fresh.
- LayoutSource: the layout `cudawrap sync` saw, still matching the machine; its devices'
  usage is unread, and read from NVML one by one as the launch is about to take them.
- NvmlSource: the whole machine enumerated through NVML's lean binding.
- GenericSource: devices known by name only (the lease files root made, when NVML is
  unusable); nothing is re-read.

On the shim's path: NVML, the snapshot and the layout are imported only by the source used.
"""

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Optional

    from .model import Device, Inventory


class DeviceSource:
    """The machine as one source sees it."""

    # Whether the devices' usage (processes, memory) is unread: the acquirer reads a device
    # before judging it, and a decision that fails may be the source's fault (see unread).
    unread = False
    # The monitor's snapshot file this source reads, if it is one (the acquirer checks its age).
    snapshot: "Optional[str]" = None

    def __init__(self, inventory: "Inventory") -> None:
        self._inventory = inventory

    def inventory(self) -> "Inventory":
        """The devices, as read when the source was chosen."""
        return self._inventory

    def refresh(self, device: "Device") -> "Optional[Device]":
        """DEVICE read again now; None if it is gone."""
        raise NotImplementedError


class SnapshotSource(DeviceSource):
    """The monitor's snapshot; once it stops being fresh, NVML (SnapshotRefresh)."""

    def __init__(self, root: str, inventory: "Inventory") -> None:
        from .. import locations as loc
        from .snapshot import SnapshotRefresh

        super().__init__(inventory)
        self._refresh = SnapshotRefresh(root)
        self.snapshot = loc.under(root, loc.USAGE_SNAPSHOT)

    @classmethod
    def read(cls, root: str) -> "Optional[SnapshotSource]":
        """The snapshot's source, or None when there is no fresh snapshot written by root."""
        from .snapshot import read_fresh

        inventory = read_fresh(root)
        return cls(root, inventory) if inventory is not None else None

    def refresh(self, device: "Device") -> "Optional[Device]":
        return self._refresh(device)


class NvmlSource(DeviceSource):
    """NVML, every device enumerated (ctypes, not pynvml: see nvmldirect)."""

    @classmethod
    def read(cls) -> "NvmlSource":
        """NvmlUnavailable if NVML cannot be used."""
        from . import nvml

        return cls(nvml.inventory(direct=True))

    def refresh(self, device: "Device") -> "Optional[Device]":
        from . import nvml

        return nvml.refresh(device)


class LayoutSource(NvmlSource):
    """Sync's layout: a launch on 56 MIG instances reads one or two of them, not all."""

    unread = True

    @classmethod
    def read_layout(cls, root: str) -> "Optional[LayoutSource]":
        """The layout's source, or None when there is none or it no longer matches NVML's
        devices (NvmlUnavailable if NVML cannot be used)."""
        from . import invcache, nvml

        layout = invcache.read(root)
        return cls(layout) if layout is not None and nvml.matches(layout) else None


class GenericSource(DeviceSource):
    """Devices known by name only: what is known of them stays as it is."""

    def refresh(self, device: "Device") -> "Optional[Device]":
        return device


def choose(root: str, layout: bool) -> "DeviceSource":
    """The cheapest source that knows the machine now: the monitor's snapshot, else (if
    LAYOUT: no reader needs every device's usage) sync's layout, else NVML's enumeration.
    NvmlUnavailable if it takes NVML and NVML cannot be used."""
    source: "Optional[DeviceSource]" = SnapshotSource.read(root)
    if source is None and layout:
        source = LayoutSource.read_layout(root)
    return source if source is not None else NvmlSource.read()
