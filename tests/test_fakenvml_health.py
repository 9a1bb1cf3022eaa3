"""The stand-in's events, remapped rows and clock reasons, through the real pynvml."""
import threading
import time
from typing import Any

import pytest

from test_fakenvml import nvml  # noqa: F401  # the fixture: a machine, NVML initialised

pynvml = pytest.importorskip("pynvml")

XID_DBE = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError


def handles() -> list:
    return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]


def test_supported_events_are_an_h200s_and_a_mig_handle_has_none(nvml: Any) -> None:
    nvml("a100-mig7")
    gpu = handles()[0]
    assert pynvml.nvmlDeviceGetSupportedEventTypes(gpu) == 65439
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetSupportedEventTypes(mig)


def test_an_injected_xid_reaches_the_sets_registered_for_it_once(nvml: Any) -> None:
    fake = nvml("four-gpus")
    gpus = handles()
    uuids = fake.gpu_uuids()
    both, one = pynvml.nvmlEventSetCreate(), pynvml.nvmlEventSetCreate()
    for h in gpus:
        pynvml.nvmlDeviceRegisterEvents(h, XID_DBE, both)
    pynvml.nvmlDeviceRegisterEvents(gpus[0], pynvml.nvmlEventTypeXidCriticalError, one)
    fake.inject_event(uuids[2], "xid", 79)
    fake.inject_event(uuids[0], "dbe", 0)
    first = pynvml.nvmlEventSetWait_v2(both, 1000)
    assert pynvml.nvmlDeviceGetUUID(first.device) == uuids[2]
    assert (first.eventType, first.eventData) == (pynvml.nvmlEventTypeXidCriticalError, 79)
    second = pynvml.nvmlEventSetWait_v2(both, 1000)
    assert pynvml.nvmlDeviceGetUUID(second.device) == uuids[0]
    assert second.eventType == pynvml.nvmlEventTypeDoubleBitEccError
    # ONE registered GPU 0 for XIDs only: neither event is for it.
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(one, 0)
    with pytest.raises(pynvml.NVMLError_Timeout):  # each event once
        pynvml.nvmlEventSetWait_v2(both, 0)
    pynvml.nvmlEventSetFree(both)
    pynvml.nvmlEventSetFree(one)


def test_wait_times_out_after_the_given_time_and_wakes_for_a_late_event(nvml: Any) -> None:
    fake = nvml("four-gpus")
    events = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handles()[1], XID_DBE, events)
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(events, 200)
    assert time.monotonic() - started >= 0.2  # it waited, as the real call does
    threading.Timer(0.1, fake.inject_event, (fake.gpu_uuids()[1], "xid", 48)).start()
    got = pynvml.nvmlEventSetWait_v2(events, 10000)
    assert got.eventData == 48
    pynvml.nvmlEventSetFree(events)


def test_an_event_in_a_mig_instance_comes_on_its_gpu_with_the_instance_ids(nvml: Any) -> None:
    fake = nvml("a100-mig7")
    gpu = handles()[0]
    events = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(gpu, XID_DBE, events)
    mig = fake.leaf_uuids()[3]
    fake.inject_event(mig, "xid", 94)
    got = pynvml.nvmlEventSetWait_v2(events, 1000)
    assert pynvml.nvmlDeviceGetUUID(got.device) == fake.gpu_uuids()[0]
    assert (got.gpuInstanceId, got.computeInstanceId) == (10, 0)
    pynvml.nvmlEventSetFree(events)


def test_events_before_the_set_existed_are_not_delivered(nvml: Any) -> None:
    fake = nvml("four-gpus")
    fake.inject_event(fake.gpu_uuids()[0], "xid", 79)
    events = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handles()[0], XID_DBE, events)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(events, 0)
    pynvml.nvmlEventSetFree(events)


def test_remapped_rows_and_clock_reasons_come_from_the_health_line(nvml: Any) -> None:
    fake = nvml("four-gpus")
    uuid = fake.gpu_uuids()[1]
    assert pynvml.nvmlDeviceGetRemappedRows(handles()[1]) == (0, 0, 0, 0)
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handles()[1]) == 1  # idle, as an H200 said
    fake.set_health(uuid, remapped_unc=2, remap_pending=1, clocks_event_reasons=0x40)
    assert pynvml.nvmlDeviceGetRemappedRows(handles()[1]) == (0, 2, 1, 0)
    assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(handles()[1]) == 0x40
    assert pynvml.nvmlDeviceGetRemappedRows(handles()[0]) == (0, 0, 0, 0)
    fake.set_health(uuid)
    assert pynvml.nvmlDeviceGetRemappedRows(handles()[1]) == (0, 0, 0, 0)


def test_a_bad_health_line_makes_the_topology_invalid(nvml: Any) -> None:
    fake = nvml("four-gpus")
    fake.write(fake.read() + "health uuid=GPU-nope remap_pending=1\n")
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetCount()


def test_a_lost_gpu_answers_events_and_rows_with_gpu_is_lost(nvml: Any) -> None:
    fake = nvml("four-gpus")
    h = handles()[2]
    fake.set_fault("gpu_lost", fake.gpu_uuids()[2])
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetRemappedRows(h)
    events = pynvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceRegisterEvents(h, XID_DBE, events)
    pynvml.nvmlEventSetFree(events)
