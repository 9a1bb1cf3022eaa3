"""cudawrap/service/slurmjob.py: a client's Slurm job from its cgroups, that job's GPUs from scontrol.

The /proc/PID/cgroup samples are what Slurm makes: cgroup v1 as the suite's real cluster
(tests/support/slurm.py's slurm_cgroup) produces it, cgroup v2 as Slurm documents it
(https://slurm.schedmd.com/cgroup_v2.html). The service tests run the same code against the
real cluster (tests/test_slurm_service.py).
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from cudawrap.errors import DataError
from cudawrap.service.slurmjob import JobCgroup, gpus_on_node, gres_gpus, job_of, parse_cgroup

# A batch step as the Slurm fixture's cluster (task/cgroup, proctrack/cgroup, CgroupPlugin=cgroup/v1) puts it.
V1 = """9:name=systemd:/
8:pids:/
6:freezer:/slurm_vm/uid_1001/job_12/step_batch
5:devices:/slurm_vm/uid_1001/job_12/step_batch/task_0
4:memory:/process_api/086ecdbd
0::/
"""


@pytest.mark.parametrize("text, job", [
    (V1, JobCgroup("12", "freezer", "/slurm_vm/uid_1001/job_12")),
    ("4:devices:/slurm/uid_0/job_3/step_0/task_1\n", JobCgroup("3", "devices", "/slurm/uid_0/job_3")),
    ("0::/system.slice/slurmstepd.scope/job_981/step_batch/user/task_0\n",
     JobCgroup("981", "", "/system.slice/slurmstepd.scope/job_981")),
    ("0::/system.slice/node7_slurmstepd.scope/job_5/step_0/user/task_0\n",  # several slurmd on one host
     JobCgroup("5", "", "/system.slice/node7_slurmstepd.scope/job_5")),
    ("0::/system.slice/slurmstepd.scope/job_44\n", JobCgroup("44", "", "/system.slice/slurmstepd.scope/job_44")),
], ids=["v1-batch", "v1-step", "v2-batch", "v2-multiple-slurmd", "v2-job-itself"])
def test_the_job_of_slurms_cgroups(text: str, job: JobCgroup) -> None:
    assert parse_cgroup(text) == job


@pytest.mark.parametrize("text", [
    "0::/\n",
    "0::/user.slice/user-1000.slice/session-3.scope\n",
    # Cgroups a user may make in a subtree delegated to them: named like Slurm's, at other places.
    "0::/user.slice/user-1000.slice/user@1000.service/app.slice/slurmstepd.scope/job_7/step_0\n",
    "0::/user.slice/user-1000.slice/user@1000.service/system.slice/slurmstepd.scope/job_7\n",
    "5:devices:/user.slice/slurm/uid_1000/job_7/step_0\n",
    "0::/slurm/uid_1000/job_7/step_0\n",  # v1's layout on the v2 line
    "5:devices:/system.slice/slurmstepd.scope/job_7/step_0\n",  # v2's layout in a v1 hierarchy
    "0::/system.slice/slurmd.service\n",
    "0::/system.slice/slurmstepd.scope/system\n",  # slurmstepd's own cgroup, in no job
    "5:devices:/slurm/uid_0/job_x1/step_0\n",
    "5:devices:/slurm/job_7/step_0\n",
], ids=["root", "session", "delegated-app", "delegated-system", "v1-nested", "v1-on-v2", "v2-on-v1",
        "slurmd", "slurmstepd", "not-a-number", "no-uid"])
def test_no_job_outside_slurms_places(text: str) -> None:
    assert parse_cgroup(text) is None


def test_hierarchies_naming_two_jobs_are_refused() -> None:
    with pytest.raises(DataError, match="Slurm jobs 12 and 13"):
        parse_cgroup("6:freezer:/slurm/uid_0/job_12/step_0\n5:devices:/slurm/uid_0/job_13/step_0/task_0\n")


@pytest.mark.parametrize("gres, gpus", [
    ("gpu:2(IDX:0-1)", {0, 1}),
    ("gpu:2(IDX:0,2)", {0, 2}),
    ("gpu:a100:1(IDX:0),gpu:v100:2(IDX:2-3)", {0, 2, 3}),
    ("gpu:1(IDX:3),shard:2(IDX:1)", {3}),
    ("shard:1(IDX:2)", set()),  # a shard job's GPU is shared, not the job's
    ("", set()),
    ("gpu:1(IDX:N/A)", set()),
])
def test_the_gpus_of_a_gres_value(gres: str, gpus: set) -> None:
    assert gres_gpus(gres) == gpus


SHOW_JOB = """JobId=12 JobName=train
   JobState=RUNNING Reason=None Dependency=(null)
   JOB_GRES=gpu:3
     Nodes={first} CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:0-1)
     Nodes=gpu03 CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:3)
   MinCPUsNode=1 MinMemoryNode=0 MinTmpDiskNode=0
