"""[confine] nodes = "leased": no lease, no GPU.

Real accounts and real nodes made with mknod (major 195) in a test directory, named by the
root-owned config's [confine] dev (and the driver's /proc side by [confine] proc). An open
the mode or ACL refuses fails EACCES; one let through to the absent driver, ENXIO. Under
"leased" another user's own process and CUDAWRAP_<name> run directly open no GPU; a lessee's
run opens its node, and once the lease ends the lessee's other process opens it no more.
"open", a stop with "open" set, `cudawrap sync` and a restart put each node back exactly as
it was (mode, owner, ACL); a SIGKILLed service's successor sets the ACLs to the leases held.
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
from typing import Dict, Iterator, List, Optional

import pytest

from cudawrap.base import nodemodes, posixacl
from cudawrap.ledger import files as ledgerfile, looks as ledger
from support.confine import PROBE, numbered_nodes, run_cgroups
from support.procs import cli_code, first_line, root_only, wait_for
from support.users import MuInstall

pytestmark = [pytest.mark.root, root_only]

MINORS = (2, 0, 3, 1)  # the four GPUs' node minors, in NVML order


def node_state(path: str) -> tuple:
    st = os.lstat(path)
    return (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), nodemodes.read_acl(path))


class Leased:
    def __init__(self, inst: MuInstall, params: Optional[str] = None, nodes: str = "leased", extra: str = "") -> None:
        self.inst = inst
        self.extra = extra  # more of [confine]
        self.dev = numbered_nodes(inst, MINORS)
        # One node as an admin may have left it: another owner and group, an ACL of its own.
        os.chown(self.dev / "nvidia3", inst.world.carol.uid, 44)
        os.setxattr(self.dev / "nvidia3", posixacl.XATTR, posixacl.encode([
            posixacl.Entry(posixacl.USER_OBJ, 6), posixacl.Entry(posixacl.USER, 4, inst.world.bob.uid),
            posixacl.Entry(posixacl.GROUP_OBJ, 4), posixacl.Entry(posixacl.MASK, 6), posixacl.Entry(posixacl.OTHER, 6)]))
        self.before = self.states()
        self.proc = inst.dir / "proc"
        (self.proc / "driver/nvidia").mkdir(parents=True, mode=0o755)
        if params is not None:
            (self.proc / "driver/nvidia/params").write_text(params)
        probe = inst.dir / "devprobe.py"
        shutil.copy(PROBE, probe)
        probe.chmod(0o644)
        self.probe = str(probe)
        program = inst.dir / "probe.sh"
        program.write_text(f'#!/bin/sh\necho "cvd $CUDA_VISIBLE_DEVICES"\nunset CUDA_VISIBLE_DEVICES\n'
                           f'exec {inst.world.python} -I {probe} "$@"\n')
        inst.wrap("probe", program)
        self.configure(nodes)
        self.service: Optional[subprocess.Popen] = None
        self.served: List[int] = []  # the pids of every service started: its run cgroups bear it

    def mknod(self, name: str, minor: int) -> None:
        """A node made whole, then moved in (the watch sees it at once: made in place, its
        mode before the chmod, 0666 less the umask, would be what is kept)."""
        os.mknod(self.inst.dir / name, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
        os.chmod(self.inst.dir / name, 0o666)
        os.rename(self.inst.dir / name, self.dev / name)

    def configure(self, nodes: str) -> None:
        self.inst.write_config(f'[confine]\nnodes = "{nodes}"\ndev = "{self.dev}"\nproc = "{self.proc}"\n{self.extra}')

    def states(self) -> Dict[str, tuple]:
        return {p: node_state(p) for p in self.nodes()}

    def nodes(self) -> List[str]:
        return [str(self.dev / f"nvidia{m}") for m in range(4)] + [str(self.dev / "nvidiactl")]

    def serve(self) -> subprocess.CompletedProcess:
        """Start the service; the result of one that did not start."""
        inst = self.inst
        self.service = inst.start(None, inst.world.python, "-I", "-c", cli_code(inst.path), "serve")
        self.served.append(self.service.pid)
        said = b""
        while True:  # lines before it: the nodes put back
            line = self.service.stdout.readline()
            said += line
            if b"listening on" in line:
                return subprocess.CompletedProcess([], 0, said, b"")
            if not line:
                break
        out, err = self.service.communicate(timeout=30)
        done = subprocess.CompletedProcess([], self.service.returncode, said + out, err)
        self.service = None
        return done

    def stop(self, kill: bool = False) -> None:
        assert self.service is not None
        self.service.kill() if kill else self.service.terminate()
        self.service.wait(timeout=10)
        self.service = None

    def opens(self, user, *argv: str) -> Dict[str, str]:
        """What USER's own process (no cudawrap) gets opening each node."""
        done = self.inst.run(user, self.inst.world.python, "-I", self.probe, "here", *argv, *self.nodes())
        assert done.returncode == 0, done.stderr.decode()
        return dict(line.rsplit(" ", 1) for line in done.stdout.decode().splitlines())

    def gpus_opened(self, got: Dict[str, str]) -> List[int]:
        return [m for m in range(4) if got[str(self.dev / f"nvidia{m}")] == "ENXIO"]

    def close(self) -> None:
        if self.service is not None:
            self.stop()


