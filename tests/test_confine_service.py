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
import subprocess
from pathlib import Path
from typing import Iterator, List

import pytest

from cudawrap.base import cgroup
from support.confine import PROBE, numbered_nodes, run_cgroups, teardown
from support.procs import cli_code, first_line, root_only, wait_for
from support.users import MuInstall

pytestmark = [pytest.mark.root, root_only]

# The four GPUs' node minors, in NVML order: not their indices, as the driver may number them.
MINORS = (2, 0, 3, 1)


class Confined:
    def __init__(self, inst: MuInstall, kind: str, served: bool) -> None:
        self.inst = inst
        self.mech = cgroup.choose(kind)
        self.dev = numbered_nodes(inst, MINORS)
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
        self.service: "subprocess.Popen | None" = None
        self.services: List[int] = []  # the pids of this install's services, each run cgroup's maker
        if served:
            self.serve()

    def serve(self) -> None:
        self.service = self.inst.start(None, self.inst.world.python, "-I", "-c", cli_code(self.inst.path), "serve")
        self.services.append(self.service.pid)
        line = self.service.stdout.readline().decode()
        if "listening on" not in line:  # its say, not reading a live service's stderr to an end that never comes
            self.service.kill()
            raise AssertionError(line + self.service.communicate(timeout=10)[1].decode())

    def made(self) -> List[str]:
        """The run cgroups this install's services made that are still there (not another
        test's: other tests beside this one make theirs on the same host)."""
        return run_cgroups(self.mech, by=self.services)

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
        for path in self.made():
            teardown(self.mech, path)


