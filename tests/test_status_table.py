"""`cudawrap status` as a table: 80 columns, the holder's program by name, the install root."""
import pytest

from corefix import ready_line
from cudawrap.status import program_name, render


@pytest.mark.parametrize("argv, name", [
    (["/opt/app/bin/CUDAWRAP_recon", "in.dat"], "recon"),
    (["/usr/bin/python3.11", "-IS", "/opt/app/bin/CUDAWRAP_recon", "--hold", "5"], "recon"),
    (["/home/ann/.conda/envs/t/bin/python", "-u", "train.py", "--lr", "3"], "train.py"),
    (["python3", "-m", "torch.distributed.run"], "torch.distributed.run"),
    (["/bin/sh", "-e", "/opt/run.sh"], "run.sh"),
    (["/usr/local/bin/blender", "-b", "scene.blend"], "blender"),
    ([""], "?"),
], ids=["wrapped-binary", "wrapped-script", "python-script", "python-module", "shell-script", "binary", "empty"])
def test_program_name(argv, name):
    assert program_name(argv) == name


def _device(n: int, holder=None) -> dict:
    return {"uuid": f"MIG-{n:08x}-1234-5678-9abc-def012345678", "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb",
            "gpu_index": 7, "parent": "GPU-x", "mig_slot": n, "memory_used_mib": 81000,
            "memory_total_mib": 81920, "lease_file": True, "holder": holder, "foreign_pids": [4194301, 4194302]}


def test_default_table_fits_80_columns():
    holder = {"pid": 4194303, "user": "annabelle", "command": "/root/.pyenv/versions/3.11.7/bin/python3.11 -u "
              "/home/annabelle/projects/segmentation/train_segmentation.py", "program": "train_segmentation.py",
              "since": "2026-01-02T03:04:05"}
    status = {"root": "/", "devices": [_device(n, holder if n % 2 else None) for n in range(7)],
              "waiting": [{"user": "bob", "pid": 4194300, "count": 2, "program": "recon", "position": 1,
                           "reason": "1 usable device free, 1 more needed; position 1 in line"}],
              "queue_lock_holder": None, "nvml_error": None}
    lines = render(status)
    assert lines[0] == "install root /: 7 devices, 3 leased, 1 waiting"
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    assert any("pid 4194303 annabel~ train_seg~" in line for line in lines), lines  # not the interpreter
    assert not any("pyenv" in line for line in lines)


def test_holder_is_shown_by_program_name(installed):
    inst = installed("four-gpus")
    recon = inst.wrap("recon")
    holder = inst.start(str(recon), "--hold", "30")
    try:
        ready_line(holder)
        r = inst.cli("status")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.decode().splitlines()
        assert lines[0] == f"install root {inst.layout.root}: 4 devices, 1 leased, 0 waiting"
        assert any(f"pid {holder.pid} " in line and line.split()[6:7] == ["recon"] for line in lines), lines
        assert all(len(line) <= 80 for line in lines[1:]), lines  # the first names a long tmp_path
    finally:
        holder.kill()
        holder.wait()
