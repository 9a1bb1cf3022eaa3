"""[confine] runs = true through the service: a wrapped run opens its own GPU's node and no other.

Real accounts, real cgroups (v1 and v2), real nodes made with mknod (support/confine.py): the
wrapped program resets CUDA_VISIBLE_DEVICES and opens every GPU node, itself and after fork,
setsid + double fork, and exec. An open the kernel lets through fails ENXIO (no driver); one
the run's cgroup refuses, EPERM. Daemonless, nothing confines (README: only the service
does): the same body sees every node. When the run is over its cgroup is gone.
"""
from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Iterator, List

import pytest

from cudawrap.base import cgroup
from support.confine import PROBE, run_cgroups, teardown
from support.procs import cli_code, root_only, wait_for
from support.users import MuInstall

pytestmark = [pytest.mark.root, root_only]

# The four GPUs' node minors, in NVML order: not their indices, as the driver may number them.
MINORS = (2, 0, 3, 1)


class Confined:
    def __init__(self, inst: MuInstall, kind: str, served: bool) -> None:
        self.inst = inst
        self.mech = cgroup.choose(kind)
        self.before = set(run_cgroups(self.mech))
        topo = inst.machine.read()
        for uuid, minor in zip(inst.machine.gpu_uuids(), MINORS):
            topo = topo.replace(f"uuid={uuid} ", f"uuid={uuid} minor={minor} ")
        inst.machine.write(topo)
        self.dev = inst.dir / "dev"
        self.dev.mkdir(mode=0o755)
        for minor in range(4):
            os.mknod(self.dev / f"nvidia{minor}", 0o666 | stat.S_IFCHR, os.makedev(195, minor))
            os.chmod(self.dev / f"nvidia{minor}", 0o666)
        os.mknod(self.dev / "nvidiactl", 0o666 | stat.S_IFCHR, os.makedev(195, 255))
        os.chmod(self.dev / "nvidiactl", 0o666)
        (inst.dir / "proc").mkdir(mode=0o755)  # no nvidia-caps driver: GPU nodes only
        probe = inst.dir / "devprobe.py"
        shutil.copy(PROBE, probe)
        probe.chmod(0o644)
        program = inst.dir / "probe.sh"
        hier = "0::" if kind == "v2" else "[0-9]*:devices:"
        program.write_text(f'#!/bin/sh\necho "cvd $CUDA_VISIBLE_DEVICES"\n'
                           f'echo "cgroup $(grep "^{hier}" /proc/$$/cgroup | cut -d: -f3)"\n'
                           f'unset CUDA_VISIBLE_DEVICES\nexec {inst.world.python} -I {probe} "$@"\n')
        inst.wrap("probe", program)
        inst.write_config(f'[confine]\nruns = true\ncgroup = "{kind}"\nproc = "{inst.dir / "proc"}"\n')
        self.service = None
        if served:
            self.service = inst.start(None, inst.world.python, "-I", "-c", cli_code(inst.path), "serve")
            line = self.service.stdout.readline().decode()
            assert "listening on" in line, line + self.service.stderr.read().decode()

    def nodes(self) -> List[str]:
        return [str(self.dev / f"nvidia{m}") for m in range(4)] + [str(self.dev / "nvidiactl")]

    def run(self, user, mode: str):
        done = self.inst.run(user, "probe", mode, *self.nodes())
        assert done.returncode == 0, done.stderr.decode()
        lines = done.stdout.decode().splitlines()
        self.last_cgroup = lines[1].split(" ", 1)[1]
        return lines[0].split()[1], dict(line.rsplit(" ", 1) for line in lines[2:])

    def close(self) -> None:
        if self.service is not None:
            self.service.terminate()
            self.service.wait(timeout=10)
        for path in set(run_cgroups(self.mech)) - self.before:
            teardown(self.mech, path)


@pytest.fixture(params=["v1", "v2"])
def kind(request) -> str:
    return request.param


@pytest.mark.parametrize("mode", ["here", "fork", "daemon", "exec"])
@pytest.mark.parametrize("served", [True, False], ids=["service", "daemonless"])
def test_a_run_opens_its_own_gpu_only_whatever_it_does(mu, kind: str, mode: str, served: bool) -> None:
    inst = mu("four-gpus")
    c = Confined(inst, kind, served)
    try:
        uuid, got = c.run(inst.world.alice, mode)
        own = MINORS[inst.machine.gpu_uuids().index(uuid)]
        if served:
            assert got == {**{str(c.dev / f"nvidia{m}"): "ENXIO" if m == own else "EPERM" for m in range(4)},
                           str(c.dev / "nvidiactl"): "ENXIO"}
            # The run is over: its cgroup is gone (a spare made ahead for the next run stays).
            assert os.path.basename(c.last_cgroup).startswith("cudawrap-run-")
            wait_for(lambda: not os.path.exists(os.path.join(c.mech.roots[0], c.last_cgroup.lstrip("/"))),
                     what="the run's cgroup removed", details=lambda: str(run_cgroups(c.mech)))
            assert len(set(run_cgroups(c.mech)) - c.before) == 1
        else:
            assert set(got.values()) == {"ENXIO"}  # nothing confines without the service
    finally:
        c.close()


def test_two_users_runs_each_open_their_own(mu, kind: str) -> None:
    """Alice holds a GPU (a run that stays); Bob's run meanwhile opens only his."""
    inst = mu("four-gpus")
    c = Confined(inst, kind, True)
    try:
        go = inst.dir / "go"
        holder = inst.start(inst.world.alice, "probe", "--after", str(go), "here", *c.nodes())
        wait_for(lambda: any(c.mech.pids(p) for p in set(run_cgroups(c.mech)) - c.before),
                 what="alice's run in its cgroup")
        uuid, got = c.run(inst.world.bob, "here")
        own = MINORS[inst.machine.gpu_uuids().index(uuid)]
        assert [p for p, r in got.items() if r == "ENXIO"] == [str(c.dev / f"nvidia{own}"), str(c.dev / "nvidiactl")]
        go.touch()
        out, _ = holder.communicate(timeout=30)
        lines = out.decode().splitlines()
        alice_own = MINORS[inst.machine.gpu_uuids().index(lines[0].split()[1])]
        assert alice_own != own
        assert dict(line.rsplit(" ", 1) for line in lines[2:])[str(c.dev / f"nvidia{own}")] == "EPERM"
    finally:
        c.close()


def test_the_service_refuses_to_start_where_runs_cannot_be_confined(mu) -> None:
    inst = mu("four-gpus")
    inst.write_config('[confine]\nruns = true\ncgroup = "v2"\n')
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c", 'umount -l /sys/fs/cgroup/unified && exec "$@"',
            "sh", inst.world.python, "-I", "-c", cli_code(inst.path), "serve"]
    done = inst.run(None, *argv)
    assert done.returncode != 0
    err = done.stderr.decode()
    assert "[confine] runs = true, but runs cannot be confined here: no cgroup v2 hierarchy is mounted" in err, err
    assert "Traceback" not in err
