"""The service inside a real Slurm: a run in a job gets its job's GPUs as Slurm says, whatever
its environment claims.

The cluster is tests/support/slurm.py's with device cgroups (task/cgroup, proctrack/cgroup), so the
kernel puts each job's processes in a cgroup named after the job; the service (root, [service] enforce, so
every user's run is granted by it) runs on the same simulated machine and asks Slurm (`scontrol`, found on its own PATH) which GPUs that
job has. The runs in a job are a real account's (setpriv inside the job); what Slurm
allocated is read by root's `scontrol -d show job` while the job waits at a gate, never from
the variables under test.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Iterator, List

import pytest

from support.slurm import Cluster, gres_indices, slurm_cgroup  # noqa: F401
from test_enforce import _enforced
from test_service import Served
from test_slurm import Jobs, log_lines, started
from support.procs import root_only, wait_for

pytestmark = [pytest.mark.root, root_only]

SCONTROL = shutil.which("scontrol", path=os.environ.get("PATH", "") + ":/usr/bin") or "/usr/bin/scontrol"
# Slurm's variables as a run could forge them to claim GPU 0 (another job's) besides its own GPU 2.
FORGED = "CUDA_VISIBLE_DEVICES=0,2 GPU_DEVICE_ORDINAL=0,2 SLURM_JOB_GPUS=0,2 SLURM_STEP_GPUS=0,2"
UNSET = "env -u CUDA_VISIBLE_DEVICES -u GPU_DEVICE_ORDINAL -u SLURM_JOB_GPUS -u SLURM_STEP_GPUS -u SLURM_JOB_ID"


class InJobs(Jobs):
    """Jobs of the test account on a served install; each waits at a gate until the test has
    read its allocation."""

    def __init__(self, cluster: Cluster, served: Served) -> None:
        inst = served.inst
        out = inst.dir / "jobs"
        out.mkdir(mode=0o777)
        out.chmod(0o777)  # the account's jobs write their output here
        super().__init__(cluster, inst, out)
        self.served = served
        self.log = out / "runs.log"
        self.log.touch(mode=0o666)
        self.log.chmod(0o666)

    def submit_as(self, user, script: str, gres: str) -> str:  # type: ignore[no-untyped-def]
        """A job whose SCRIPT runs as USER once the gate opens (the job itself is root's:
        the Slurm fixture's spool is root's alone; USER's processes stay in the job's cgroup)."""
        gate = self.tmp / "gate-$SLURM_JOB_ID"
        as_user = " ".join(shlex.quote(word) for word in user.argv(["sh", "-c", script]))
        return self.submit(f"while [ ! -e {gate} ]; do sleep 0.05; done\n{as_user}", f"--gres={gres}")

    def gpus(self, job_id: str) -> List[str]:
        """UUIDs of the job's GPUs as Slurm says (its GRES indices are NVML's: the fixture's gres.conf)."""
        wait_for(lambda: self.state(job_id) == "RUNNING", 60, f"job {job_id} to run", lambda: self.output(job_id))
        uuids = self.inst.machine.gpu_uuids()
        return [uuids[i] for i in gres_indices(self.cluster.scontrol("-d", "show", "job", job_id))]

    def open_gate(self, job_id: str) -> None:
        (self.tmp / f"gate-{job_id}").touch()

    def service_said(self) -> str:
        self.served.proc.terminate()
        out, _ = self.served.proc.communicate(timeout=30)
        return out.decode(errors="replace")


def _served(mu, cluster: Cluster, **extra: str) -> Served:  # type: ignore[no-untyped-def]
    """The service under [service] enforce: every user's run, in a job or not, is its grant."""
    return Served(_enforced(mu), **cluster.env, **extra)


@pytest.fixture
def in_jobs(slurm_cgroup: Cluster, mu) -> Iterator[InJobs]:  # type: ignore[no-untyped-def]
    j = InJobs(slurm_cgroup, _served(mu, slurm_cgroup))
    yield j
    j.cancel_all()
    if j.served.proc.poll() is None:
        j.served.proc.terminate()
        j.served.proc.wait(timeout=10)


def _outputs(text: str) -> List[str]:
    return [line for line in text.splitlines() if line.startswith("rc=")]


