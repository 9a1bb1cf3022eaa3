"""The Slurm job a client of the service runs in, and that job's GPUs: Slurm's word, never the client's.

The job comes from the client's cgroups (/proc/PID/cgroup, which only the kernel writes), where
Slurm's task/cgroup and proctrack/cgroup plugins put every process of a job:

* cgroup v1: ``/slurm/uid_<uid>/job_<id>/step_<step>/task_<n>`` in each hierarchy (``slurm_<node>``
  where one machine runs several slurmd);
* cgroup v2: ``/system.slice/slurmstepd.scope/job_<id>/step_<step>/user/task_<n>``
  (``<node>_slurmstepd.scope`` likewise).

Those names are trusted only at those places (the top of a v1 hierarchy, systemd's
system.slice), where only root can make a cgroup: an ordinary user can make cgroups only in a
subtree delegated to them (``/user.slice/…/user@<uid>.service/…``), and a cgroup they made
there is theirs, so a job directory found and not owned by root is not Slurm's either.

The job's GPUs come from ``scontrol show job -d <id>`` (``GRES=gpu:2(IDX:0-1)`` on this node's
line): node-wide indices in gres.conf order, NVML's (devices/slurm.py). Asking Slurm can block
(slurmctld away, a slow network), so Lookups runs it on worker threads and wakes the service's
poll loop through a pipe; the answer is kept per job while the job's cgroup stays (a job's
GPUs do not change while it runs), at most CACHE_S.
"""
from __future__ import annotations

import os
import queue
import socket
import signal
import threading
import time
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Set, Tuple, Union

from ..base.wakepipe import WakePipe
from ..errors import CudawrapError, DataError, SlurmUnavailable

CGROUP_FS = "/sys/fs/cgroup"
LOOKUP_TIMEOUT_S = 30.0  # past scontrol's own MessageTimeout (10 s by default)
CACHE_S = 600.0
WORKERS = 4


@dataclass(frozen=True)
class JobCgroup:
    """Where a process sits in Slurm's cgroups: its job, and that job's cgroup."""

    job_id: str
    hierarchy: str  # the controllers of a v1 hierarchy ("devices", "name=systemd"); "" for v2
    path: str  # the job's cgroup, within its hierarchy: "/slurm/uid_1000/job_12"

    @property
    def directory(self) -> str:
        """The job's cgroup in the cgroup file system (the usual mounts)."""
        if not self.hierarchy:
            unified = CGROUP_FS if os.path.exists(f"{CGROUP_FS}/cgroup.controllers") else f"{CGROUP_FS}/unified"
            return unified + self.path
        return f"{CGROUP_FS}/{self.hierarchy.split('=', 1)[-1]}{self.path}"


@dataclass(frozen=True)
class JobGpus:
    """A job's GPUs on this node, as Slurm says: node-wide indices (NVML's)."""

    job_id: str
    indices: FrozenSet[int]

    def __str__(self) -> str:
        return f"Slurm job {self.job_id}: GPUs {','.join(map(str, sorted(self.indices))) or 'none'} here"


def _job_number(part: str) -> Optional[str]:
    number = part[4:] if part.startswith("job_") else ""
    return number if number.isascii() and number.isdigit() and len(number) < 20 else None


def _slurm_job(hierarchy_id: str, path: str) -> Optional[str]:
    """The job of one /proc/PID/cgroup entry, when it sits where only Slurm (root) puts jobs."""
    parts = path.split("/")
    if len(parts) < 4 or parts[0]:
        return None
    top, middle, job = parts[1], parts[2], parts[3]
    if hierarchy_id != "0" and (top == "slurm" or top.startswith("slurm_")) and middle.startswith("uid_"):
        return _job_number(job)
    if hierarchy_id == "0" and top == "system.slice" and (middle == "slurmstepd.scope" or middle.endswith("_slurmstepd.scope")):
        return _job_number(job)
    return None


