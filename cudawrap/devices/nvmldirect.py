"""The dozen NVML calls a launch needs, straight through ctypes, for the shim's own path.

Importing ``pynvml`` costs a launch ~24 ms: it defines some 400 classes and imports
``ctypes.util`` (and with it ``subprocess``, ``re``, ``tempfile``...) for ``find_library``,
which it never calls on Linux. That is more than the whole interpreter's start, on every
launch of every wrapped program. This module offers the same names and semantics as
pynvml for the calls ``nvml.inventory`` and ``nvml.refresh`` make -- functions, the
``NVMLError_*`` classes -- so those two stay the one enumeration logic over either binding:
the shim passes this one, everything else (sync, monitor, status, doctor) uses pynvml,
as the project's rule says. Struct layouts and symbol versions are those pynvml uses
(nvml.h: ``nvmlMemory_t``, ``nvmlProcessInfo_t`` with ``_v3``, ``_v2`` init/count/index).

Nothing here runs on import: the library is opened by ``nvmlInit``.
"""

import ctypes

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, List, Tuple

LIBRARY = "libnvidia-ml.so.1"
NVML_DEVICE_MIG_ENABLE = 1
_BUFFER = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE and the UUID buffer size, both 96
_VERSION_BUFFER = 80
_SUCCESS = 0
_INSUFFICIENT_SIZE = 7

_lib: "Any" = None


class NVMLError(Exception):
    """An NVML return code other than success; subclasses by code, as in pynvml."""

    value = 999

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        try:
            if _lib is not None:
                text = _lib.nvmlErrorString(self.value)
                if text:
                    return text.decode("utf-8", "replace")
        except (AttributeError, ctypes.ArgumentError):
            pass
        return f"NVML error {self.value}"


def _error_class(name: str, code: int) -> type:
    return type(f"NVMLError_{name}", (NVMLError,), {"value": code})


# The codes whose pynvml class nvml.py names; any other code is a plain NVMLError.
NVMLError_InvalidArgument = _error_class("InvalidArgument", 2)
NVMLError_NotSupported = _error_class("NotSupported", 3)
NVMLError_NoPermission = _error_class("NoPermission", 4)
NVMLError_NotFound = _error_class("NotFound", 6)
NVMLError_DriverNotLoaded = _error_class("DriverNotLoaded", 9)
NVMLError_LibraryNotFound = _error_class("LibraryNotFound", 12)
NVMLError_FunctionNotFound = _error_class("FunctionNotFound", 13)
NVMLError_GpuIsLost = _error_class("GpuIsLost", 15)
_BY_CODE: "Dict[int, type]" = {cls.value: cls for cls in (
    NVMLError_InvalidArgument, NVMLError_NotSupported, NVMLError_NoPermission, NVMLError_NotFound,
    NVMLError_DriverNotLoaded, NVMLError_LibraryNotFound, NVMLError_FunctionNotFound,
    NVMLError_GpuIsLost)}


def _check(ret: int) -> None:
    if ret != _SUCCESS:
        raise _BY_CODE.get(ret, NVMLError)(ret)


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _ProcessInfo(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


def _fn(name: str) -> "Any":
    if _lib is None:
        raise NVMLError(1)  # NVML_ERROR_UNINITIALIZED, as pynvml says before nvmlInit
    try:
        return getattr(_lib, name)
    except AttributeError:
        raise NVMLError_FunctionNotFound(13) from None


def nvmlInit() -> None:
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL(LIBRARY)
        except OSError:
            raise NVMLError_LibraryNotFound(12) from None
        lib.nvmlErrorString.restype = ctypes.c_char_p
        _lib = lib
    _check(_fn("nvmlInitWithFlags")(ctypes.c_uint(0)))


def _text(name: str, *args: "Any", size: int = _BUFFER) -> str:
    buf = ctypes.create_string_buffer(size)
    _check(_fn(name)(*args, buf, ctypes.c_uint(size)))
    return buf.value.decode("utf-8", "replace")


def _uint(name: str, *args: "Any") -> int:
    value = ctypes.c_uint(0)
    _check(_fn(name)(*args, ctypes.byref(value)))
    return value.value


def _handle(name: str, *args: "Any") -> "ctypes.c_void_p":
    handle = ctypes.c_void_p()
    _check(_fn(name)(*args, ctypes.byref(handle)))
    return handle


def nvmlSystemGetDriverVersion() -> str:
    return _text("nvmlSystemGetDriverVersion", size=_VERSION_BUFFER)


def nvmlDeviceGetCount() -> int:
    return _uint("nvmlDeviceGetCount_v2")


def nvmlDeviceGetHandleByIndex(index: int) -> "ctypes.c_void_p":
    return _handle("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index))


def nvmlDeviceGetHandleByUUID(uuid: str) -> "ctypes.c_void_p":
    return _handle("nvmlDeviceGetHandleByUUID", uuid.encode())


def nvmlDeviceGetMigDeviceHandleByIndex(handle: "ctypes.c_void_p", index: int) -> "ctypes.c_void_p":
    return _handle("nvmlDeviceGetMigDeviceHandleByIndex", handle, ctypes.c_uint(index))


def nvmlDeviceGetUUID(handle: "ctypes.c_void_p") -> str:
    return _text("nvmlDeviceGetUUID", handle)


def nvmlDeviceGetName(handle: "ctypes.c_void_p") -> str:
    return _text("nvmlDeviceGetName", handle)


def nvmlDeviceGetMaxMigDeviceCount(handle: "ctypes.c_void_p") -> int:
    return _uint("nvmlDeviceGetMaxMigDeviceCount", handle)


def nvmlDeviceGetMigMode(handle: "ctypes.c_void_p") -> "Tuple[int, int]":
    current, pending = ctypes.c_uint(0), ctypes.c_uint(0)
    _check(_fn("nvmlDeviceGetMigMode")(handle, ctypes.byref(current), ctypes.byref(pending)))
    return current.value, pending.value


def nvmlDeviceGetMemoryInfo(handle: "ctypes.c_void_p") -> "_Memory":
    memory = _Memory()
    _check(_fn("nvmlDeviceGetMemoryInfo")(handle, ctypes.byref(memory)))
    return memory


def nvmlDeviceGetComputeRunningProcesses(handle: "ctypes.c_void_p") -> "List[_ProcessInfo]":
    fn = _fn("nvmlDeviceGetComputeRunningProcesses_v3")
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret == _SUCCESS:
        return []  # nobody on it: the usual answer to the size query
    if ret != _INSUFFICIENT_SIZE:
        _check(ret)
    # Room for processes started between the two calls, as pynvml allows.
    count.value = count.value * 2 + 5
    infos = (_ProcessInfo * count.value)()
    _check(fn(handle, ctypes.byref(count), infos))
    return list(infos[:count.value])
