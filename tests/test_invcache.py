"""Launches without the monitor: the shim's ctypes NVML binding and sync's device layout cache.

The binding must answer exactly as pynvml does; the cache must make launches read only
their candidates, and never hand out a device that is gone since the last sync.
"""
import json

import pytest

from cudawrap import invcache, nvml
from corefix import ready_line

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


def test_current_reads_candidates_and_notices_a_destroyed_instance(installed):
    inst = installed("a100-mig7")
    layout = invcache.read(str(inst.layout.root))
    uuids = inst.machine.leaf_uuids()
    inst.machine.add_process(4242, uuids[1], 2048)
    live = nvml.current(layout, list(layout.devices[:2]))
    assert [d.uuid for d in live] == uuids[:2]
    assert live[0].pids == () and live[1].pids == (4242,)
    assert live[1].memory_used_mib is None  # not needed where the process list is known
    _drop_mig(inst.machine, uuids[0])
    assert nvml.current(layout, list(layout.devices[:2])) is None
    assert nvml.current(layout, list(layout.devices[1:2])) is not None  # only candidates are read


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