"""


def test_the_gpus_on_this_node_of_a_job_on_several() -> None:
    text = SHOW_JOB.format(first="gpu[01-02]")
    assert gpus_on_node(text, ("gpu02.example.org", "gpu02")) == {0, 1}
    assert gpus_on_node(text, ("gpu03",)) == {3}
    assert gpus_on_node(text, ("gpu04",)) is None


def test_a_one_node_job_and_one_not_running() -> None:
    one = "JobId=3\n   JobState=RUNNING\n     Nodes=vm CPU_IDs=0 Mem=0 GRES=gpu:1(IDX:2)\n"
    assert gpus_on_node(one, ("another-name",)) == {2}  # its only node: where its cgroup is
    assert gpus_on_node("JobId=3\n   JobState=PENDING Reason=Resources\n   NodeList=\n", ("vm",)) is None
    assert gpus_on_node("JobId=3\n     Nodes=vm CPU_IDs=2 Mem=0 GRES=\n", ("vm",)) == set()


V1_DEVICES = Path("/sys/fs/cgroup/devices")


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or not (V1_DEVICES / "devices.allow").exists(),
                    reason="needs root and a cgroup v1 devices hierarchy (as the slurm_cgroup fixture)")
def test_a_job_cgroup_of_someone_elses_is_not_slurms(tmp_path: Path) -> None:
    """A process in a cgroup named like Slurm's: its job while the job's cgroup is root's (as
    Slurm makes it), none once it belongs to an ordinary account (who could have made it)."""
    top = V1_DEVICES / f"slurm_cwtest{os.getpid()}"
    job = top / "uid_1000" / "job_999"
    step = job / "step_0"
    step.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        (step / "cgroup.procs").write_text(str(sleeper.pid))
        found = job_of(sleeper.pid)
        assert found == JobCgroup("999", "devices", f"/{top.name}/uid_1000/job_999")
        assert found.directory == str(job)
        os.chown(job, 1000, 1000)
        assert job_of(sleeper.pid) is None
    finally:
        sleeper.kill()
        sleeper.wait()
        for directory in (step, job, job.parent, top):  # a cgroup goes once it has no process
            directory.rmdir()


def test_the_wake_pipe_wakes_once_and_never_blocks_its_waker() -> None:
    """Lookups' workers wake the loop through it, and the service's signals too: a wake on a
    full pipe returns at once (the loop wakes anyway), and drain() leaves it empty, so the
    next select sleeps."""
    import select

    from cudawrap.base.wakepipe import WakePipe

    pipe = WakePipe()
    try:
        assert select.select([pipe], [], [], 0)[0] == []
        for _ in range(70000):  # past a pipe's 64 KiB
            pipe.wake()
        assert select.select([pipe], [], [], 0)[0] == [pipe]
        pipe.drain()
        assert select.select([pipe], [], [], 0)[0] == []
    finally:
        pipe.close()
