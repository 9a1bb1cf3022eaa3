"""Real device nodes and real cgroups for the confinement tests, removed whatever happens.

``gpu_nodes``: character nodes made with mknod in a private directory: nvidia0..3 (major
195, minors 0-3), nvidiactl (195:255), and two MIG capability nodes of a major no driver
registered (the real nvidia-caps major is dynamic too). No driver answers any of them, so an
open the kernel lets through fails ENXIO, and one a cgroup refuses fails EPERM.

``cgroups``: each cgroup mechanism of this host (v1 and v2; the CI machine has both), with
a test parent cgroup below the test's own; at teardown every process left below it is
killed and every cgroup removed, deepest first.
"""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

import pytest

from cudawrap.base import cgroup


PROBE = str(Path(__file__).with_name("devprobe.py"))


def free_char_major(start: int = 3000) -> int:
    """A character major no driver has registered (/proc/devices)."""
    used = set()
    with open("/proc/devices") as f:
        for line in f:
            if line.startswith("Block"):
                break
            parts = line.split()
            if parts and parts[0].isdigit():
                used.add(int(parts[0]))
    return next(m for m in range(start, 4096) if m not in used)


def numbered_nodes(inst, minors: Sequence[int]) -> Path:
    """INST's simulated GPUs given node minors MINORS (in NVML order, not their indices, as the
    driver may number them), and a node directory INST.dir/dev with nvidia0..N-1 and nvidiactl
    (195:255), each 0666 as the driver makes them by default."""
    topo = inst.machine.read()
    for uuid, minor in zip(inst.machine.gpu_uuids(), minors):
        topo = topo.replace(f"uuid={uuid} ", f"uuid={uuid} minor={minor} ")
    inst.machine.write(topo)
    dev = inst.dir / "dev"
    dev.mkdir(mode=0o755)
    for name, minor in [(f"nvidia{m}", m) for m in range(len(minors))] + [("nvidiactl", 255)]:
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
        os.chmod(dev / name, 0o666)
    return dev


@dataclass(frozen=True)
class Nodes:
    dir: Path
    caps_major: int

    def gpu(self, minor: int) -> str:
        return str(self.dir / f"nvidia{minor}")

    @property
    def ctl(self) -> str:
        return str(self.dir / "nvidiactl")

    def cap(self, minor: int) -> str:
        return str(self.dir / f"nvidia-cap{minor}")


CAP_MINORS = (1, 2, 3, 4)  # 1 config, 2 monitor, 3 and 4 two MIG instances' access


@pytest.fixture
def gpu_nodes(tmp_path: Path) -> Iterator[Nodes]:
    nodes = Nodes(tmp_path / "dev", free_char_major())
    nodes.dir.mkdir()
    made: List[str] = []
    try:
        for path, major, minor in ([(nodes.gpu(m), 195, m) for m in range(4)] + [(nodes.ctl, 195, 255)]
                                   + [(nodes.cap(m), nodes.caps_major, m) for m in CAP_MINORS]):
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            made.append(path)
            os.chmod(path, 0o666)
        yield nodes
    finally:
        for path in made:
            os.unlink(path)


def tree(top: str) -> List[str]:
    """Every directory at and below TOP, deepest first."""
    dirs = [d for d, _, _ in os.walk(top)]
    return sorted(dirs, key=lambda d: d.count("/"), reverse=True)


def empty(path: str, timeout: float = 10.0) -> bool:
    """Kill every process in the cgroup directory PATH; whether none is left within TIMEOUT."""
    for state, thawed in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
        try:
            with open(os.path.join(path, state), "w") as f:
                f.write(thawed)  # a frozen process dies of SIGKILL only once thawed
        except OSError:
            pass
    deadline = time.monotonic() + timeout
    while True:
        pids = cgroup._pids(path)
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def teardown(mech: "cgroup.V1 | cgroup.V2", rel_top: str) -> None:
    """Kill what is left below REL_TOP (a path the mechanism takes) and remove its cgroups."""
    for root in mech.roots:
        top = os.path.join(root, rel_top.lstrip("/"))
        if not os.path.isdir(top):
            continue
        for d in tree(top):
            assert empty(d), f"{d} not empty in 10 s"
            os.rmdir(d)


@dataclass(frozen=True)
class Cgroups:
    mech: "cgroup.V1 | cgroup.V2"
    top: str  # the test's parent cgroup, below the test process's own


def run_cgroups(mech: "cgroup.V1 | cgroup.V2", by: Optional[Sequence[int]] = None) -> List[str]:
    """Every run cgroup of cudawrap's in MECH's first hierarchy, as paths within it; with BY,
    only those the processes of these pids made (a run cgroup's name ends "-PID-COUNT"). Other
    tests run beside this one on the same host, their services' run cgroups among these: a
    test must never count them as its own, let alone kill what runs in them."""
    root = mech.roots[0]
    return ["/" + os.path.relpath(os.path.join(d, n), root) for d, dirs, _ in os.walk(root)
            for n in dirs if n.startswith("cudawrap-run-")
            and (by is None or any(n.rsplit("-", 2)[-2] == str(pid) for pid in by))]


@pytest.fixture(params=["v1", "v2"])
def cgroups(request: pytest.FixtureRequest) -> Iterator[Cgroups]:
    mech = cgroup.choose(request.param)
    top = os.path.join(mech.parent_of(os.getpid()), f"cudawrap-test-{os.getpid()}")
    try:
        mech.make(*os.path.split(top))
        yield Cgroups(mech, top)
    finally:
        # A run cgroup made where the test did not mean it: by this process's RunCgroups alone.
        for path in run_cgroups(mech, by=[os.getpid()]):
            teardown(mech, path)
        teardown(mech, top)


class Probe:
    """A devprobe process waiting for its go; ``results`` reads what each open got."""

    def __init__(self, mode: str, paths: Sequence[str], argv_prefix: Sequence[str] = ()) -> None:
        self.proc = subprocess.Popen([*argv_prefix, sys.executable, "-I", PROBE, "--go", mode, *paths],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def results(self) -> Dict[str, str]:
        out, _ = self.proc.communicate("go\n", timeout=30)
        return dict(line.rsplit(" ", 1) for line in out.splitlines())
