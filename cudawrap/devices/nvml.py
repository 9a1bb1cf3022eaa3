"""The one module that talks to NVML, through nvidia-ml-py (``pynvml``) or, for the shim, ``nvmldirect``.

pynvml is imported lazily: it costs ~24 ms, more than the interpreter's own start, so the
shim passes ``direct=True`` and gets the same calls from ``nvmldirect`` (ctypes, ~2 ms);
sync, monitor, status and doctor use pynvml. Both bindings go through the same code
below, so there is one way to enumerate. NoPermission / NotSupported answers become
``None`` ("unknown") instead of exceptions; a GPU that fails mid-enumeration is reported
as lost and skipped, never guessed at.
"""

from .model import Device, Gpu, Inventory
from ..errors import NvmlUnavailable

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional, Tuple

MIB = 1024 * 1024

# uuid -> (binding, NVML handle) from the last inventory(), so the waiting loop can
# re-query one device without enumerating the machine again.
_handles: "Dict[str, Tuple[Any, Any]]" = {}
# The lean binding once nvmlInit succeeded through it in this process (the shim's): a real
# driver's nvmlInit only counts a second call, but without persistence mode the first can
# take seconds, and a launch must not risk paying that twice.
_direct_ready: "List[Any]" = []


def _binding(direct: bool) -> "Any":
    if direct:
        from . import nvmldirect

        return nvmldirect
    import pynvml

    return pynvml


def init(direct: bool = False) -> "Any":
    """Initialise NVML, or raise NvmlUnavailable with a hint.

    NVML counts nvmlInit calls, so calling this per inventory is cheap and stays correct
    even if something else in the process shut NVML down in between.
    """
    nv = _binding(direct)
    try:
        nv.nvmlInit()
    except nv.NVMLError_LibraryNotFound:
        raise NvmlUnavailable(
            "no NVIDIA driver: libnvidia-ml.so.1 was not found",
            hint="install the NVIDIA driver, or set no_driver in the config",
        ) from None
    except nv.NVMLError_DriverNotLoaded:
        raise NvmlUnavailable(
            "the NVIDIA driver is not loaded", hint="check `nvidia-smi` and `dmesg`"
        ) from None
    except nv.NVMLError as exc:
        raise NvmlUnavailable(f"NVML could not start: {exc}") from None
    if direct and not _direct_ready:
        _direct_ready.append(nv)
    return nv


def _unknown_errors(nv: "Any") -> tuple:
    # Answers that mean "you may not / cannot know", not "the GPU is broken".
    return tuple(
        getattr(nv, name)
        for name in ("NVMLError_NoPermission", "NVMLError_NotSupported", "NVMLError_FunctionNotFound")
        if hasattr(nv, name)
    )


def _pids(nv: "Any", handle: "Any") -> "Optional[Tuple[int, ...]]":
    """Compute processes on one handle; None where NVML hides them."""
    try:
        procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    except _unknown_errors(nv):
        return None
    return tuple(sorted({int(p.pid) for p in procs}))


def _usage(nv: "Any", handle: "Any") -> "Tuple[Optional[Tuple[int, ...]], int, int]":
    """(compute pids or None if hidden, memory used MiB, memory total MiB) of one handle."""
    memory = nv.nvmlDeviceGetMemoryInfo(handle)
    return _pids(nv, handle), int(memory.used) // MIB, int(memory.total) // MIB


def _utilization(nv: "Any", handle: "Any") -> "Optional[int]":
    """GPU utilisation in %, None where NVML does not report it (MIG, some boards)."""
    try:
        return int(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
    except _unknown_errors(nv):
        return None


def _profile(name: str) -> str:
    # NVML names a MIG device "NVIDIA A100-SXM4-80GB MIG 1g.10gb"; the profile is what
    # tells two instances of one GPU apart for people.
    marker = " MIG "
    return name.split(marker, 1)[1] if marker in name else name


def _mig_mode(nv: "Any", handle: "Any") -> bool:
    try:
        current, _pending = nv.nvmlDeviceGetMigMode(handle)
    except _unknown_errors(nv):
        return False
    return current == getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1)


