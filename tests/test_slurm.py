"""cudawrap inside a real Slurm: a single-node cluster (tests/support/slurm.py) with four simulated GPUs.

Slurm decides which GPUs a job has; cudawrap, inside the job, only shares those among the
job's wrapped runs. Every claim is checked against what Slurm itself says it allocated
(`scontrol -d show job`, recorded by the job as it starts), never against the variables
cudawrap reads. Programs that must overlap hold their devices until the test has seen the
overlap and cancels them: nothing here depends on how fast the machine is.
"""
import json
import re
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest

from support.installed import Installed
from support.procs import wait_for
from support.slurm import Cluster, gres_indices, slurm, slurm_cgroup  # noqa: F401
from support.installed import intervals

DONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")

class Jobs:
    """Submitting jobs to the cluster with the environment of one cudawrap install."""

    def __init__(self, cluster: Cluster, inst: Installed, tmp: Path) -> None:
        self.cluster = cluster
        self.inst = inst
        self.tmp = tmp
        self.submitted: List[str] = []

    def env(self) -> Dict[str, str]:
        return self.inst.environ(**self.cluster.env)

    def submit(self, script: str, *options: str) -> str:
        """sbatch SCRIPT; the job first records what Slurm allocated it, as Slurm says it."""
        body = f"#!/bin/sh\nscontrol -d show job $SLURM_JOB_ID > {self.tmp}/alloc-$SLURM_JOB_ID\n{script}\n"
        done = subprocess.run(["sbatch", "--parsable", "-o", f"{self.tmp}/out-%j", *options],
                              input=body, env=self.env(), capture_output=True, text=True, timeout=30,
                              cwd=self.inst.bindir)
        assert done.returncode == 0, done.stderr
        job_id = done.stdout.strip().split(";")[0]
        self.submitted.append(job_id)
        return job_id

    def state(self, job_id: str) -> str:
        match = re.search(r"\bJobState=(\S+)", self.cluster.scontrol("show", "job", job_id))
        return match.group(1) if match else ""

    def wait(self, job_id: str, timeout: float = 60) -> str:
        """Until the job ends; its final state, with its output on failure."""
        wait_for(lambda: self.state(job_id) in DONE_STATES, timeout, f"job {job_id} to end",
                 lambda: f"still {self.state(job_id)}:\n{self.output(job_id)}")
        return self.state(job_id)

    def output(self, job_id: str) -> str:
        path = self.tmp / f"out-{job_id}"
        return path.read_text(errors="replace") if path.exists() else "(no output)"

    def allocated(self, job_id: str) -> List[str]:
        """UUIDs of the GPUs Slurm gave the job: its GRES indices are NVML indices (support/slurm.py's gres.conf)."""
        path = self.tmp / f"alloc-{job_id}"
        wait_for(path.exists, 60, f"job {job_id} to start", lambda: self.output(job_id))
        uuids = [g.uuid for g in self.inst.machine.parse().gpus]
        indices = gres_indices(path.read_text())
        return [uuids[i] for i in indices]

    def cancel_all(self) -> None:
        if self.submitted:
            subprocess.run(["scancel", *self.submitted], env=self.env(), capture_output=True, timeout=30)
            for job_id in self.submitted:
                self.wait(job_id)