@pytest.fixture
def leased(mu) -> Iterator:
    made: List[Leased] = []

    def make(*args, topology: str = "four-gpus", **kwargs) -> Leased:
        made.append(Leased(mu(topology), *args, **kwargs))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_no_lease_no_gpu_and_a_lessee_opens_only_what_it_holds_while_it_holds_it(leased) -> None:
    c = leased()
    inst, world = c.inst, c.inst.world
    assert c.serve().returncode == 0
    closed = c.states()
    for m in range(4):
        assert closed[str(c.dev / f"nvidia{m}")] == (0, 0, 0o660, None)
    assert closed[str(c.dev / "nvidiactl")] == c.before[str(c.dev / "nvidiactl")]  # left open
    # Bob's own program, and the real program run directly: no GPU, nvidiactl as before.
    got = c.opens(world.bob)
    assert c.gpus_opened(got) == [] and got[str(c.dev / "nvidiactl")] == "ENXIO"
    assert set(got[n] for n in c.nodes()[:4]) == {"EACCES"}
    direct = inst.run(world.bob, str(inst.bindir / "CUDAWRAP_probe"), "here", *c.nodes())
    assert [line for line in direct.stdout.decode().splitlines() if "ENXIO" in line] == [f"{c.dev}/nvidiactl ENXIO"]
    # Alice's run holds a GPU: it opens that node; her other process too, Bob's still none.
    go = inst.dir / "go"
    run = inst.start(world.alice, "probe", "--after", str(go), "here", *c.nodes())
    cvd = first_line(run)  # her program runs: every entry was set before its grant went out
    acl = {p: nodemodes.read_acl(p) for p in c.nodes()[:4]}
    [own_node] = [p for p, a in acl.items() if a]
    own = int(own_node[len(str(c.dev / "nvidia")):])
    assert posixacl.users(acl[own_node]) == [world.alice.uid]
    assert c.gpus_opened(c.opens(world.alice)) == [own]
    assert c.gpus_opened(c.opens(world.bob)) == []
    go.touch()
    out, err = run.communicate(timeout=30)
    assert run.returncode == 0, err.decode()
    assert MINORS[inst.machine.gpu_uuids().index(cvd.split()[1])] == own
    assert c.gpus_opened(dict(line.rsplit(" ", 1) for line in out.decode().splitlines())) == [own]
    # The lease has ended: her other process opens it no more.
    wait_for(lambda: nodemodes.read_acl(own_node) is None, what="alice's ACL entry removed")
    assert c.gpus_opened(c.opens(world.alice)) == []
    # A stop leaves them closed ("leased": no lease, no GPU while no service runs) ...
    c.stop()
    assert c.states() == closed
    # ... and a start with "open" puts each back exactly: mode, owner, ACL.
    c.configure("open")
    assert c.serve().returncode == 0
    assert c.states() == c.before
    assert not (inst.layout.state_dir / "nodes.saved").exists()


def test_a_stop_with_open_set_and_sync_put_the_nodes_back(leased) -> None:
    c = leased()
    assert c.serve().returncode == 0
    assert c.states() != c.before
    c.configure("open")  # set while it runs: its stop puts them back
    c.stop()
    assert c.states() == c.before
    c.configure("leased")
    assert c.serve().returncode == 0
    c.stop()
    assert c.states() != c.before
    c.configure("open")
    done = c.inst.cli(None, "sync")  # no service runs: sync puts them back
    assert done.returncode == 0, done.stderr.decode()
    assert c.states() == c.before