@pytest.fixture(params=["v1", "v2"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def confined(mu, kind: str) -> Iterator:
    """``confined("four-gpus", served=True)``: an install set up as Confined does, closed
    (its service stopped, its run cgroups removed) when the test ends, passed or failed."""
    made: List[Confined] = []

    def make(topology: str = "four-gpus", served: bool = True) -> Confined:
        made.append(Confined(mu(topology), kind, served))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("mode", ["here", "fork", "daemon", "exec"])
@pytest.mark.parametrize("served", [True, False], ids=["service", "daemonless"])
def test_a_run_opens_its_own_gpu_only_whatever_it_does(confined, mode: str, served: bool) -> None:
    c = confined(served=served)
    inst = c.inst
    uuid, got = c.run(inst.world.alice, mode)
    own = MINORS[inst.machine.gpu_uuids().index(uuid)]
    if served:
        assert got == {**{str(c.dev / f"nvidia{m}"): "ENXIO" if m == own else "EPERM" for m in range(4)},
                       str(c.dev / "nvidiactl"): "ENXIO"}
        # The run is over: its cgroup is gone (a spare made ahead for the next run stays).
        assert os.path.basename(c.last_cgroup).startswith("cudawrap-run-")
        wait_for(lambda: not os.path.exists(os.path.join(c.mech.roots[0], c.last_cgroup.lstrip("/"))),
                 what="the run's cgroup removed", details=lambda: str(c.made()))
        assert len(c.made()) == 1
    else:
        assert set(got.values()) == {"ENXIO"}  # nothing confines without the service


def test_two_users_runs_each_open_their_own(confined) -> None:
    """Alice holds a GPU (a run that stays); Bob's run meanwhile opens only his."""
    c = confined()
    inst = c.inst
    go = inst.dir / "go"
    holder = inst.start(inst.world.alice, "probe", "--after", str(go), "here", *c.nodes())
    wait_for(lambda: any(c.mech.pids(p) for p in c.made()),
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


@pytest.mark.parametrize("served", [True, False], ids=["service", "daemonless"])
def test_an_install_s_end_leaves_the_runs_of_another_alone(confined, served: bool) -> None:
    """Two installs on one host, as tests running beside each other are: the one set up
    first (with its service or without) ends while a run of the other's holds its GPU; that
    run goes on and exits 0 (the end once killed every run cgroup made since its start, the
    other's run with SIGKILL)."""
    first = confined(served=served)
    c = confined()
    inst = c.inst
    go = inst.dir / "go"
    holder = inst.start(inst.world.alice, "probe", "--after", str(go), "here", *c.nodes())
    wait_for(lambda: any(c.mech.pids(p) for p in c.made()), what="alice's run in its cgroup")
    first.close()
    go.touch()
    out, err = holder.communicate(timeout=30)
    assert holder.returncode == 0, err.decode()
    assert out.decode().count(" ENXIO") == 2  # its own GPU's node and nvidiactl


def test_a_service_s_start_leaves_another_install_s_runs_as_they_are(confined) -> None:
    """Two installs on one host: the second's service starts while a run of the first's holds
    its GPU, beside a spare made for the next; it adopts nothing of theirs (it once narrowed
    them to no GPU, as ended runs of its own, and removed the spare the next run went into)."""
    c = confined()
    inst = c.inst
    go = inst.dir / "go"
    holder = inst.start(inst.world.alice, "probe", "--after", str(go), "here", *c.nodes())
    wait_for(lambda: len(c.made()) == 2 and any(c.mech.pids(p) for p in c.made()),
             what="alice's run in its cgroup, and a spare", details=lambda: str(c.made()))
    confined()
    go.touch()
    out, err = holder.communicate(timeout=30)
    assert holder.returncode == 0, err.decode()
    assert out.decode().count(" ENXIO") == 2  # its own GPU's node and nvidiactl
    uuid, got = c.run(inst.world.bob, "here")  # into the spare
    assert list(got.values()).count("ENXIO") == 2


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


def test_acquire_confines_the_calling_process_and_release_narrows_it(confined) -> None:
    """cudawrap.acquire() through the service: the calling process opens its device's node;
    after release() (its lease given back) it opens none."""
    c = confined()
    inst = c.inst
    code = ("import json, os, sys\n"
            f"sys.path[:0] = {list(inst.world.path)!r}\n"
            "import cudawrap\n"
            "def opens():\n"
            "    out = {}\n"
            "    for p in sys.argv[2:]:\n"
            "        try:\n"
            "            os.close(os.open(p, os.O_RDWR)); out[p] = 'OK'\n"
            "        except OSError as e:\n"
            "            out[p] = __import__('errno').errorcode[e.errno]\n"
            "    return out\n"
            "got = cudawrap.acquire(wait=30)\n"
            "held = opens()\n"
            "import cudawrap.api; cudawrap.api.release()\n"
            "import time; deadline = time.time() + 10\n"
            "while time.time() < deadline and 'ENXIO' in [v for k, v in opens().items() if 'ctl' not in k]:\n"
            "    time.sleep(0.01)\n"
            "print(json.dumps({'uuid': got[0], 'held': held, 'after': opens()}))\n")
    out = inst.py_json(inst.world.alice, code, "-", *c.nodes())
    own = MINORS[inst.machine.gpu_uuids().index(out["uuid"])]
    assert [m for m in range(4) if out["held"][c.nodes()[m]] == "ENXIO"] == [own]
    assert [m for m in range(4) if out["after"][c.nodes()[m]] == "ENXIO"] == []
    assert out["after"][str(c.dev / "nvidiactl")] == "ENXIO"


def test_a_mig_run_opens_its_parent_and_its_own_capabilities(confined) -> None:
    from support.confine import free_char_major

    c = confined("a100-mig7")
    inst = c.inst
    caps = free_char_major()
    table = {"config": 1, "monitor": 2}
    for gi in range(7, 14):
        table[f"gpu2/gi{gi}/access"] = 10 + 2 * gi  # the A100's node minor is 2 (MINORS[0])
        table[f"gpu2/gi{gi}/ci0/access"] = 11 + 2 * gi
    proc = inst.dir / "proc"
    (proc / "driver/nvidia-caps").mkdir(parents=True)
    (proc / "devices").write_text(f"Character devices:\n195 nvidia\n{caps} nvidia-caps\n\nBlock devices:\n")
    (proc / "driver/nvidia-caps/mig-minors").write_text("".join(f"{k} {v}\n" for k, v in table.items()))
    for minor in table.values():
        os.mknod(c.dev / f"nvidia-cap{minor}", 0o666 | stat.S_IFCHR, os.makedev(caps, minor))
        os.chmod(c.dev / f"nvidia-cap{minor}", 0o666)
    done = inst.run(inst.world.alice, "probe", "here", *c.nodes(),
                    *[str(c.dev / f"nvidia-cap{m}") for m in table.values()])
    assert done.returncode == 0, done.stderr.decode()
    lines = done.stdout.decode().splitlines()
    got = dict(line.rsplit(" ", 1) for line in lines[2:])
    uuid = lines[0].split()[1]
    gi = int(next(f for f in inst.machine.read().split("\n") if uuid in f).split(" gi=")[1].split()[0])
    own = {str(c.dev / f"nvidia-cap{table[n]}") for n in ("config", "monitor", f"gpu2/gi{gi}/access",
                                                              f"gpu2/gi{gi}/ci0/access")}
    assert {p for p, r in got.items() if r == "ENXIO"} == own | {str(c.dev / "nvidia2"), str(c.dev / "nvidiactl")}
    assert set(got.values()) == {"ENXIO", "EPERM"}


@pytest.mark.parametrize("flags,why", [(1, "BPF_F_ALLOW_OVERRIDE: one attached below it would replace it"),
                                       (0, "with no flag, which refuses any below it")])
def test_the_service_will_not_start_below_a_device_program_it_would_widen(mu, flags: int, why: str) -> None:
    """An admin's device program above the service, attached so that a run's program below
    would replace it (ALLOW_OVERRIDE) or cannot be attached (no flag): not started, and why."""
    from cudawrap.base import bpfdev
    from cudawrap.base.devrule import gpu_rule

    inst = mu("four-gpus")
    inst.write_config('[confine]\nruns = true\ncgroup = "v2"\n')
    mech = cgroup.choose("v2")
    top = mech.make("/", f"cudawrap-test-{os.getpid()}")
    try:
        fd = os.open(os.path.join(mech.mount, top.lstrip("/")), os.O_RDONLY | os.O_DIRECTORY)
        try:
            bpfdev.attach(fd, gpu_rule(frozenset({0, 1, 2, 3})), flags, top)
        finally:
            os.close(fd)
        procs = os.path.join(mech.mount, top.lstrip("/"), "cgroup.procs")
        done = inst.run(None, "sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", inst.world.python, "-I", "-c",
                        cli_code(inst.path), "serve")
        err = done.stderr.decode()
        assert done.returncode != 0 and "[confine] runs = true, but runs cannot be confined here: " in err, err
        assert why in err and "Traceback" not in err
    finally:
        teardown(mech, top)


def test_a_run_that_cannot_be_confined_is_told_so_and_gets_nothing(confined, kind: str) -> None:
    """Its place (its own cgroup) has a device program attached with no flag, which refuses
    any below it (v2), or allows devices by a list (v1): the run gets one line and no device."""
    c = confined()
    inst = c.inst
    mech = c.mech
    top = mech.make("/", f"cudawrap-test-{os.getpid()}")
    try:
        if kind == "v2":
            from cudawrap.base import bpfdev
            from cudawrap.base.devrule import gpu_rule

            fd = os.open(os.path.join(mech.mount, top.lstrip("/")), os.O_RDONLY | os.O_DIRECTORY)
            try:
                bpfdev.attach(fd, gpu_rule(frozenset({0, 1, 2, 3})), 0, top)
            finally:
                os.close(fd)
        else:
            devices = os.path.join(mech.devices, top.lstrip("/"))
            Path(devices, "devices.deny").write_text("a")
            Path(devices, "devices.allow").write_text("c *:* rwm")
        go = inst.dir / "go"
        run = inst.start(inst.world.alice, "sh", "-c", f'while [ ! -e {go} ]; do sleep 0.01; done; exec "$@"', "sh",
                         "probe", "here", *c.nodes())
        mech.move(top, run.pid)  # where it runs: below the admin's program or list
        go.touch()
        out, error = run.communicate(timeout=60)
        done = subprocess.CompletedProcess(run.args, run.returncode, out, error)
        err = done.stderr.decode()
        assert done.returncode == os.EX_OSERR, err
        assert "could not confine this run to its devices ([confine] runs = true): nothing was granted" in err
        assert "cvd" not in done.stdout.decode()  # the program never ran
    finally:
        teardown(mech, top)


def test_a_service_killed_leaves_runs_confined_and_its_successor_removes_their_cgroups(confined) -> None:
    """SIGKILL to the service while a run holds a GPU: the run goes on, still confined; the
    next service adopts it, and removes its cgroup once it ends, and a spare the first left."""
    c = confined()
    inst = c.inst
    go = inst.dir / "go"
    holder = inst.start(inst.world.alice, "probe", "--after", str(go), "here", *c.nodes())
    cvd = first_line(holder)  # granted: it holds its GPU (killed before, it would ask the next service)
    assert any(c.mech.pids(p) for p in c.made())
    c.service.kill()
    c.service.wait()
    c.serve()
    go.touch()
    out, _ = holder.communicate(timeout=30)
    lines = [cvd] + out.decode().splitlines()
    own = MINORS[inst.machine.gpu_uuids().index(lines[0].split()[1])]
    got = dict(line.rsplit(" ", 1) for line in lines[2:])
    assert [m for m in range(4) if got[str(c.dev / f"nvidia{m}")] == "ENXIO"] == [own]
    # Every run cgroup goes, the killed service's spare included; the new service may have made
    # one ahead itself (as it adopted alice's run), empty, for its next run: that one stays.
    live = str(c.service.pid)

    def left() -> List[str]:
        return [p for p in c.made() if p.rsplit("-", 2)[-2] != live or c.mech.pids(p)]

    # The run's own cgroup goes once its service has seen it end: waited for, not looked at once.
    wait_for(lambda: not left() and len(c.made()) <= 1, what="every run cgroup removed but the new service's spare",
             details=lambda: str(c.made()))