def _mig_devices(nv: "Any", gpu: "Gpu", handle: "Any") -> "List[Device]":
    devices = []
    for slot in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
        except (nv.NVMLError_NotFound, nv.NVMLError_InvalidArgument):
            continue  # an empty slot: partitioned GPUs have gaps
        uuid = nv.nvmlDeviceGetUUID(mig)
        pids, used, total = _usage(nv, mig)
        _handles[uuid] = (nv, mig)
        devices.append(Device(uuid, _profile(nv.nvmlDeviceGetName(mig)), gpu.uuid, gpu.index,
                              slot, total, used, pids))
    return devices


def inventory(utilization: bool = False, direct: bool = False, nv: "Any" = None) -> "Inventory":
    """Enumerate every leasable device with its current processes and memory.

    UTILIZATION: also read whole GPUs' utilisation (one more query each), for a filter
    that needs it; the launch path otherwise never pays for it. DIRECT: through
    ``nvmldirect`` (the shim's lean binding) instead of pynvml. NV: the binding init()
    gave the caller, who reads more after this (status): no nvmlInit again.
    """
    nv = init(direct) if nv is None else nv
    try:
        driver = nv.nvmlSystemGetDriverVersion()
        count = nv.nvmlDeviceGetCount()
    except nv.NVMLError as exc:
        # The machine as a whole cannot be read (no GPU to skip): as if NVML were missing,
        # so the no_driver policy decides, and the monitor and status carry on.
        raise NvmlUnavailable(f"NVML started but cannot list the devices: {exc}",
                              hint="check `nvidia-smi`; a driver upgrade may need a reboot") from None
    gpus: "List[Gpu]" = []
    devices: "List[Device]" = []
    lost: "List[str]" = []
    for index in range(count):
        uuid = f"index {index}"
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = nv.nvmlDeviceGetUUID(handle)
            gpu = Gpu(uuid, index, nv.nvmlDeviceGetName(handle), _mig_mode(nv, handle))
            if gpu.mig_mode:
                found = _mig_devices(nv, gpu, handle)
            else:
                pids, used, total = _usage(nv, handle)
                _handles[uuid] = (nv, handle)
                util = _utilization(nv, handle) if utilization else None
                found = [Device(uuid, gpu.name, uuid, index, None, total, used, pids, util)]
        except nv.NVMLError:
            # A GPU fallen off the bus (or its driver state broken) must not take the
            # whole machine down with it: skip it, report it, hand out the others.
            lost.append(uuid)
            continue
        gpus.append(gpu)
        devices.extend(found)
    return Inventory(driver, gpus, devices, lost)


def mig_by_ids(gpu_uuid: str, gi: int, ci: int) -> "Optional[str]":
    """The UUID of GPU_UUID's MIG instance with GPU instance GI and compute instance CI, or None.

    For CUDA_VISIBLE_DEVICES=MIG-GPU-<uuid>/<gi>/<ci>, the pre-R470 spelling; asked only
    when someone uses it, so the ids need not be kept in every inventory.
    """
    nv = init()
    try:
        handle = nv.nvmlDeviceGetHandleByUUID(gpu_uuid)
        for slot in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except (nv.NVMLError_NotFound, nv.NVMLError_InvalidArgument):
                continue
            if (nv.nvmlDeviceGetGpuInstanceId(mig), nv.nvmlDeviceGetComputeInstanceId(mig)) == (gi, ci):
                return nv.nvmlDeviceGetUUID(mig)
    except nv.NVMLError:
        pass  # an unknown or lost GPU: the entry names nothing, as for CUDA
    return None


def node_ids(uuid: str) -> "Optional[Tuple[int, Optional[int], Optional[int]]]":
    """(minor, GI, CI) of a leasable device: the minor number of its GPU's node /dev/nvidiaN
    (a MIG instance's parent's) and, for a MIG instance, its GPU and compute instance ids,
    which name its capability nodes; None where NVML cannot say (gone, lost).

    Read only when the service confines a run to its devices, never on the launch path: the
    inventory has no use for them otherwise.
    """
    nv = init()
    try:
        handle = nv.nvmlDeviceGetHandleByUUID(uuid)
        if uuid.startswith("MIG-"):
            parent = nv.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle)
            return (nv.nvmlDeviceGetMinorNumber(parent), nv.nvmlDeviceGetGpuInstanceId(handle),
                    nv.nvmlDeviceGetComputeInstanceId(handle))
        return nv.nvmlDeviceGetMinorNumber(handle), None, None
    except nv.NVMLError:
        return None