def parse_cgroup(text: str) -> Optional[JobCgroup]:
    """The Slurm job of a /proc/PID/cgroup TEXT, None outside any; DataError when its
    hierarchies name different jobs (no process of Slurm's is in two)."""
    found: List[JobCgroup] = []
    for line in text.splitlines():
        hierarchy_id, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        job = _slurm_job(hierarchy_id, path)
        if job is not None:
            found.append(JobCgroup(job, controllers if hierarchy_id != "0" else "",
                                   "/".join(path.split("/")[:4])))
    jobs = sorted({j.job_id for j in found})
    if len(jobs) > 1:
        raise DataError(f"the cgroups of the process name Slurm jobs {' and '.join(jobs)}",
                        hint="a process of a Slurm job sits in one job's cgroups: ask the administrator")
    return found[0] if found else None


def job_of(pid: int) -> Optional[JobCgroup]:
    """The Slurm job PID runs in, as its cgroups say; None outside any Slurm job (or gone)."""
    try:  # os.read, not open(): the text layer costs a launch through the service ~0.05 ms
        fd = os.open(f"/proc/{pid}/cgroup", os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, 1 << 16).decode("utf-8", "replace")
        finally:
            os.close(fd)
    except OSError:
        return None
    found = parse_cgroup(text)
    if found is None:
        return None
    try:
        owner = os.stat(found.directory).st_uid
    except OSError:
        return found  # a mount elsewhere: the name's place alone says it is Slurm's
    return found if owner == 0 else None


# -- what Slurm says ----------------------------------------------------------------------------
def _hostlist(expression: str) -> List[str]:
    """Slurm's "node[01-03,7],gpu5" as the names it stands for (one bracket per name)."""
    names: List[str] = []
    depth, start = 0, 0
    for i, char in enumerate(expression + ","):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            names += _expand(expression[start:i])
            start = i + 1
    return names


def _expand(name: str) -> List[str]:
    prefix, bracket, rest = name.partition("[")
    if not bracket:
        return [name] if name else []
    ranges, _, suffix = rest.partition("]")
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not (low.isdigit() and (high or low).isdigit()):
            return []
        names += [f"{prefix}{n:0{len(low)}d}{suffix}" for n in range(int(low), int(high or low) + 1)]
    return names


def gres_gpus(gres: str) -> FrozenSet[int]:
    """The GPU indices of a GRES value: "gpu:2(IDX:0-1)", "gpu:a100:1(IDX:0),gpu:v100:1(IDX:2)";
    shards and other kinds are not GPUs of the job's own."""
    indices: Set[int] = set()
    depth, start = 0, 0
    for i, char in enumerate(gres + ","):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char != "," or depth:
            continue
        item, start = gres[start:i], i + 1
        kind, _, idx = item.partition("(IDX:")
        if kind.split(":", 1)[0] != "gpu" or not idx.endswith(")"):
            continue
        for part in idx[:-1].split(","):
            low, _, high = part.partition("-")
            if low.isdigit() and (high or low).isdigit():
                indices.update(range(int(low), int(high or low) + 1))
    return frozenset(indices)


def gpus_on_node(show_job: str, node_names: Tuple[str, ...]) -> Optional[FrozenSet[int]]:
    """The GPUs `scontrol show job -d` SHOW_JOB gives the job on the node named one of
    NODE_NAMES (the only node, for a one-node job); None when it has none here (not running)."""
    lines = [line.split() for line in show_job.splitlines() if line.strip().startswith("Nodes=")]
    fields = [dict(word.split("=", 1) for word in words if "=" in word) for words in lines]
    if len(fields) > 1:
        fields = [f for f in fields if set(_hostlist(f.get("Nodes", ""))) & set(node_names)]
    return gres_gpus(fields[0].get("GRES", "")) if len(fields) == 1 else None


def this_node() -> Tuple[str, ...]:
    name = socket.gethostname()
    return (name, name.split(".", 1)[0])