def test_nodes_made_later_are_closed_and_allow_users_open_every_node(leased) -> None:
    c = leased()
    world = c.inst.world
    c.inst.write_config(c.inst.layout.config_file.read_text() + f'allow_users = [\"{world.carol.name}\"]\n')
    assert c.serve().returncode == 0
    assert c.gpus_opened(c.opens(world.carol)) == [0, 1, 2, 3]
    c.mknod("nvidia7", 7)
    wait_for(lambda: node_state(str(c.dev / "nvidia7"))[2] == 0o660, what="the new node closed")
    assert posixacl.users(nodemodes.read_acl(str(c.dev / "nvidia7"))) == [world.carol.uid]
    os.chmod(c.dev / "nvidia7", 0o666)  # nvidia-modprobe resets it
    wait_for(lambda: node_state(str(c.dev / "nvidia7"))[2] == 0o660, what="the reset node closed again")
    c.stop()
    c.configure("open")
    assert c.serve().returncode == 0
    assert node_state(str(c.dev / "nvidia7")) == (0, 0, 0o666, None)


def _open_grants(layout) -> Dict[str, dict]:  # type: ignore[no-untyped-def]
    """The grants the ledger's state holds open (those a restarted service follows again)."""
    with ledgerfile.Locked(layout):
        return ledger.load_state(layout.state_dir / ledgerfile.STATE)["open"]


def _forget_grants(layout, pid: int) -> None:  # type: ignore[no-untyped-def]
    """PID's grants out of the ledger's state and its records: as after a crash between a
    grant's send and its record (the ledger's writes come in the loop's turns)."""
    path = layout.state_dir / ledgerfile.STATE
    with ledgerfile.Locked(layout):
        state = ledger.load_state(path)
        ids = {k for k, r in state["open"].items() if r.get("pid") == pid}
        state["open"] = {k: r for k, r in state["open"].items() if k not in ids}
        ledger.save_state(path, state)
        records = ledgerfile.ledger_path(layout)
        kept = [line for line in records.read_bytes().splitlines(keepends=True)
                if not any(f'"{i}"'.encode() in line for i in ids)]
        records.write_bytes(b"".join(kept))


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "record-lost"])
def test_a_service_killed_then_restarted_sets_the_acls_to_the_leases_held(leased, recorded: bool) -> None:
    """SIGKILL while Alice's run holds a GPU: the nodes stay closed, hers open to her; an entry
    added meanwhile for Bob (a grant that never went out before a crash) is gone at the next
    start, Alice's kept, and removed once her run ends, before her exit is reaped: whether the
    ledger had her grant (followed again) or the crash came before its record (a lock no grant
    follows, kept open to her while she lives, closed at her exit)."""
    c = leased()
    inst, world = c.inst, c.inst.world
    assert c.serve().returncode == 0
    go = inst.dir / "go"
    run = inst.start(world.alice, "probe", "--after", str(go), "here", *c.nodes())
    first_line(run)  # her grant went out: she holds the lease (killed before, she would not yet)
    [own_node] = [p for p in c.nodes()[:4] if nodemodes.read_acl(p)]
    wait_for(lambda: any(r.get("pid") == run.pid for r in _open_grants(inst.layout).values()),
             what="her grant in the ledger's state")
    c.stop(kill=True)
    if not recorded:
        _forget_grants(inst.layout, run.pid)
    assert c.gpus_opened(c.opens(world.bob)) == []
    other = next(p for p in c.nodes()[:4] if p != own_node)
    nodemodes.close(other, [world.bob.uid])
    assert c.serve().returncode == 0
    assert nodemodes.read_acl(other) is None
    assert posixacl.users(nodemodes.read_acl(own_node)) == [world.alice.uid]
    go.touch()
    # Not reaped yet: a zombie's /proc entry stands, as it does until its parent waits for it.
    wait_for(lambda: _zombie(run.pid), what="her run exited")
    wait_for(lambda: nodemodes.read_acl(own_node) is None, what="alice's entry removed after the restart")
    run.communicate(timeout=30)
    c.stop()
    c.configure("open")
    assert c.serve().returncode == 0
    assert c.states() == c.before