def matches(layout: "Inventory") -> bool:
    """Whether LAYOUT (``invcache``) may still describe the machine, for the shim.

    False with another GPU count or driver, or any NVML error (the caller must enumerate).
    Nothing is read of the devices: a launch reads only those it is about to take
    (``refresh``, by UUID), and a MIG instance destroyed since the layout was written is
    not found there, so it is never handed out.
    """
    nv = init(direct=True)
    try:
        return (nv.nvmlDeviceGetCount() == len(layout.gpus)
                and nv.nvmlSystemGetDriverVersion() == layout.driver_version)
    except nv.NVMLError:
        return False


def refresh(device: "Device") -> "Optional[Device]":
    """The same device with current processes and memory; None if NVML lost it."""
    entry = _handles.get(device.uuid)
    if entry is None:
        # Not enumerated in this process (the shim started from a snapshot or the layout):
        # found by its UUID, through the lean binding of the launch path.
        nv = _direct_ready[0] if _direct_ready else init(direct=True)
        try:
            handle = nv.nvmlDeviceGetHandleByUUID(device.uuid)  # MIG instances' UUIDs too
        except nv.NVMLError:
            return None  # gone (a MIG instance destroyed) or its GPU lost
        _handles[device.uuid] = (nv, handle)
    else:
        nv, handle = entry
    try:
        # A handle is a position (GPU, MIG slot): after a MIG reconfiguration the slot may
        # hold another instance, whose data must not pass for this one's.
        if entry is not None and nv.nvmlDeviceGetUUID(handle) != device.uuid:
            return None
        pids, used, total = _usage(nv, handle)
        # Utilisation only where it was read before: someone filters on it.
        util = None if device.utilization is None else _utilization(nv, handle)
    except nv.NVMLError:
        return None
    return Device(device.uuid, device.name, device.parent_uuid, device.gpu_index,
                  device.mig_slot, total, used, pids, util)


def _reading(nv: "Any", ask: "Any", *args: "Any") -> "Any":
    """One status reading; None where NVML cannot say (NotSupported, NoPermission, lost)."""
    try:
        return ask(*args)
    except nv.NVMLError:
        return None


def readings(uuid: str, nv: "Any" = None) -> "Dict[str, Any]":
    """What `cudawrap status` shows beyond the inventory, for the GPU or MIG device UUID:
    utilisation, temperature, power, performance state and each process's memory.

    Status only: these are a dozen more queries per device, which the launch path never
    makes. Every value is None where the driver does not report it (most of them on MIG
    instances). NV: the binding init() gave the caller, once for all its devices (an
    nvmlInit per device cost a status with 900 waiting ~100 ms on the stand-in).
    """
    nv = init() if nv is None else nv
    try:
        handle = nv.nvmlDeviceGetHandleByUUID(uuid)
    except nv.NVMLError:
        return {}
    rates = _reading(nv, nv.nvmlDeviceGetUtilizationRates, handle)
    memory = _reading(nv, nv.nvmlDeviceGetMemoryInfo, handle)
    temperature = _reading(nv, nv.nvmlDeviceGetTemperature, handle,
                           getattr(nv, "NVML_TEMPERATURE_GPU", 0))
    power = _reading(nv, nv.nvmlDeviceGetPowerUsage, handle)
    limit = _reading(nv, nv.nvmlDeviceGetEnforcedPowerLimit, handle)
    pstate = _reading(nv, nv.nvmlDeviceGetPerformanceState, handle)
    procs = _reading(nv, nv.nvmlDeviceGetComputeRunningProcesses, handle)
    memory_of: "Optional[Dict[int, Optional[int]]]" = None
    if procs is not None:
        memory_of = {}
        for proc in procs:
            used = getattr(proc, "usedGpuMemory", None)  # None where the driver hides it
            memory_of[int(proc.pid)] = None if used is None else int(used) // MIB
    return {
        "utilization": None if rates is None else int(rates.gpu),
        "memory_utilization": None if rates is None else int(rates.memory),
        "memory_free_mib": None if memory is None else int(memory.free) // MIB,
        "temperature_c": None if temperature is None else int(temperature),
        "power_w": None if power is None else round(power / 1000, 1),
        "power_limit_w": None if limit is None else round(limit / 1000, 1),
        # NVML_PSTATE_UNKNOWN (32) is as good as no answer.
        "performance_state": None if pstate is None or not 0 <= pstate <= 15 else f"P{pstate}",
        "process_memory_mib": memory_of,
    }