def log_lines(path: Path) -> List[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def started(path: Path) -> List[dict]:
    return [j for j in log_lines(path) if j["event"] == "start"]


def most_at_once(jobs: List[dict]) -> int:
    """The largest number of runs alive at one moment, from their start and end records."""
    events = sorted((j["time"], 0 if j["event"] == "end" else 1) for j in jobs)
    alive = peak = 0
    for _when, starting in events:
        alive += 1 if starting else -1
        peak = max(peak, alive)
    return peak


def runs(program: Path, log: Path, n: int, hold: float, launcher: str = "") -> str:
    """Shell lines that start N runs of PROGRAM at once and fail if any fails."""
    lines = [f"{launcher}{program} --hold {hold} --log {log} > /dev/null & pids=\"$pids $!\""
             for _ in range(n)]
    return "\n".join(lines + ["rc=0; for p in $pids; do wait $p || rc=1; done; exit $rc"])


@pytest.fixture
def jobs(slurm: Cluster, installed, tmp_path: Path):
    made: List[Jobs] = []

    def make(topology: str = "four-gpus") -> Jobs:
        inst = installed(topology)
        made.append(Jobs(slurm, inst, tmp_path))
        return made[-1]

    yield make
    for j in made:
        j.cancel_all()


def test_batch_job_shares_its_two_gpus_and_leaves_the_others_to_another_job(jobs):
    j = jobs()
    recon = j.inst.wrap("recon")
    log_b, log_a = j.tmp / "b.log", j.tmp / "a.log"
    # Job B holds its two GPUs until the test has seen job A through.
    job_b = j.submit(runs(recon, log_b, 2, 600), "--gres=gpu:2")
    wait_for(lambda: len(started(log_b)) == 2, 60, "job B's two runs", lambda: j.output(job_b))
    job_a = j.submit(runs(recon, log_a, 4, 1), "--gres=gpu:2")
    assert j.wait(job_a) == "COMPLETED", j.output(job_a)
    assert [x["event"] for x in log_lines(log_b)] == ["start", "start"]  # B ran all through A

    gpus_a, gpus_b = j.allocated(job_a), j.allocated(job_b)
    assert len(gpus_a) == len(gpus_b) == 2 and not set(gpus_a) & set(gpus_b)
    a = log_lines(log_a)
    assert len(started(log_a)) == 4 and all(x.get("exit") == 0 for x in a if x["event"] == "end")
    assert all(len(x["devices"]) == 1 and x["devices"][0] in gpus_a for x in started(log_a)), (gpus_a, a)
    assert {x["devices"][0] for x in started(log_a)} == set(gpus_a)  # both of its GPUs, none other
    assert most_at_once(a) <= 2
    assert all(len(spans) == 2 for spans in intervals(a).values())  # two runs each, one after the other
    assert sorted(x["devices"][0] for x in started(log_b)) == sorted(gpus_b)


def test_srun_steps_share_the_allocation(jobs):
    j = jobs()
    recon = j.inst.wrap("recon")
    log = j.tmp / "steps.log"
    # Four steps at once, each over the whole allocation (--overlap lets steps share its GPUs).
    job = j.submit(runs(recon, log, 4, 1, launcher="srun --overlap -n1 --gres=gpu:2 "), "--gres=gpu:2")
    assert j.wait(job) == "COMPLETED", j.output(job)
    gpus = j.allocated(job)
    steps = log_lines(log)
    assert len(started(log)) == 4 and most_at_once(steps) <= 2
    assert {x["devices"][0] for x in started(log)} == set(gpus), (gpus, steps)
    assert all(len(x["devices"]) == 1 for x in started(log))


def test_a_job_without_gpus_gets_no_device(jobs):
    j = jobs()
    recon = j.inst.wrap("recon")
    job = j.submit(f"{recon} --require 0", "-n1")
    assert j.wait(job) == "COMPLETED", j.output(job)
    out = j.output(job)
    hello = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert hello["cvd"] == "" and hello["devices"] == []  # CUDA sees no GPU, as the job has none
    assert f"recon: Slurm job {job} has no GPU: running without a device" in out


def test_slurm_indices_mean_slurms_gpus_on_a_mixed_machine(jobs):
    """Slurm numbers GPUs in gres.conf (NVML) order; CUDA's default order would read its
    indices as other GPUs. cudawrap reads them as Slurm meant them and passes UUIDs."""
    j = jobs("two-models")
    recon = j.inst.wrap("recon")
    plain = j.inst.bindir / "plain"
    plain.symlink_to(j.inst.bindir / "CUDAWRAP_recon")
    log = j.tmp / "mixed.log"
    job = j.submit(f"{plain} --require 1 > {j.tmp}/plain.json\n{recon} --log {log}", "--gres=gpu:1")
    assert j.wait(job) == "COMPLETED", j.output(job)
    gpus = j.allocated(job)
    assert [x["devices"] for x in started(log)] == [gpus]
    unwrapped = json.loads((j.tmp / "plain.json").read_text())
    assert unwrapped["devices"] != gpus  # what the index alone gives CUDA: another GPU


def test_two_shard_jobs_run_on_one_gpu_at_once(jobs):
    j = jobs()
    recon = j.inst.wrap("recon")
    # A job on three GPUs leaves the fourth as the only one shards can be placed on.
    blocker = j.submit("sleep 600", "--gres=gpu:3")
    wait_for(lambda: j.state(blocker) == "RUNNING", 60, "the job holding three GPUs")
    logs = [j.tmp / "shard1.log", j.tmp / "shard2.log"]
    shard_jobs = []
    for log in logs:
        shard_jobs.append(j.submit(runs(recon, log, 1, 600), "--gres=shard:1"))
        wait_for(lambda: len(started(log)) == 1, 60, "the shard job's run", lambda: j.output(shard_jobs[-1]))
    free = sorted(set(j.inst.machine.gpu_uuids()) - set(j.allocated(blocker)))
    assert [j.allocated(s) for s in shard_jobs] == [free, free]
    assert [started(log)[0]["devices"] for log in logs] == [free, free]  # both on it, at once


def test_user_narrowing_within_the_job_stays_within_it(jobs):
    j = jobs()
    recon = j.inst.wrap("recon")
    script = (f"CUDA_VISIBLE_DEVICES=3 CUDAWRAP_WAIT=0 {recon}; echo rc=$?\n"
              f"CUDA_VISIBLE_DEVICES=${{CUDA_VISIBLE_DEVICES#*,}} {recon}")
    job = j.submit(script, "--gres=gpu:2")
    assert j.wait(job) == "COMPLETED", j.output(job)
    gpus = j.allocated(job)
    out = j.output(job)
    assert "rc=75" in out  # a GPU outside the job, even by index: no device
    hello = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert hello[-1]["devices"] == [gpus[1]]  # the second of the job's GPUs, as the user narrowed


def test_device_cgroups_renumber_and_cudawrap_follows(slurm_cgroup: Cluster, installed, tmp_path: Path):
    """With ConstrainDevices Slurm numbers the job's GPUs from 0 (SLURM_JOB_GPUS keeps the
    node's numbers) and the job can open only its own device nodes. NVML here lists the
    whole node, so cudawrap must translate: the device it gives is one the cgroup allows."""
    j = Jobs(slurm_cgroup, installed("four-gpus"), tmp_path)
    try:
        recon = j.inst.wrap("recon")
        blocker = j.submit("sleep 600", "--gres=gpu:2")  # takes GPUs 0 and 1
        wait_for(lambda: j.state(blocker) == "RUNNING", 60, "the job holding two GPUs")
        # Opening a node fails either way (no driver behind it): EPERM is the cgroup's refusal.
        probe = "".join(f"head -c1 {d} 2>&1 | grep -q 'not permitted' && echo {i} >> {tmp_path}/blocked\n"
                        for i, d in enumerate(slurm_cgroup.devices))
        job = j.submit(f"echo \"$CUDA_VISIBLE_DEVICES $SLURM_JOB_GPUS\" > {tmp_path}/vars\n"
                       f"{recon} --log {tmp_path}/cg.log\n{probe}true", "--gres=gpu:2")
        assert j.wait(job) == "COMPLETED", j.output(job)
    finally:
        j.cancel_all()
    uuids = j.inst.machine.gpu_uuids()
    assert j.allocated(job) == [uuids[2], uuids[3]]
    assert (tmp_path / "vars").read_text().split() == ["0,1", "2,3"]  # Slurm renumbered
    assert (tmp_path / "blocked").read_text().split() == ["0", "1"]  # the cgroup is in force
    got = [x["devices"] for x in started(tmp_path / "cg.log")]
    assert len(got) == 1 and got[0][0] in (uuids[2], uuids[3]), got  # a GPU the job may open