def _zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize("params,starts", [
    ("DeviceFileUID: 0\nDeviceFileGID: 0\nDeviceFileMode: 438\nModifyDeviceFiles: 1\n", False),
    ("DeviceFileUID: 0\nDeviceFileGID: 44\nDeviceFileMode: 432\nModifyDeviceFiles: 1\n", False),
    ("DeviceFileUID: 0\nDeviceFileGID: 0\nDeviceFileMode: 432\nModifyDeviceFiles: 1\n", True),
    ("DeviceFileUID: 0\nDeviceFileGID: 0\nDeviceFileMode: 438\nModifyDeviceFiles: 0\n", True),
], ids=["0666", "gid44", "0660", "unmodified"])
def test_the_drivers_node_parameters_must_keep_the_nodes_closed(leased, params: str, starts: bool) -> None:
    c = leased(params)
    done = c.serve()
    if starts:
        assert done.returncode == 0
        assert c.states()[str(c.dev / "nvidia0")] == (0, 0, 0o660, None)
        return
    err = done.stderr.decode()
    assert done.returncode != 0 and "Traceback" not in err
    assert '[confine] nodes = "leased", but the NVIDIA driver makes its nodes with DeviceFileMode=' in err, err
    assert "options nvidia NVreg_DeviceFileMode=0660 NVreg_DeviceFileUID=0 NVreg_DeviceFileGID=0" in err
    assert c.states() == c.before


def test_a_node_directory_without_acls_refuses_the_start(leased) -> None:
    c = leased()
    inst = c.inst
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
            f'mount -t ramfs ramfs {c.dev} && mknod {c.dev}/nvidia0 c 195 0 && chmod 666 {c.dev}/nvidia0 '
            f'&& exec "$@"', "sh", inst.world.python, "-I", "-c", cli_code(inst.path), "serve"]
    done = inst.run(None, *argv)
    err = done.stderr.decode()
    assert done.returncode != 0, err
    assert f'[confine] nodes = "leased", but {c.dev} has no POSIX ACLs' in err, err
    assert "Traceback" not in err


def test_a_mig_lessee_gets_its_parent_and_its_own_capabilities_only(leased) -> None:
    """A MIG instance's run: its user's entry on the parent GPU's node and on that instance's
    GI and CI access capabilities; the other instances' capabilities stay closed, the config and
    monitor capabilities as they were."""
    from support.confine import free_char_major

    c = leased(topology="a100-mig7")
    inst, world = c.inst, c.inst.world
    caps = free_char_major()
    table = {"config": 1, "monitor": 2}
    for gi in range(7, 14):
        table[f"gpu2/gi{gi}/access"] = 10 + 2 * gi  # the A100's node minor is 2 (MINORS[0])
        table[f"gpu2/gi{gi}/ci0/access"] = 11 + 2 * gi
    (c.proc / "driver/nvidia-caps").mkdir(parents=True)
    (c.proc / "devices").write_text(f"Character devices:\n195 nvidia\n{caps} nvidia-caps\n\nBlock devices:\n")
    (c.proc / "driver/nvidia-caps/mig-minors").write_text("".join(f"{k} {v}\n" for k, v in table.items()))
    (c.dev / "nvidia-caps").mkdir(mode=0o755)
    cap = {minor: str(c.dev / "nvidia-caps" / f"nvidia-cap{minor}") for minor in table.values()}
    for minor, path in cap.items():
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(caps, minor))
        os.chmod(path, 0o666)
    assert c.serve().returncode == 0
    assert {m: node_state(p)[2] for m, p in cap.items()} == {m: 0o666 if m < 3 else 0o660 for m in cap}
    go = inst.dir / "go"
    run = inst.start(world.alice, "probe", "--after", str(go), "here", *cap.values())
    cvd = first_line(run)  # her program runs: every entry was set before its grant went out
    assert nodemodes.read_acl(str(c.dev / "nvidia2"))
    opened = {m for m, p in cap.items() if nodemodes.read_acl(p)}
    assert len(opened) == 2
    gi = (min(opened) - 10) // 2
    assert opened == {table[f"gpu2/gi{gi}/access"], table[f"gpu2/gi{gi}/ci0/access"]}
    go.touch()
    out, _ = run.communicate(timeout=30)
    got = dict(line.rsplit(" ", 1) for line in out.decode().splitlines())
    assert {m for m, p in cap.items() if got[p] == "ENXIO"} == opened | {1, 2}
    assert uuid_gi(inst, cvd.split()[1]) == gi
    wait_for(lambda: not any(nodemodes.read_acl(p) for p in cap.values()), what="alice's entries removed")
    c.stop()
    c.configure("open")
    assert c.serve().returncode == 0
    assert {node_state(p) for p in cap.values()} == {(0, 0, 0o666, None)}