def test_a_run_in_a_job_gets_its_jobs_gpu_and_no_other_whatever_its_environment_claims(in_jobs: InJobs) -> None:
    j, alice = in_jobs, in_jobs.inst.world.alice
    recon, log = j.served.link, j.log
    uuids = j.inst.machine.gpu_uuids()
    blocker = j.submit("sleep 600", "--gres=gpu:2")
    assert j.gpus(blocker) == uuids[:2]  # root's job has GPUs 0 and 1: no run of cudawrap holds them
    script = "\n".join([
        # Another job's GPU by UUID (no Slurm variables: the run asks for it as it is), then
        # Slurm's variables forged to add another job's GPU to its own.
        f"{UNSET} CUDA_VISIBLE_DEVICES={uuids[0]} CUDAWRAP_WAIT=0 {recon}; echo rc=$?",
        f"{FORGED} CUDAWRAP_GPUS=2 CUDAWRAP_WAIT=0 {recon}; echo rc=$?",
        # The same forgery asking one device, and no Slurm variables at all: the job's GPU.
        f"{FORGED} CUDAWRAP_WAIT=0 {recon} --log {log}; echo rc=$?",
        f"{UNSET} CUDAWRAP_WAIT=0 {recon} --log {log}; echo rc=$?",
    ])
    job = j.submit_as(alice, script, "gpu:1")
    mine = j.gpus(job)
    j.open_gate(job)
    assert j.wait(job) == "COMPLETED", j.output(job)
    out = j.output(job)
    assert mine == [uuids[2]]
    assert _outputs(out) == ["rc=75", "rc=75", "rc=0", "rc=0"], out
    assert out.count(f"(Slurm job {job} has 1 device on this machine") == 2, out  # the refusals name the job
    assert [x["devices"] for x in started(log)] == [mine, mine], log_lines(log)
    assert j.service_said().count(f"Slurm job {job}: GPUs 2 here") == 1  # Slurm asked once for its four runs


def test_asking_slurm_holds_up_only_the_jobs_run(slurm_cgroup: Cluster, mu, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A stand-in scontrol on the service's PATH that answers only when the test lets it:
    meanwhile a run outside any job is granted; the job's run then gets its GPU."""
    stand_in = tmp_path / "slow"
    stand_in.mkdir()
    gate = stand_in / "gate"
    os.mkfifo(gate)
    (stand_in / "scontrol").write_text(f"#!/bin/sh\necho \"$*\" >> {stand_in}/asked\n"
                                       f"cat {gate} > /dev/null\nexec {SCONTROL} \"$@\"\n")
    (stand_in / "scontrol").chmod(0o755)
    j = InJobs(slurm_cgroup, _served(mu, slurm_cgroup, PATH=f"{stand_in}:/usr/bin:/bin"))
    try:
        job = j.submit_as(j.inst.world.alice, f"{j.served.link} --log {j.log}", "gpu:1")
        mine = j.gpus(job)
        j.open_gate(job)
        asked = stand_in / "asked"
        wait_for(asked.exists, 60, "the service to ask Slurm", lambda: j.output(job))
        assert asked.read_text().split() == ["show", "job", "-d", job]
        outside = j.inst.run(j.inst.world.bob, "recon", CUDAWRAP_WAIT="0")
        assert outside.returncode == 0, outside.stderr.decode()  # served while Slurm has not answered
        assert started(j.log) == [] and j.state(job) == "RUNNING"  # the job's run still waits for it
        with open(gate, "w"):
            pass  # Slurm may answer now
        assert j.wait(job) == "COMPLETED", j.output(job)
        assert [x["devices"] for x in started(j.log)] == [mine]
    finally:
        j.cancel_all()
        j.served.proc.terminate()
        j.served.proc.wait(timeout=10)


def test_when_slurm_cannot_be_asked_the_jobs_run_gets_one_line_and_others_go_on(
        slurm_cgroup: Cluster, mu, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    stand_in = tmp_path / "down"
    stand_in.mkdir()
    (stand_in / "scontrol").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm "
                                       "controller (connect failure)' >&2\nexit 1\n")
    (stand_in / "scontrol").chmod(0o755)
    j = InJobs(slurm_cgroup, _served(mu, slurm_cgroup, PATH=f"{stand_in}:/usr/bin:/bin"))
    try:
        job = j.submit_as(j.inst.world.alice, f"CUDAWRAP_WAIT=0 {j.served.link} 2> {j.tmp}/err; echo rc=$?",
                          "gpu:1")
        j.gpus(job)
        j.open_gate(job)
        assert j.wait(job) == "COMPLETED", j.output(job)
        assert _outputs(j.output(job)) == ["rc=69"], j.output(job)
        lines = (j.tmp / "err").read_text().splitlines()
        assert lines[0] == (f"recon: Slurm job {job}: scontrol failed: slurm_load_jobs error: "
                            f"Unable to contact slurm controller (connect failure)"), lines
        assert len(lines) == 2 and "scontrol show job -d" in lines[1], lines  # its hint
        outside = j.inst.run(j.inst.world.bob, "recon", CUDAWRAP_WAIT="0")
        assert outside.returncode == 0, outside.stderr.decode()
        assert j.served.proc.poll() is None
    finally:
        j.cancel_all()
        j.served.proc.terminate()
        j.served.proc.wait(timeout=10)
