"""GPU indices mean what CUDA makes of them: CUDA_DEVICE_ORDER, mixed machines, Slurm's numbering.

The stand-in CUDA program (fakecuda.py) numbers GPUs as CUDA does by default, FASTEST_FIRST
(by compute capability there), or by PCI bus id with CUDA_DEVICE_ORDER=PCI_BUS_ID. A wrapped
run must land on the device the same CUDA_VISIBLE_DEVICES gives the unwrapped program, or
refuse with one line where cudawrap cannot know which that is.
"""
import json
from typing import Dict, Optional

import pytest

from cudawrap.devices.slurm import within_job


def devices(result) -> list:
    return json.loads(result.stdout.splitlines()[0])["devices"]


def test_an_index_on_a_machine_of_two_models_is_refused_not_guessed(installed):
    inst = installed("two-models")
    inst.wrap("recon")
    gpus = inst.machine.gpu_uuids()  # NVML order: A100, A100, H100, H100
    plain = inst.run("CUDAWRAP_recon", CUDA_VISIBLE_DEVICES="0")
    assert devices(plain) == [gpus[2]]  # to CUDA, index 0 is the first H100, not nvidia-smi's GPU 0
    r = inst.run("recon", CUDA_VISIBLE_DEVICES="0")
    assert r.returncode == 64 and r.stdout == b"", r
    lines = r.stderr.decode().splitlines()
    assert len(lines) == 2 and lines[0].startswith("recon: CUDA_VISIBLE_DEVICES names GPU 0 by index")
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in lines[1]


@pytest.mark.parametrize("topology, env", [
    ("two-models", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "3,0"}),
    ("four-gpus", {"CUDA_VISIBLE_DEVICES": "2"}),  # one model: FASTEST_FIRST is PCI order
    ("four-gpus", {"CUDA_DEVICE_ORDER": "FASTEST_FIRST", "CUDA_VISIBLE_DEVICES": "3"}),
    ("two-models", {"CUDA_VISIBLE_DEVICES": "GPU-a1000000-51c2-4e0b-8a3d-000000000001"}),
], ids=["pci-order", "one-model", "one-model-explicit", "uuid"])
def test_wrapped_run_gets_the_device_cuda_would_use(installed, topology: str, env: Dict[str, str]):
    inst = installed(topology)
    inst.wrap("recon")
    cuda_gives = devices(inst.run("CUDAWRAP_recon", **env))
    got = devices(inst.run("recon", **env))
    assert len(got) == 1 and got[0] in cuda_gives, (got, cuda_gives)


def test_stand_in_nvml_reports_compute_capability(machine, monkeypatch):
    machine("two-models").activate(monkeypatch)
    import pynvml

    pynvml.nvmlInit()
    caps = [pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(4)]
    assert caps == [(8, 0), (8, 0), (9, 0), (9, 0)]


def test_pre_r470_mig_spelling(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    gpu = inst.machine.parse().gpus[0]
    mig = gpu.instances[3]
    value = f"MIG-{gpu.uuid}/{mig.gi}/{mig.ci}"
    assert devices(inst.run("CUDAWRAP_recon", CUDA_VISIBLE_DEVICES=value)) == [mig.uuid]
    assert devices(inst.run("recon", CUDA_VISIBLE_DEVICES=value)) == [mig.uuid]
    r = inst.run("recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=f"MIG-{gpu.uuid}/99/0")
    assert r.returncode == 75  # names no instance: no device, as for CUDA


def slurm_env(cvd: Optional[str], ordinals: Optional[str], gpus: Optional[str], **more: str) -> Dict[str, str]:
    env = {"SLURM_JOB_ID": "7", **more}
    for key, value in (("CUDA_VISIBLE_DEVICES", cvd), ("GPU_DEVICE_ORDINAL", ordinals), ("SLURM_JOB_GPUS", gpus)):
        if value is not None:
            env[key] = value
    return env


@pytest.mark.parametrize("env, nvml, expected", [
    (slurm_env("2,3", "2,3", "2,3"), {0, 1, 2, 3}, "2,3"),          # Slurm's indices are NVML's
    (slurm_env("3", "2,3", "2,3"), {0, 1, 2, 3}, "3"),              # the user narrowed within the job
    (slurm_env("1", "2,3", "2,3"), {0, 1, 2, 3}, "-"),              # an index outside the job ends the list
    (slurm_env("0,1", "0,1", "2,3"), {0, 1, 2, 3}, "2,3"),          # cgroup renumbering, NVML sees the node
    (slurm_env("1", "0,1", "2,3"), {0, 1, 2, 3}, "3"),
    (slurm_env("0,1", "0,1", "2,3"), {0, 1}, "0,1"),                # NVML, like CUDA, sees only the job's
    (slurm_env(None, None, "1"), {0, 1}, "1"),                      # the variable unset by hand: the job's
    (slurm_env("GPU-x,0", "0", "0"), {0}, "GPU-x,0"),               # UUIDs pass through
    (slurm_env("0", None, None), {0, 1}, None),                     # no Slurm numbering: CUDA's rules apply
    (slurm_env("03", "3", "3", SLURM_STEP_GPUS="1"), {0, 1, 2, 3}, "1"),  # the step's GPUs win; "03" is 3
], ids=["same", "narrowed", "outside", "renumbered", "renumbered-narrowed", "nvml-local", "unset",
        "uuid", "no-slurm-numbering", "step"])
def test_slurm_indices_to_nvml(env: Dict[str, str], nvml: set, expected: Optional[str]):
    job = within_job(env)
    assert job is not None and job.visible(nvml) == expected


def test_slurm_job_kinds():
    assert within_job({"CUDA_VISIBLE_DEVICES": "0"}) is None
    assert within_job({"SLURM_JOB_ID": "7"}).has_no_gpu
    assert not within_job(slurm_env("", None, None)).has_no_gpu  # set empty: the caller's choice
    assert within_job(slurm_env("0", "0", "0", SLURM_SHARDS_ON_NODE="2")).shares
    assert not within_job(slurm_env(None, None, None, SLURM_SHARDS_ON_NODE="2")).shares  # no GPU named
    assert not within_job(slurm_env("0", "0", "0", SLURM_SHARDS_ON_NODE="0")).shares
