"""A single-node Slurm cluster on this machine, for tests/test_slurm.py.

Debian's slurm-wlm and munge, run as root with everything (configuration, munge key and
socket, state, spool, logs, pid files, the GPU device nodes) in one temporary directory,
talking over loopback only. The node has the four GPUs of ``four-gpus.topo``: gres.conf
lists one device node per GPU (character major 195, as the NVIDIA driver's), in NVML
order, so Slurm's GPU index N is the simulated machine's NVML index N.

The fixture is skipped, with the reason, only where it cannot run: not root, or Slurm or
munge not installed. CI runs as root and .ci/run installs both, so there it always runs.

``slurm_cgroup`` is a second cluster with device cgroups (task/cgroup, ConstrainDevices):
Slurm 22.05 drives them through cgroup v1 here; its cgroup v2 plugin needs systemd to
delegate a subtree, which a container without systemd does not have, so that cluster is
skipped (saying so) where /sys/fs/cgroup/devices is not a cgroup v1 devices hierarchy.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

from .procs import wait_for

PROGRAMS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scancel", "scontrol")
GPUS = 4
SHARDS_PER_GPU = 2
CPUS = 8  # more than the machine may have: config_overrides makes slurmd believe the config
CGROUP_V1 = Path("/sys/fs/cgroup")


def missing() -> Optional[str]:
    """Why the cluster cannot run here, or None."""
    if os.geteuid() != 0:
        return "Slurm's daemons need root (CI runs the suite as root)"
    absent = [name for name in PROGRAMS if shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin")
              is None]
    if absent:
        return f"Slurm or munge is not installed ({', '.join(absent)} missing): apt-get install slurm-wlm munge"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin") or name


class Cluster:
    """The running cluster: its configuration, and helpers to submit and inspect jobs."""

    def __init__(self, root: Path, constrain_devices: bool = False) -> None:
        self.root = root
        self.constrain_devices = constrain_devices
        self.node = socket.gethostname().split(".")[0]  # `hostname -s`: slurmd finds itself by it
        self.conf = root / "etc" / "slurm.conf"
        self.devices = [root / "dev" / f"nvidia{i}" for i in range(GPUS)]
        self.munge_socket = root / "munge" / "munge.socket"
        self.procs: List[subprocess.Popen] = []
        # Slurm's cgroup v1 plugins make slurm_<node> in each hierarchy and leave it behind.
        self.cgroups = [CGROUP_V1 / c / f"slurm_{self.node}" for c in ("devices", "freezer")]
        self.cgroups = [path for path in self.cgroups if not path.exists()] if constrain_devices else []

    @property
    def env(self) -> Dict[str, str]:
        """What a client (sbatch, srun, scontrol) needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    # ---- setting up ----------------------------------------------------------------------

    def write(self) -> None:
        for sub in ("etc", "dev", "munge", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(mode=0o700)
        for minor, path in enumerate(self.devices):
            os.mknod(path, 0o600 | 0o020000, os.makedev(195, minor))  # S_IFCHR: slurmd rejects regular files
        slurm_conf = f"""\
ClusterName=cudawrap-test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool
SlurmctldPidFile={self.root}/run/slurmctld.pid
SlurmdPidFile={self.root}/run/slurmd.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/{"cgroup" if self.constrain_devices else "linuxproc"}
TaskPlugin=task/{"cgroup" if self.constrain_devices else "none"}
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
GresTypes=gpu,shard
InactiveLimit=0
KillWait=2
MinJobAge=300
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={CPUS} RealMemory=1000 Gres=gpu:{GPUS},shard:{GPUS * SHARDS_PER_GPU} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        gres_lines = ["AutoDetect=off"]
        gres_lines += [f"NodeName={self.node} Name=gpu File={path}" for path in self.devices]
        gres_lines += [f"NodeName={self.node} Name=shard Count={SHARDS_PER_GPU} File={path}" for path in self.devices]
        self.conf.write_text(slurm_conf)
        (self.conf.parent / "gres.conf").write_text("\n".join(gres_lines) + "\n")
        (self.conf.parent / "cgroup.conf").write_text(
            f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={CGROUP_V1}\nConstrainDevices=yes\n")

    def _start(self, *argv: str) -> subprocess.Popen:
        log = open(self.root / "log" / f"{Path(argv[0]).name}.out", "ab")
        with log:
            proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, **self.env}, start_new_session=True)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        munge = self.root / "munge"
        subprocess.run([_which("mungekey"), "--create", f"--keyfile={munge}/munge.key"], check=True,
                       capture_output=True)
        # --force: the temporary directory lies under /tmp, writable by all, which munged
        # otherwise refuses as a place for its socket.
        self._start(_which("munged"), "--foreground", "--force", f"--socket={self.munge_socket}",
                    f"--key-file={munge}/munge.key", f"--pid-file={munge}/munged.pid",
                    f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed")
        self._wait(lambda: self.munge_socket.exists(), "munged to open its socket")
        self._start(_which("slurmctld"), "-D", "-i", "-f", str(self.conf))
        self._start(_which("slurmd"), "-D", "-f", str(self.conf), "-N", self.node)
        self._wait(lambda: self.node_state() == "idle", "the node to become idle")

    def _wait(self, done, what: str, timeout: float = 60) -> None:
        def ready() -> bool:
            if done():
                return True
            for proc in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args[0]} exited ({proc.returncode}) while waiting for {what}:\n"
                                       + self.logs())
            return False

        wait_for(ready, timeout, what, self.logs)

    def logs(self) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if path.exists():
                out.append(f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(out)

    def stop(self) -> None:
        # Jobs a failed test left running: slurmstepd would outlive slurmd, so end them first.
        if self.node_state() not in ("", "idle"):
            subprocess.run([_which("scancel"), "--full", f"--nodelist={self.node}"], env={**os.environ, **self.env},
                           capture_output=True, timeout=30)
            try:
                self._wait(lambda: self.node_state() == "idle", "the node's jobs to end", timeout=30)
            except RuntimeError:
                pass  # stop the daemons all the same
        for proc in reversed(self.procs):  # slurmd, then slurmctld, then munged
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for path in self.devices:
            path.unlink(missing_ok=True)
        for top in self.cgroups:  # deepest first: a cgroup directory goes only when empty
            for directory in sorted(top.glob("**/"), key=lambda p: len(p.parts), reverse=True):
                directory.rmdir()

    # ---- using it --------------------------------------------------------------------------

    def scontrol(self, *args: str) -> str:
        done = subprocess.run([_which("scontrol"), *args], env={**os.environ, **self.env},
                              capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def node_state(self) -> str:
        try:
            out = self.scontrol("show", "node", self.node)
        except (RuntimeError, subprocess.TimeoutExpired):
            return ""
        match = re.search(r"\bState=(\S+)", out)
        return match.group(1).lower() if match else ""


def gres_indices(show_job: str) -> List[int]:
    """The GPU indices in `scontrol -d show job` output (GRES=gpu:2(IDX:0-1), shard:1(IDX:3))."""
    match = re.search(r"GRES=\S*?\(IDX:([0-9,\-]+)\)", show_job)
    indices: List[int] = []
    for part in match.group(1).split(",") if match else ():
        low, _, high = part.partition("-")
        indices.extend(range(int(low), int(high or low) + 1))
    return indices


def _running(tmp_path_factory: pytest.TempPathFactory, constrain_devices: bool) -> Iterator[Cluster]:
    why = missing()
    if why:
        pytest.skip(why)
    cluster = Cluster(tmp_path_factory.mktemp("slurm"), constrain_devices)
    cluster.write()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A running single-node cluster with four GPUs; stopped and its device nodes removed after."""
    yield from _running(tmp_path_factory, constrain_devices=False)


@pytest.fixture(scope="module")
def slurm_cgroup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The same with device cgroups: a job can open only its own GPUs' device nodes."""
    if not (CGROUP_V1 / "devices" / "devices.allow").exists():
        pytest.skip("device cgroups need a cgroup v1 devices hierarchy at /sys/fs/cgroup/devices here "
                    "(Slurm 22.05's cgroup v2 plugin needs systemd to delegate one)")
    yield from _running(tmp_path_factory, constrain_devices=True)
