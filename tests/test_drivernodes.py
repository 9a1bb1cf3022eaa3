"""A device's own nodes: the minor NVML gives its GPU, the capability minors the driver publishes."""
import subprocess
import sys
from pathlib import Path

import pytest

from cudawrap.base.devrule import GPU_MAJOR
from cudawrap.devices import drivernodes, nvml

MIXED_A100 = "GPU-bde3bf90-ca3c-7699-1937-d67ff571e21c"
MIXED_MIG_GI5 = "MIG-f98ecd62-a044-f4c6-9072-6beac2d7c12e"


def test_nvml_gives_each_gpu_its_node_minor_and_each_mig_instance_its_parents_and_ids(machine, monkeypatch):
    fake = machine("mixed")
    # The driver numbered the nodes in another order than NVML's index (as it may).
    fake.write(fake.read().replace("pci=0000:18:00.0", "pci=0000:18:00.0 minor=7")
               .replace("pci=0000:3A:00.0", "pci=0000:3A:00.0 minor=9"))
    fake.activate(monkeypatch)
    gpus = fake.gpu_uuids()
    assert nvml.node_ids(gpus[0]) == (7, None, None)
    assert nvml.node_ids(gpus[1]) == (1, None, None)  # by default, its index
    assert nvml.node_ids(MIXED_MIG_GI5) == (9, 5, 0)
    assert nvml.node_ids("GPU-00000000-0000-0000-0000-000000000000") is None


def test_the_stand_in_refuses_a_minor_beyond_the_gpu_range(machine, monkeypatch):
    fake = machine("mixed")
    fake.write(fake.read().replace("pci=0000:18:00.0", "pci=0000:18:00.0 minor=254"))
    fake.activate(monkeypatch)
    # In a process of its own: this one may hold the library from an earlier test already.
    code = ("from cudawrap.devices import nvml\n"
            "try:\n    nvml.inventory()\nexcept nvml.NvmlUnavailable:\n    raise SystemExit(3)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert "minor= wants the minor number of its node, 0..253" in done.stderr


def fake_proc(tmp_path: Path, caps_major: int = 236, table: str = "") -> str:
    proc = tmp_path / "proc"
    (proc / "driver/nvidia-caps").mkdir(parents=True)
    (proc / "devices").write_text(
        "Character devices:\n  1 mem\n195 nvidia\n"
        + (f"{caps_major} nvidia-caps\n" if caps_major else "") + "511 nvidia-uvm\n\nBlock devices:\n236 nvidia-caps\n")
    (proc / "driver/nvidia-caps/mig-minors").write_text(table or (
        "config 1\nmonitor 2\n"
        + "".join(f"gpu{g}/gi{i}/access {3 + g * 200 + i * 10}\n" + "".join(
            f"gpu{g}/gi{i}/ci{c}/access {4 + g * 200 + i * 10 + c}\n" for c in range(8))
            for g in range(2) for i in range(15))))
    return str(proc)


def test_the_caps_major_is_read_from_the_character_devices_only(tmp_path):
    assert drivernodes.char_major("nvidia-caps", fake_proc(tmp_path, 237)) == 237
    assert drivernodes.char_major("nvidia-caps", fake_proc(tmp_path / "b", 0)) is None  # only a block line
    assert drivernodes.char_major("nvidia-caps", str(tmp_path / "none")) is None


def test_a_mig_run_gets_its_parents_node_and_its_own_capabilities(tmp_path):
    proc = fake_proc(tmp_path)
    table = drivernodes.mig_minors(proc)
    rule = drivernodes.rule([(1, 5, 0)], proc)
    assert [m for m in range(254) if not rule.refuses(GPU_MAJOR, m)] == [1]
    open_caps = sorted(m for m in set(table.values()) if not rule.refuses(236, m))
    assert open_caps == sorted([1, 2, table["gpu1/gi5/access"], table["gpu1/gi5/ci0/access"]])
    assert rule.refuses(236, table["gpu0/gi5/access"]) and rule.refuses(236, table["gpu1/gi5/ci1/access"])
    assert rule.refused[-1].high == max(table.values())


def test_without_the_caps_driver_only_gpu_nodes_are_ruled(tmp_path):
    rule = drivernodes.rule([(0, None, None), (3, None, None)], fake_proc(tmp_path, 0))
    assert len(rule.refused) == 1 and sorted(m for _, m in rule.allowed) == [0, 3]
