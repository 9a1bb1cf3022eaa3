"""What a program can be given: whole GPUs not in MIG mode, and MIG instances.

Plain ``__slots__`` classes rather than dataclasses because the shim builds these on
every launch (dataclasses cost ~19 ms to import); they convert to and from tuples so the
root-written caches can store them with ``marshal``.
"""

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Iterable, List, Optional, Tuple

# Drivers from R570 let one CUDA process use several MIG instances; before, only the
# first MIG device in CUDA_VISIBLE_DEVICES is enumerated.
MULTI_MIG_DRIVER = 570


class Device:
    """One leasable device and, where known, who is on it right now."""

    __slots__ = (
        "uuid", "name", "parent_uuid", "gpu_index", "mig_slot",
        "memory_total_mib", "memory_used_mib", "pids", "utilization",
    )

    def __init__(
        self,
        uuid: str,
        name: str,
        parent_uuid: str,
        gpu_index: int,
        mig_slot: "Optional[int]",
        memory_total_mib: int,
        memory_used_mib: "Optional[int]",
        pids: "Optional[Tuple[int, ...]]",
        utilization: "Optional[int]" = None,
    ) -> None:
        self.uuid = uuid
        self.name = name  # GPU product name, or MIG profile such as "1g.10gb"
        self.parent_uuid = parent_uuid  # the physical GPU; itself for a whole GPU
        self.gpu_index = gpu_index  # NVML index of the physical GPU (PCI order)
        self.mig_slot = mig_slot  # None for a whole GPU
        self.memory_total_mib = memory_total_mib
        self.memory_used_mib = memory_used_mib  # None: not read (the launch path, pids known)
        self.pids = pids  # compute processes; None where NVML answered NoPermission
        # GPU utilisation in %, read only when asked for (a filter, status); None where
        # not read or not reported (MIG instances and GPUs in MIG mode never report it).
        self.utilization = utilization

    @property
    def is_mig(self) -> bool:
        return self.mig_slot is not None

    def to_tuple(self) -> tuple:
        return (self.uuid, self.name, self.parent_uuid, self.gpu_index, self.mig_slot,
                self.memory_total_mib, self.memory_used_mib, self.pids, self.utilization)

    @classmethod
    def from_tuple(cls, t: tuple) -> "Device":
        return cls(*t)

    def __repr__(self) -> str:
        return f"Device({self.uuid!r}, {self.name!r}, gpu={self.gpu_index}, slot={self.mig_slot})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and self.to_tuple() == other.to_tuple()

    def __hash__(self) -> int:
        return hash(self.uuid)


class Gpu:
    """A physical GPU as NVML lists it."""

    __slots__ = ("uuid", "index", "name", "mig_mode")

    def __init__(self, uuid: str, index: int, name: str, mig_mode: bool) -> None:
        self.uuid = uuid
        self.index = index
        self.name = name
        self.mig_mode = mig_mode

    def to_tuple(self) -> tuple:
        return (self.uuid, self.index, self.name, self.mig_mode)


class Inventory:
    """Every leasable device of the machine at one moment, in NVML order."""

    __slots__ = ("driver_version", "gpus", "devices", "lost")

    def __init__(self, driver_version: str, gpus: "Iterable[Gpu]", devices: "Iterable[Device]",
                 lost: "Iterable[str]" = ()) -> None:
        self.driver_version = driver_version
        self.gpus = tuple(gpus)
        self.devices = tuple(devices)
        self.lost = tuple(lost)  # UUIDs of GPUs NVML reported lost or failing

    @property
    def driver_major(self) -> int:
        try:
            return int(self.driver_version.split(".", 1)[0])
        except ValueError:
            return 0

    @property
    def multi_mig(self) -> bool:
        """Whether one process may use several MIG instances with this driver."""
        return self.driver_major >= MULTI_MIG_DRIVER

    def by_uuid(self, uuid: str) -> "Optional[Device]":
        for device in self.devices:
            if device.uuid == uuid:
                return device
        return None

    def to_tuple(self) -> tuple:
        return (self.driver_version, tuple(g.to_tuple() for g in self.gpus),
                tuple(d.to_tuple() for d in self.devices), self.lost)

    @classmethod
    def from_tuple(cls, t: tuple) -> "Inventory":
        driver, gpus, devices, lost = t
        return cls(driver, (Gpu(*g) for g in gpus), (Device(*d) for d in devices), lost)

    def uuids(self) -> "List[str]":
        return [d.uuid for d in self.devices]
