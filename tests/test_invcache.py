"""Launches without the monitor: the shim's ctypes NVML binding and sync's device layout cache.

The binding must answer exactly as pynvml does; the cache must make launches read only
their candidates, and never hand out a device that is gone since the last sync.
"""
import json

import pytest

from cudawrap.devices import invcache, nvml
from support.installed import ready_line

TOPOLOGIES = ["four-gpus", "a100-mig7", "dgx-a100-mig56", "mixed"]


def _drop_mig(machine, uuid: str) -> None:
    """Destroy one MIG instance, as `nvidia-smi mig -dci/-dgi` would (no sync afterwards)."""
    machine._edit(lambda f: bool(f) and f[0] == ("mig", None) and ("uuid", uuid) in f)


@pytest.mark.parametrize("name", TOPOLOGIES)
@pytest.mark.parametrize("fault", [None, ("no_permission", "all")], ids=["plain", "no-permission"])
def test_the_direct_binding_enumerates_what_pynvml_does(machine, monkeypatch, name, fault):
    fake = machine(name)
    fake.activate(monkeypatch)
    uuids = fake.leaf_uuids()
    fake.add_process(4242, uuids[-1], 2048)
    if fault:
        fake.set_fault(*fault)
    assert nvml.inventory(direct=True).to_tuple() == nvml.inventory().to_tuple()


def test_the_direct_binding_reports_a_lost_gpu_as_pynvml_does(machine, monkeypatch):
    fake = machine("mixed")
    fake.activate(monkeypatch)
    fake.set_fault("gpu_lost", fake.gpu_uuids()[0])
    direct, ours = nvml.inventory(direct=True), nvml.inventory()
    assert direct.lost == ours.lost == ("index 0",)  # a lost GPU does not even say its UUID
    assert direct.to_tuple() == ours.to_tuple()


def test_sync_keeps_the_layout_without_usage(installed):
    inst = installed("a100-mig7")
    inst.machine.add_process(4242, inst.machine.leaf_uuids()[0], 2048)
    inst.sync()
    layout = invcache.read(str(inst.layout.root))
    assert layout is not None and layout.uuids() == inst.machine.leaf_uuids()
    assert all(d.pids is None and d.memory_used_mib == 0 for d in layout.devices)


def test_the_layout_matches_until_the_gpus_change_and_devices_are_read_by_uuid(installed):
    inst = installed("a100-mig7")
    layout = invcache.read(str(inst.layout.root))
    uuids = inst.machine.leaf_uuids()
    inst.machine.add_process(4242, uuids[1], 2048)
    assert nvml.matches(layout)
    nvml._handles.clear()  # as in a fresh shim: nothing enumerated
    first, second = (nvml.refresh(d) for d in layout.devices[:2])
    assert (first.uuid, first.pids, second.uuid, second.pids) == (uuids[0], (), uuids[1], (4242,))
    _drop_mig(inst.machine, uuids[0])
    nvml._handles.clear()
    assert nvml.refresh(layout.devices[0]) is None  # destroyed: never handed out
    assert nvml.refresh(layout.devices[1]) is not None
    assert nvml.matches(layout)  # the GPU count and driver still match
    grown = type(layout)(layout.driver_version, layout.gpus + layout.gpus, layout.devices)
    assert not nvml.matches(grown)
    assert not nvml.matches(type(layout)("999.0", layout.gpus, layout.devices))


def test_a_launch_without_the_monitor_reads_only_the_devices_it_tries(installed, monkeypatch):
    """56 MIG instances on 8 GPUs: NVML is asked about the devices the launch tries, not all 56,
    and started once (without persistence mode nvmlInit can take seconds)."""
    from cudawrap import launch
    from cudawrap.devices import nvmldirect
    from cudawrap.policy import effective as policy

    inst = installed("dgx-a100-mig56")
    root = str(inst.layout.root)
    uuids = inst.machine.leaf_uuids()
    parents = {d.uuid: d.parent_uuid for d in invcache.read(root).devices}
    inst.machine.add_process(4242, uuids[0], 2048)  # not cudawrap's: the first choice is occupied
    read = []
    real = nvml.refresh
    monkeypatch.setattr(nvml, "refresh", lambda device: read.append(device.uuid) or real(device))
    monkeypatch.setattr(nvml, "inventory", None)  # an enumeration would fail the test
    inits = []
    real_init = nvmldirect.nvmlInit
    monkeypatch.setattr(nvmldirect, "nvmlInit", lambda: inits.append(1) or real_init())
    nvml._handles.clear()
    nvml._direct_ready.clear()  # as in a fresh shim
    grant = launch.obtain(root, "recon", policy.effective(root, None, environ={}), {})
    try:
        assert grant.lease.uuids != [uuids[0]]
        # spread: the occupied instance counts against its GPU, so the next try is on another
        assert read == [uuids[0]] + grant.lease.uuids
        assert parents[grant.lease.uuids[0]] != parents[uuids[0]]
        assert len(inits) == 1
    finally:
        grant.lease.release()


def test_simultaneous_launches_without_waiting_all_get_a_device_on_a_dgx(installed):
    """Each launch probes the locks of all 56 instances to spread; a probe must not make the
    others, deciding at the same moment, see the free devices taken (CUDAWRAP_WAIT=0 fails)."""
    inst = installed("dgx-a100-mig56")
    inst.wrap("recon")
    procs = [inst.start("recon", "--hold", "3", CUDAWRAP_WAIT="0") for _ in range(24)]
    try:
        lines = [ready_line(p) for p in procs]
        devices = [line["cvd"] for line in lines]
        assert len(set(devices)) == len(devices) == 24
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_gpu_lost_at_sync_leaves_no_cache(installed):
    inst = installed("mixed")
    assert inst.layout.inventory_cache.exists()
    inst.machine.set_fault("gpu_lost", inst.machine.gpu_uuids()[0])
    inst.sync()
    assert not inst.layout.inventory_cache.exists()


def test_a_cache_not_written_by_root_is_ignored(installed):
    inst = installed("a100-mig7")
    inst.layout.inventory_cache.chmod(0o666)  # anyone could have written it
    assert invcache.read(str(inst.layout.root)) is None


def test_a_launch_avoids_foreign_processes_from_the_cache(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    uuids = inst.machine.leaf_uuids()
    inst.machine.add_process(4242, uuids[0], 2048)
    r = inst.run("recon")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["cvd"] in uuids[1:]


def test_a_stale_cache_never_hands_out_a_destroyed_instance(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    uuids = inst.machine.leaf_uuids()
    holders = [inst.start("recon", "--hold", "30", CUDA_VISIBLE_DEVICES=u) for u in uuids[:-1]]
    try:
        for proc in holders:
            ready_line(proc)
        # The last instance is destroyed; its lease file stays until the next sync, and
        # the cache still lists it.
        _drop_mig(inst.machine, uuids[-1])
        r = inst.run("recon", CUDAWRAP_WAIT="0")
        assert r.returncode == 75, r.stderr
        assert b"no free device" in r.stderr
    finally:
        for proc in holders:
            proc.kill()
            proc.wait()
