"""GPU health, what NVML says: the events since the last cycle (XID critical errors,
double-bit ECC) and the conditions that persist (a GPU lost to the driver, row remapping
pending or failed, clocks slowed). Read only; the rule (rule.py) judges them.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .rule import Event

log = logging.getLogger(__name__)

MAX_EVENTS_PER_CYCLE = 2000  # the rest wait in the driver's queue for the next cycle

# nvmlEventType bits (nvml.h)
EVENT_DBE = 0x2
EVENT_XID = 0x8


class Watch:
    """An NVML event set over every GPU, kept open across cycles (NVML stays initialised)."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._set: Any = None
        self._registered: Dict[str, Any] = {}  # GPU UUID -> handle

    def _open(self) -> bool:
        if self._set is not None:
            return True
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self._set = pynvml.nvmlEventSetCreate()
        except Exception as exc:  # the library or the call may be missing: no events then
            log.debug("no NVML events: %s", exc)
            self._close()
            return False
        return True

    def _close(self) -> None:
        if self._nvml is not None:
            try:
                if self._set is not None:
                    self._nvml.nvmlEventSetFree(self._set)
                self._nvml.nvmlShutdown()
            except Exception:
                pass
        self._nvml, self._set, self._registered = None, None, {}

    def register(self, gpu_uuids: Iterable[str]) -> None:
        """Listen to the GPUs not yet registered (a GPU may come back after a reset)."""
        if not self._open():
            return
        nv = self._nvml
        for uuid in gpu_uuids:
            if uuid in self._registered:
                continue
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(uuid)
                wanted = (EVENT_XID | EVENT_DBE) & nv.nvmlDeviceGetSupportedEventTypes(handle)
                if wanted:
                    nv.nvmlDeviceRegisterEvents(handle, wanted, self._set)
                self._registered[uuid] = handle
            except nv.NVMLError as exc:
                log.debug("GPU %s: no events: %s", uuid, exc)

    def events(self, now: float) -> List[Event]:
        """The events waiting now, without waiting; at most MAX_EVENTS_PER_CYCLE."""
        if self._set is None:
            return []
        nv = self._nvml
        out: List[Event] = []
        while len(out) < MAX_EVENTS_PER_CYCLE:
            try:
                data = nv.nvmlEventSetWait_v2(self._set, 0)
            except nv.NVMLError:  # NVML_ERROR_TIMEOUT: nothing more now
                break
            uuid = self._uuid_of(data.device)
            if uuid is None:
                continue
            kind = "dbe" if data.eventType & EVENT_DBE else "xid"
            gi = data.gpuInstanceId if data.gpuInstanceId != 0xFFFFFFFF else None
            out.append(Event(uuid, kind, int(data.eventData), now, gi))
        return out

    def _uuid_of(self, device: Any) -> Optional[str]:
        import ctypes

        key = ctypes.cast(device, ctypes.c_void_p).value
        for uuid, handle in self._registered.items():
            if ctypes.cast(handle, ctypes.c_void_p).value == key:
                return uuid
        return None

    def utilization(self, uuid: str) -> Optional[int]:
        """A whole GPU's utilisation %, or None where NVML gives none (MIG mode, no driver)."""
        if not self._open():
            return None
        nv = self._nvml
        try:
            return int(nv.nvmlDeviceGetUtilizationRates(nv.nvmlDeviceGetHandleByUUID(uuid)).gpu)
        except nv.NVMLError:
            return None

    def conditions(self, gpu_uuids: Iterable[str], lost: Iterable[str]) -> Tuple[Dict[str, str], Dict[str, str]]:
        """GPU UUID -> what persists that keeps it drained; and -> notes (clock slowdowns)."""
        out = {u: "GPU is lost to the driver (fallen off the bus)" for u in lost}
        notes: Dict[str, str] = {}
        if not self._open():
            return out, notes
        nv = self._nvml
        for uuid in gpu_uuids:
            if uuid in out:
                continue
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(uuid)
            except nv.NVMLError:
                continue
            rows = _query(nv, nv.nvmlDeviceGetRemappedRows, handle)
            if rows is not None and rows[3]:
                out[uuid] = "row remapping failed (the GPU needs service)"
            elif rows is not None and rows[2]:
                out[uuid] = "row remapping pending (a GPU reset applies it)"
            reasons = _query(nv, nv.nvmlDeviceGetCurrentClocksEventReasons, handle)
            if reasons:
                slow = [w for bit, w in SLOWDOWNS if reasons & bit]
                if slow:
                    notes[uuid] = "clocks slowed: " + ", ".join(slow)
        return out, notes


# nvmlClocksEventReason bits worth telling an admin about (not a reason to drain)
SLOWDOWNS = ((0x8, "hardware slowdown"), (0x20, "software thermal slowdown"),
             (0x40, "hardware thermal slowdown"), (0x80, "power brake"))


def _query(nv: Any, call: Any, handle: Any) -> Any:
    """CALL(HANDLE), or None where the GPU or driver does not support it."""
    try:
        return call(handle)
    except (nv.NVMLError, AttributeError):
        return None
