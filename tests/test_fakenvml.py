"""The fake NVML library, seen through the real pynvml (and nvitop): is the double faithful?"""
import ctypes
import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest

from support import fakecuda
from support.machine import FAKECUDA, LIBNAME, FakeMachine, shutdown_nvml
from support.procs import wait_for

pynvml = pytest.importorskip("pynvml")

MIB = 1 << 20
READY = ["four-gpus", "a100-mig7", "dgx-a100-mig56", "mixed"]


@pytest.fixture
def nvml(machine: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``nvml("mixed")``: that machine, active in this process, NVML initialised."""

    def start(name: str) -> FakeMachine:
        fake = machine(name)
        fake.activate(monkeypatch)
        pynvml.nvmlInit()
        return fake

    return start


def walk() -> List[Dict[str, Any]]:
    """Everything pynvml reports about the GPUs and their MIG devices, as plain data."""
    gpus = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        mode = pynvml.nvmlDeviceGetMigMode(handle)[0]
        instances = []
        if mode == pynvml.NVML_DEVICE_MIG_ENABLE:
            for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
                try:
                    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
                except pynvml.NVMLError_NotFound:
                    continue
                parent = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
                instances.append(
                    dict(
                        slot=slot,
                        uuid=pynvml.nvmlDeviceGetUUID(mig),
                        name=pynvml.nvmlDeviceGetName(mig),
                        gi=pynvml.nvmlDeviceGetGpuInstanceId(mig),
                        ci=pynvml.nvmlDeviceGetComputeInstanceId(mig),
                        total=pynvml.nvmlDeviceGetMemoryInfo(mig).total,
                        is_mig=bool(pynvml.nvmlDeviceIsMigDeviceHandle(mig).value),
                        parent_index=pynvml.nvmlDeviceGetIndex(parent),
                    )
                )
        gpus.append(
            dict(
                index=pynvml.nvmlDeviceGetIndex(handle),
                uuid=pynvml.nvmlDeviceGetUUID(handle),
                name=pynvml.nvmlDeviceGetName(handle),
                bus_id=pynvml.nvmlDeviceGetPciInfo(handle).busId,
                total=pynvml.nvmlDeviceGetMemoryInfo(handle).total,
                mig=mode,
                instances=instances,
            )
        )
    return gpus


def leaves(gpus: List[Dict[str, Any]]) -> List[str]:
    out: List[str] = []
    for gpu in gpus:
        out.extend([m["uuid"] for m in gpu["instances"]] if gpu["mig"] else [gpu["uuid"]])
    return out


def nvml_bus_id(pci: str) -> str:
    domain, bus, rest = pci.split(":")
    device, function = rest.split(".")
    return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{int(function, 16)}"


def processes(uuid: str) -> List[Tuple[int, int, int, int]]:
    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    return sorted(
        (p.pid, p.usedGpuMemory // MIB, p.gpuInstanceId, p.computeInstanceId)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    )


def used_mib(uuid: str) -> int:
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid)).used // MIB


@pytest.fixture
def stand_ins() -> Iterator[Any]:
    """Starts fakecuda.py holding devices; every one still running is killed afterwards."""
    started: List[subprocess.Popen] = []

    def start(fake: FakeMachine, cvd: Optional[str], *args: str) -> Tuple[subprocess.Popen, Dict[str, Any]]:
        env = fake.environ(CUDA_VISIBLE_DEVICES=cvd)
        proc = subprocess.Popen(
            [sys.executable, str(FAKECUDA), "--hold", "60", *args],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        return proc, json.loads(proc.stdout.readline())

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout:
            proc.stdout.close()



# ---- enumeration -----------------------------------------------------------


@pytest.mark.parametrize("name", READY)
def test_enumerates_every_gpu_and_mig_device_of_ready_topologies(nvml: Any, name: str) -> None:
    fake = nvml(name)
    topo = fake.parse()

    gpus = walk()

    assert [g["uuid"] for g in gpus] == fake.gpu_uuids()
    for gpu, want in zip(gpus, topo.gpus):
        assert gpu["name"] == want.name
        assert gpu["bus_id"] == nvml_bus_id(want.pci)
        assert gpu["total"] == want.memory_mib * MIB
        assert gpu["mig"] == (1 if want.mig == "on" else 0)
        assert [(m["slot"], m["uuid"], m["gi"], m["ci"]) for m in gpu["instances"]] == [
            (w.slot, w.uuid, w.gi, w.ci) for w in want.instances
        ]
        for mig, w in zip(gpu["instances"], want.instances):
            assert mig["name"] == f"{want.name} MIG {w.profile}"
            assert mig["total"] == w.memory_mib * MIB
            assert mig["is_mig"] and mig["parent_index"] == gpu["index"]
    assert leaves(gpus) == fake.leaf_uuids()
    for uuid in fake.leaf_uuids() + fake.gpu_uuids():
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == uuid


def test_ready_topologies_have_the_documented_shape(nvml: Any) -> None:
    # Fixed facts, so a shared mistake in both parsers cannot pass the test above.
    nvml("a100-mig7")
    (a100,) = walk()
    assert a100["name"] == "NVIDIA A100-SXM4-80GB" and a100["bus_id"] == "00000000:07:00.0"
    assert [m["name"] for m in a100["instances"]] == ["NVIDIA A100-SXM4-80GB MIG 1g.10gb"] * 7
    assert {m["total"] for m in a100["instances"]} == {9728 * MIB}
    assert pynvml.nvmlSystemGetDriverVersion() == "550.54.15"
    assert pynvml.nvmlSystemGetCudaDriverVersion() == 12040
    assert pynvml.nvmlSystemGetNVMLVersion() == "12.550.54.15"

    nvml("dgx-a100-mig56")
    dgx = walk()
    assert len(dgx) == 8 and len(leaves(dgx)) == 56 and len(set(leaves(dgx))) == 56

    nvml("mixed")
    mixed = walk()
    assert [g["mig"] for g in mixed] == [0, 0, 1, 1]
    assert [m["slot"] for m in mixed[2]["instances"]] == [0, 2, 4]
    assert mixed[3]["instances"] == []
    assert len(leaves(mixed)) == 5

    nvml("four-gpus")
    four = walk()
    assert four[0]["uuid"] == "GPU-5e7f6c2a-9b1d-4c3e-8f2a-1d3b5c7e9f01"
    assert all(not g["instances"] for g in four)


# ---- processes ---------------------------------------------------------------


def test_reports_foreign_and_live_processes_and_aggregates_them_on_the_mig_parent(nvml: Any, stand_ins: Any) -> None:
    fake = nvml("a100-mig7")
    (parent,) = fake.gpu_uuids()
    migs = fake.leaf_uuids()
    fake.add_process(4242, migs[1], memory_mib=1024)

    proc, hello = stand_ins(fake, migs[3], "--mem", "700", "--context", "0")

    assert hello["devices"] == [migs[3]]
    assert processes(migs[1]) == [(4242, 1024, 8, 0)]
    assert processes(migs[3]) == [(proc.pid, 700, 10, 0)]
    assert processes(migs[0]) == []
    assert processes(parent) == sorted([(4242, 1024, 8, 0), (proc.pid, 700, 10, 0)])
    assert used_mib(migs[3]) == 700
    assert used_mib(parent) == 1724
    assert fake.compute_pids()[parent] == [4242, proc.pid]
    assert fake.compute_pids()[migs[3]] == [proc.pid]


def test_whole_gpu_processes_have_no_instance_ids(nvml: Any, stand_ins: Any) -> None:
    fake = nvml("mixed")
    h100 = fake.gpu_uuids()[1]

    proc, _ = stand_ins(fake, "1", "--mem", "2048", "--context", "0")

    na = pynvml.NVML_VALUE_NOT_AVAILABLE_uint.value
    assert processes(h100) == [(proc.pid, 2048, na, na)]
    memory = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(h100), version=pynvml.nvmlMemory_v2)
    assert memory.used == 2048 * MIB and memory.free == memory.total - 2048 * MIB


def test_a_killed_stand_in_disappears_although_its_file_stays(nvml: Any, stand_ins: Any) -> None:
    fake = nvml("four-gpus")
    gpu = fake.gpu_uuids()[2]
    proc, _ = stand_ins(fake, "2")
    assert [p[0] for p in processes(gpu)] == [proc.pid]

    proc.kill()  # no chance to clean up; not reaped yet, so a zombie for a while

    wait_for(lambda: processes(gpu) == [], 5.0)
    assert (fake.procs_dir / str(proc.pid)).exists()
    assert fake.compute_pids()[gpu] == []
    proc.wait()
    assert processes(gpu) == []


def test_registrations_on_devices_that_went_away_are_ignored(nvml: Any, stand_ins: Any) -> None:
    fake = nvml("a100-mig7")
    migs = fake.leaf_uuids()
    proc, _ = stand_ins(fake, migs[6])
    assert [p[0] for p in processes(migs[6])] == [proc.pid]

    fake.write("\n".join(line for line in fake.read().splitlines() if migs[6] not in line) + "\n")

    assert processes(fake.gpu_uuids()[0]) == []


# ---- protocol details --------------------------------------------------------


class ProcessInfoV1(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class ProcessInfo(ctypes.Structure):
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


def raw_library(fake: FakeMachine) -> ctypes.CDLL:
    # A CDLL object of our own, so argtypes set here touch nobody else's.
    lib = ctypes.CDLL(str(fake.lib_dir / LIBNAME))
    lib.nvmlDeviceGetHandleByIndex_v2.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
    for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v3"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
    lib.nvmlDeviceGetCount_v2.argtypes = [ctypes.c_void_p]
    lib.nvmlDeviceGetMemoryInfo.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    return lib


def test_process_list_follows_the_insufficient_size_protocol(nvml: Any) -> None:
    fake = nvml("four-gpus")
    fake.add_process(111, fake.gpu_uuids()[0], 100)
    fake.add_process(222, fake.gpu_uuids()[0], 200)
    lib = raw_library(fake)
    handle = ctypes.c_void_p()
    assert lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == pynvml.NVML_SUCCESS
    fn = lib.nvmlDeviceGetComputeRunningProcesses_v3
    count = ctypes.c_uint(0)

    assert fn(handle, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 2
    one = (ProcessInfo * 1)()
    count.value = 1
    assert fn(handle, ctypes.byref(count), one) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert count.value == 2
    five = (ProcessInfo * 5)()
    count.value = 5
    assert fn(handle, ctypes.byref(count), five) == pynvml.NVML_SUCCESS
    assert count.value == 2 and [five[0].pid, five[1].pid] == [111, 222]
    assert fn(handle, None, five) == pynvml.NVML_ERROR_INVALID_ARGUMENT

    # The unversioned entry point keeps the old 16-byte layout.
    old = (ProcessInfoV1 * 5)()
    count.value = 5
    assert lib.nvmlDeviceGetComputeRunningProcesses(handle, ctypes.byref(count), old) == pynvml.NVML_SUCCESS
    assert [(old[i].pid, old[i].usedGpuMemory) for i in range(2)] == [(111, 100 * MIB), (222, 200 * MIB)]

    count.value = 0
    assert lib.nvmlDeviceGetHandleByIndex_v2(1, ctypes.byref(handle)) == pynvml.NVML_SUCCESS
    assert fn(handle, ctypes.byref(count), None) == pynvml.NVML_SUCCESS and count.value == 0


def test_null_pointers_and_bad_handles_are_invalid_arguments(nvml: Any) -> None:
    fake = nvml("four-gpus")
    lib = raw_library(fake)

    assert lib.nvmlDeviceGetCount_v2(None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    bogus = ctypes.c_void_p(id(lib))
    assert lib.nvmlDeviceGetMemoryInfo(bogus, None) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(4)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")


def test_init_is_reference_counted(machine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    machine("four-gpus").activate(monkeypatch)
    shutdown_nvml()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()

    pynvml.nvmlInit()
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 4
    pynvml.nvmlShutdown()

    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlShutdown()


def test_memory_info_v2_checks_the_struct_version(nvml: Any) -> None:
    nvml("four-gpus")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        pynvml.nvmlDeviceGetMemoryInfo(handle, version=0x01000028)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).total == 40960 * MIB


def test_absent_functions_are_not_found_as_with_an_old_driver(nvml: Any) -> None:
    nvml("four-gpus")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetFanSpeed(handle)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)


# ---- faults ----------------------------------------------------------------------


def test_driver_not_loaded(machine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = machine("four-gpus")
    fake.set_fault("driver_not_loaded")
    fake.activate(monkeypatch)

    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_slow_init_delays_init_only(machine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = machine("four-gpus")
    fake.set_fault("slow_init", "300")
    fake.activate(monkeypatch)

    start = time.monotonic()
    pynvml.nvmlInit()
    assert time.monotonic() - start >= 0.3
    # Were queries delayed too, this one would take ten minutes: it returns at all, at once.
    fake.set_fault("slow_init", "600000")
    counted = []
    query = threading.Thread(target=lambda: counted.append(pynvml.nvmlDeviceGetCount()), daemon=True)
    query.start()
    query.join(timeout=120)
    assert counted == [4]


@pytest.mark.parametrize(
    ("scope", "instance_denied"),
    [("", False), ("parent", False), ("all", True)],
    ids=["default-scope", "parent", "all"],
)
def test_no_permission_on_process_queries(nvml: Any, scope: str, instance_denied: bool) -> None:
    fake = nvml("mixed")
    whole, _, parent, _ = fake.gpu_uuids()
    instance = fake.leaf_uuids()[2]

    fake.set_fault("no_permission", scope)

    with pytest.raises(pynvml.NVMLError_NoPermission):
        processes(parent)
    if instance_denied:
        with pytest.raises(pynvml.NVMLError_NoPermission):
            processes(instance)
    else:
        assert processes(instance) == []
    assert processes(whole) == []
    fake.clear_fault("no_permission")
    assert processes(parent) == []


def test_utilization_is_not_supported_on_mig_devices(nvml: Any) -> None:
    fake = nvml("mixed")
    whole, _, parent, _ = fake.gpu_uuids()
    instance = fake.leaf_uuids()[2]

    for uuid in (instance, parent):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByUUID(uuid))
    assert pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByUUID(whole)).gpu == 0

    fake.set_fault("utilization_not_supported", "all")

    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByUUID(whole))


def test_gpu_lost_mid_run(nvml: Any) -> None:
    fake = nvml("a100-mig7")
    (gpu,) = fake.gpu_uuids()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 2)

    fake.set_fault("gpu_lost", gpu)

    for query in (
        lambda: pynvml.nvmlDeviceGetMemoryInfo(handle),
        lambda: pynvml.nvmlDeviceGetUUID(handle),
        lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(mig),
        lambda: pynvml.nvmlDeviceGetMemoryInfo(mig),
        lambda: pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0),
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            query()
    assert pynvml.nvmlDeviceGetCount() == 1
    fake.clear_fault("gpu_lost")
    assert pynvml.nvmlDeviceGetMemoryInfo(mig).total == 9728 * MIB


def test_lost_gpu_leaves_the_others_alone(nvml: Any) -> None:
    fake = nvml("four-gpus")
    fake.set_fault("gpu_lost", fake.gpu_uuids()[1])

    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(1))
    assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(2)) == fake.gpu_uuids()[2]


def test_malformed_topology_fails_init_with_a_reason_on_stderr(machine: Any) -> None:
    fake = machine("four-gpus")
    fake.write("driver 550.54.15\ngpu uuid=GPU-1 name=\"x\" memory_mib=lots\n")
    script = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError_Unknown:\n    print('unknown')\n"

    done = subprocess.run([sys.executable, "-c", script], env=fake.environ(), capture_output=True, text=True)

    assert done.stdout.strip() == "unknown"
    assert "fakenvml:" in done.stderr and ":2: gpu: memory_mib" in done.stderr


def test_library_missing(machine: Any) -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("a real libnvidia-ml is installed, it cannot be made to go missing")
    fake = machine("four-gpus")
    script = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError_LibraryNotFound:\n    print('missing')\n"

    done = subprocess.run([sys.executable, "-c", script], env=fake.without_library(), capture_output=True, text=True)

    assert done.stdout.strip() == "missing"
    with_lib = subprocess.run([sys.executable, "-c", script], env=fake.environ(), capture_output=True, text=True)
    assert with_lib.returncode == 0 and with_lib.stdout == ""


# ---- a machine that changes ---------------------------------------------------


def test_a_running_process_sees_the_topology_change(nvml: Any) -> None:
    fake = nvml("four-gpus")
    first = pynvml.nvmlDeviceGetHandleByIndex(0)
    last = pynvml.nvmlDeviceGetHandleByIndex(3)
    assert pynvml.nvmlDeviceGetName(first) == "NVIDIA A100-PCIE-40GB"

    fake.load("mixed")

    assert pynvml.nvmlDeviceGetCount() == 4
    assert pynvml.nvmlDeviceGetName(first) == "NVIDIA H100 80GB HBM3"
    fake.load("a100-mig7")
    assert pynvml.nvmlDeviceGetCount() == 1
    assert pynvml.nvmlDeviceGetMigMode(first)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetName(last)


def test_handles_survive_rewrites_and_destroyed_instances_invalidate_theirs(nvml: Any) -> None:
    fake = nvml("a100-mig7")
    parent = pynvml.nvmlDeviceGetHandleByIndex(0)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 4)
    uuid = pynvml.nvmlDeviceGetUUID(mig)

    fake.add_process(77, uuid, 64)

    assert pynvml.nvmlDeviceGetUUID(mig) == uuid
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(mig)] == [77]
    fake.remove_process(77)
    fake.write("\n".join(line for line in fake.read().splitlines() if uuid not in line) + "\n")
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetUUID(mig)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 4)


def test_switching_machines_in_one_process(machine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = machine("four-gpus"), machine("dgx-a100-mig56")
    first.activate(monkeypatch)
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 4

    second.activate(monkeypatch)

    assert pynvml.nvmlDeviceGetCount() == 8
    assert os.environ["FAKENVML_TOPOLOGY"] == str(second.topology)


# ---- fidelity: an unmodified third-party NVML client ---------------------------

NVISEL = shutil.which("nvisel", path=os.path.dirname(sys.executable)) or shutil.which("nvisel")
needs_nvisel = pytest.mark.skipif(NVISEL is None, reason="nvitop is not installed (no nvisel next to the interpreter)")


def nvisel(fake: FakeMachine, *args: str) -> List[str]:
    assert NVISEL is not None
    # nvisel logs every NVML function the fake leaves out to stderr; only stdout matters.
    done = subprocess.run(
        [NVISEL, "--format", "uuid", "--newline", *args],
        env=fake.environ(CUDA_VISIBLE_DEVICES=None),
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.split()


def nvitop_leaves(fake: FakeMachine) -> List[str]:
    script = "from nvitop import Device\nfor d in Device.all():\n    for leaf in d.to_leaf_devices():\n        print(leaf.uuid())\n"
    done = subprocess.run([sys.executable, "-c", script], env=fake.environ(), capture_output=True, text=True, check=True)
    return done.stdout.split()


@needs_nvisel
@pytest.mark.parametrize("name", READY)
def test_nvisel_lists_the_devices_pynvml_lists(nvml: Any, name: str) -> None:
    fake = nvml(name)
    expected = leaves(walk())
    whole = [u for u in expected if u.startswith("GPU-")]

    # nvisel offers the whole GPUs when there are any, else a single MIG device.
    assert nvisel(fake, "--no-sort") == (whole or expected[:1])


@needs_nvisel
@pytest.mark.parametrize("name", ["four-gpus", "a100-mig7", "dgx-a100-mig56"])
def test_nvitop_lists_every_leaf_device_pynvml_lists(nvml: Any, name: str) -> None:
    # Not mixed.topo: nvitop stops enumerating MIG devices at the first empty
    # index, so it sees one of the three instances placed at slots 0, 2 and 4.
    fake = nvml(name)

    assert nvitop_leaves(fake) == leaves(walk())


@needs_nvisel
def test_nvisel_ranks_whole_gpus_by_the_memory_pynvml_reports(nvml: Any) -> None:
    fake = nvml("four-gpus")
    g = fake.gpu_uuids()
    fake.add_process(5001, g[0], 1000)
    fake.add_process(5002, g[2], 3000)
    free = {u: pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(u)).free for u in g}
    # nvisel: most free memory first, ties to the higher index (keeps GPU 0 free).
    expected = sorted(g, key=lambda u: (-free[u], -g.index(u)))
    assert expected == [g[3], g[1], g[0], g[2]]

    assert nvisel(fake) == expected
    assert nvisel(fake, "--min-free-memory", "39GiB") == [u for u in expected if free[u] >= 39 * 1024 * MIB]


@needs_nvisel
def test_nvisel_picks_the_one_idle_mig_device(nvml: Any) -> None:
    fake = nvml("a100-mig7")
    migs = fake.leaf_uuids()
    for slot, uuid in enumerate(migs):
        if slot != 3:
            fake.add_process(6000 + slot, uuid, 2048)

    assert nvisel(fake) == [migs[3]]
    assert [used_mib(u) for u in migs] == [2048, 2048, 2048, 0, 2048, 2048, 2048]


def test_topology_parsers_agree_on_unusual_spellings(nvml: Any) -> None:
    fake = nvml("four-gpus")
    text = (
        "# comment\n"
        "driver 535.1   # trailing comment\n"
        "cuda 12020\n"
        'gpu uuid=GPU-aaaaaaaa-0000-0000-0000-000000000001 name="Tesla # V100" memory_mib=16384 mig=unsupported\n'
        "\tgpu   uuid=GPU-aaaaaaaa-0000-0000-0000-000000000002 name=Plain memory_mib=1 pci=00000001:AB:1F.3\r\n"
    )

    fake.write(text)

    gpus = walk_tolerant()
    assert [g[:2] for g in gpus] == [(g.uuid, g.name) for g in fakecuda.parse_topology(text).gpus]
    assert gpus[0][1] == "Tesla # V100"
    assert gpus[1][2] == "00000001:AB:1F.3"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByIndex(0))


def walk_tolerant() -> List[Tuple[str, str, str]]:
    out = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        out.append(
            (
                pynvml.nvmlDeviceGetUUID(handle),
                pynvml.nvmlDeviceGetName(handle),
                pynvml.nvmlDeviceGetPciInfo(handle).busId,
            )
        )
    return out


@pytest.mark.parametrize(
    "line",
    [
        "gpu uuid=GPU-x name=\"unterminated memory_mib=1",
        "gpu uuid=GPU-x name=x memory_mib=1 colour=red",
        "gpu uuid=GPU-x name=x memory_mib=1 memory_mib=2",
        "gpu uuid=NOT-A-GPU name=x memory_mib=1",
        "mig parent=GPU-nowhere slot=0 uuid=MIG-x profile=1g.5gb gi=1 ci=0 memory_mib=1",
        "process pid=1 device=GPU-nowhere memory_mib=1",
        "fault gpu_lost GPU-nowhere",
        "fault bogus",
        "frobnicate",
        "gpu " + "x=y " * 40,
    ],
    ids=["quote", "unknown-field", "repeated-field", "bad-uuid", "orphan-mig", "orphan-process",
         "lost-unknown", "unknown-fault", "unknown-keyword", "too-many-fields"],
)
def test_malformed_lines_are_unknown_errors_not_crashes(nvml: Any, line: str) -> None:
    fake = nvml("four-gpus")

    fake.write("driver 550.54.15\n" + line + "\n")

    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetCount()
    fake.load("four-gpus")
    assert pynvml.nvmlDeviceGetCount() == 4


# ---- what calls cost ----------------------------------------------------------

# Each call of the library timed from Python through ctypes, in a fresh process.
COSTS = r"""
import ctypes, json, time
lib = ctypes.CDLL("libnvidia-ml.so.1")
out, byref = {}, ctypes.byref
def timed(name, *calls):
    start = time.perf_counter()
    out[name + "_rc"] = [f(*a) for f, *a in calls]
    out[name] = (time.perf_counter() - start) * 1000
n, h, h2, count = ctypes.c_uint(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_uint(0)
uuid, mem = ctypes.create_string_buffer(96), (ctypes.c_ulonglong * 3)()
timed("init", (lib.nvmlInit_v2,))
timed("attach", (lib.nvmlDeviceGetCount_v2, byref(n)), (lib.nvmlDeviceGetHandleByIndex_v2, 0, byref(h)))
timed("uuid", (lib.nvmlDeviceGetUUID, h, uuid, 96))
timed("memory", (lib.nvmlDeviceGetMemoryInfo, h, mem))
timed("procs", (lib.nvmlDeviceGetComputeRunningProcesses_v3, h, byref(count), None))
timed("by_uuid", (lib.nvmlDeviceGetHandleByUUID, uuid, byref(h2)))
timed("shutdown", (lib.nvmlShutdown,))
print(json.dumps(out))
"""
H200_MS = {"init": 9.8, "attach": 6.0, "uuid": 0.09, "memory": 0.05, "procs": 0.3, "by_uuid": 0.01, "shutdown": 2.4}


def call_costs(fake: FakeMachine, timing: Optional[str]) -> Dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", COSTS], env=fake.environ(FAKENVML_TIMING=timing),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_calls_cost_what_they_cost_on_an_h200_by_default(machine: Any) -> None:
    """The suite's machines answer at once; a machine left as it comes (the benchmarks')
    pays the H200's costs: each call takes at least that long."""
    fake = machine("four-gpus")
    costs = call_costs(fake, None)  # FAKENVML_TIMING unset: the defaults
    for name, ms in H200_MS.items():
        assert all(rc == 0 for rc in costs[name + "_rc"]), (name, costs)
        assert costs[name] >= ms, (name, costs[name])
    assert fakecuda.TIMING_H200.items() >= H200_MS.items()  # one table for the library and the stand-in
    costs = call_costs(fake, "none,init=40,procs=25")  # "none", then one cost each
    assert costs["init"] >= 40 and costs["procs"] >= 25


def test_persistence_off_makes_init_bring_up_a_gpu_nobody_keeps_initialised(machine: Any, stand_ins: Any) -> None:
    fake = machine("four-gpus")
    gpu = fake.gpu_uuids()[0]
    fake.write(fake.read().replace(f"uuid={gpu} ", f"uuid={gpu} persistence=off "))
    # Nobody holds it: init pays the GPU's bring-up.
    assert call_costs(fake, "none,cold=300")["init"] >= 300
    # Were it paid with a client there, the next two inits would take ten minutes: they return at all.
    hold = "import ctypes, sys; lib = ctypes.CDLL('libnvidia-ml.so.1'); print(lib.nvmlInit_v2(), flush=True); sys.stdin.read()"
    client = subprocess.Popen([sys.executable, "-c", hold], env=fake.environ(FAKENVML_TIMING="none"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "0"
        assert (fake.state_dir / "clients" / str(client.pid)).exists()
        assert call_costs(fake, "none,cold=600000")["init_rc"] == [0]  # another NVML client keeps it up
    finally:
        client.stdin.close()
        client.wait()
    stand_ins(fake, gpu)
    assert call_costs(fake, "none,cold=600000")["init_rc"] == [0]  # so does a CUDA program on it


def test_init_refuses_a_bad_timing_setting_with_a_reason(machine: Any) -> None:
    fake = machine("four-gpus")
    script = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError_Unknown:\n    print('unknown')\n"
    done = subprocess.run([sys.executable, "-c", script], env=fake.environ(FAKENVML_TIMING="init=fast"),
                          capture_output=True, text=True)
    assert done.stdout.strip() == "unknown"
    assert done.stderr.startswith("fakenvml: FAKENVML_TIMING: 'init=...' is not none or KEY=MS"), done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_a_stand_in_is_listed_once_its_context_exists_and_leaves_the_list_before_it_exits(nvml: Any) -> None:
    fake = nvml("four-gpus")
    gpu = fake.gpu_uuids()[0]
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(FAKECUDA), "--hold", "0.2"], stdout=subprocess.PIPE, text=True,
                            env=fake.environ(CUDA_VISIBLE_DEVICES=gpu, FAKENVML_TIMING="none,context=300,leave=2000"))
    try:
        ready = json.loads(proc.stdout.readline())
        # Registered (and ready) 300 ms after its code began to run.
        assert time.monotonic() - started >= 0.3
        assert [p[0] for p in processes(gpu)] == [ready["pid"]]
        wait_for(lambda: processes(gpu) == [], 5.0)
        assert proc.poll() is None  # out of NVML's list, not yet exited
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