def ask_slurm(job_id: str) -> JobGpus:
    """JOB_ID's GPUs on this node, from scontrol (blocking: call off the grant path)."""
    from plumbum import local
    from plumbum.commands.processes import CommandNotFound, ProcessTimedOut

    hint = (f"the service asks Slurm which GPUs a run's job has: `scontrol show job -d {job_id}` must "
            f"work for root where the service runs (PATH, SLURM_CONF)")
    try:
        rc, out, err = local["scontrol"]["show", "job", "-d", job_id].run(retcode=None, timeout=LOOKUP_TIMEOUT_S,
                                                                            cwd="/")
    except CommandNotFound:
        raise SlurmUnavailable(f"Slurm job {job_id}: scontrol is not installed where the service runs",
                               hint=hint) from None
    except ProcessTimedOut:
        raise SlurmUnavailable(f"Slurm job {job_id}: scontrol gave no answer in {LOOKUP_TIMEOUT_S:g} s",
                               hint=hint) from None
    except OSError as exc:
        raise SlurmUnavailable(f"Slurm job {job_id}: cannot run scontrol: {exc.strerror}", hint=hint) from None
    if rc != 0:
        said = (err.strip().splitlines() or [f"exit status {rc}"])[-1][:200]
        raise SlurmUnavailable(f"Slurm job {job_id}: scontrol failed: {said}", hint=hint)
    indices = gpus_on_node(out, this_node())
    if indices is None:
        raise SlurmUnavailable(f"Slurm job {job_id}: scontrol names no allocation of it on this node", hint=hint)
    return JobGpus(job_id, indices)


# -- off the grant path -----------------------------------------------------------------------
Outcome = Union[JobGpus, CudawrapError]


class Lookups:
    """Slurm's answers for jobs, asked on worker threads and kept per job.

    The service's loop polls fileno(); ready() then gives the answers that came. Only that
    thread calls get() and ready()."""

    def __init__(self, workers: int = WORKERS) -> None:
        self._wake = WakePipe()
        self._asked: "queue.Queue[str]" = queue.Queue()
        self._answers: "queue.Queue[Tuple[str, Outcome]]" = queue.Queue()
        self._in_flight: Dict[str, JobCgroup] = {}
        self._kept: Dict[str, Tuple[JobGpus, JobCgroup, float, int]] = {}
        self._workers = workers
        self._threads: List[threading.Thread] = []

    def fileno(self) -> int:
        return self._wake.fileno()

    def get(self, job: JobCgroup) -> Optional[JobGpus]:
        """The kept answer for JOB (while its cgroup is the one it was asked for); else None,
        and Slurm is asked (once, however many of its runs wait): ready() gives the answer."""
        self._forget_ended()
        kept = self._kept.get(job.job_id)
        if kept is not None and kept[1].path == job.path:
            return kept[0]
        self._ask(job)
        return None

    def _ask(self, job: JobCgroup) -> None:
        if job.job_id in self._in_flight:
            return
        self._in_flight[job.job_id] = job
        if len(self._threads) < self._workers:
            thread = threading.Thread(target=self._work, name="slurm-lookup", daemon=True)
            thread.start()
            self._threads.append(thread)
        self._asked.put(job.job_id)

    def ready(self) -> List[Tuple[str, Outcome]]:
        """The answers that came since the last call (each kept, when it is one)."""
        self._wake.drain()
        answers = []
        while True:
            try:
                job_id, outcome = self._answers.get_nowait()
            except queue.Empty:
                return answers
            job = self._in_flight.pop(job_id)
            if isinstance(outcome, JobGpus):
                self._keep(outcome, job)
            answers.append((job_id, outcome))

    def _keep(self, answer: JobGpus, job: JobCgroup) -> None:
        """Keep ANSWER for JOB while its cgroup stays (same directory), CACHE_S at most."""
        try:
            ino = os.stat(job.directory).st_ino
        except OSError:
            ino = -1
        self._kept[answer.job_id] = (answer, job, time.monotonic() + CACHE_S, ino)

    def _forget_ended(self) -> None:
        now = time.monotonic()
        for job_id, (_answer, job, until, ino) in list(self._kept.items()):
            try:
                same = ino < 0 or os.stat(job.directory).st_ino == ino
            except OSError:
                same = False  # the job ended: its cgroup went with it
            if not same or now >= until:
                del self._kept[job_id]

    def _work(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # the main thread's (ledger/writer.py)
        while True:
            job_id = self._asked.get()
            try:
                outcome: Outcome = ask_slurm(job_id)
            except CudawrapError as exc:
                outcome = exc
            except Exception as exc:  # a worker that died would leave its job's runs waiting forever
                outcome = SlurmUnavailable(f"Slurm job {job_id}: asking Slurm failed: {exc}")
            self._answers.put((job_id, outcome))
            self._wake.wake()