def uuid_gi(inst: MuInstall, uuid: str) -> int:
    return int(next(f for f in inst.machine.read().split("\n") if uuid in f).split(" gi=")[1].split()[0])


BURST = 500  # runs a mechanism


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_after_a_burst_of_runs_nothing_is_left_but_the_runs_still_going(leased, kind: str) -> None:
    """BURST runs a mechanism (1000 in all, issue 52), 8 at once, under runs = true and
    nodes = "leased": plain runs,
    runs killed with -9, runs leaving a daemon behind, and the service SIGKILLed half-way and
    started again. Once they are over, no run cgroup of either service holds a process or is
    left but the still-going run's and the spare made ahead, none at all once the service has
    stopped, and no node has an ACL entry but the still-going run's."""
    import random
    import signal
    import time

    from cudawrap.base import cgroup

    c = leased(extra=f'runs = true\ncgroup = "{kind}"\n')
    inst, world = c.inst, c.inst.world
    mech = cgroup.choose(kind)
    lingerer = inst.dir / "linger.sh"
    # Its daemon closes every descriptor (the lease's too): the run's end is read at its own
    # exit, with the daemon still in its cgroup for 0.3 s.
    lingerer.write_text(f"#!/bin/sh\nsetsid {world.python} -I -c 'import os, time; os.closerange(3, 4096); "
                        "time.sleep(0.3)' </dev/null >/dev/null 2>&1 &\nexit 0\n")
    inst.wrap("linger", lingerer)
    hold = inst.dir / "hold"

    def ours() -> List[str]:
        return run_cgroups(mech, by=c.served)

    assert c.serve().returncode == 0
    rng = random.Random(52)
    running: List[subprocess.Popen] = []
    kinds = ["plain", "kill", "linger"]
    for n in range(BURST):
        if n == BURST // 2:
            c.stop(kill=True)
            assert c.serve().returncode == 0
        what = rng.choice(kinds)
        user = (world.alice, world.bob, world.carol)[n % 3]
        if what == "linger":
            running.append(inst.start(user, "linger"))
        elif what == "kill":
            p = inst.start(user, "probe", "--after", str(hold), "here", *c.nodes())
            time.sleep(rng.random() * 0.2)
            p.send_signal(signal.SIGKILL)
            running.append(p)
        else:
            running.append(inst.start(user, "probe", "here", *c.nodes()))
        while sum(p.poll() is None for p in running) >= 8:
            time.sleep(0.01)
    for p in running:
        p.communicate(timeout=120)
    # One run still going, then one that leaves a daemon behind as it ends: nothing comes to the
    # service after its daemon's exit, yet its cgroup goes then (the service does not wait for
    # another run's end to remove it).
    going = inst.start(world.alice, "probe", "--after", str(hold), "here", *c.nodes())
    first_line(going)  # its grant went out: its node is open to alice
    done = inst.run(world.bob, "linger")
    assert done.returncode == 0, done.stderr.decode()

    def left() -> List[str]:
        return [p for p in ours() if mech.pids(p) and not any(q == going.pid for q in mech.pids(p))]

    wait_for(lambda: not left() and len([p for p in ours() if not mech.pids(p)]) <= 1,
             what="no run cgroup left but the going run's and the spare",
             details=lambda: str({p: [(q, open(f"/proc/{q}/cmdline").read()) for q in mech.pids(p)] for p in ours()}))
    acls = {p: nodemodes.read_acl(p) for p in c.nodes()[:4]}
    assert [posixacl.users(a) for a in acls.values() if a] == [[world.alice.uid]], (
        acls, going.poll(), going.poll() is not None and going.communicate(), inst.status(None))
    hold.touch()
    going.communicate(timeout=30)
    wait_for(lambda: not any(nodemodes.read_acl(p) for p in c.nodes()[:4]), what="every ACL entry gone")
    c.stop()
    wait_for(lambda: not ours(), what="every run cgroup gone", details=lambda: str(ours()))
