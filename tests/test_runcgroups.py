"""The service's run cgroups (confine/cgroups.py) against the real kernel: where a run's cgroup
goes, how it narrows when a grant is void or ends, when it goes, and a restart's reconcile.

Each test's cgroups live below a test parent removed at teardown (support/confine.py); the
devices' node minors come from the stand-in NVML, as the service reads them.
"""
from __future__ import annotations

import os
import select
import subprocess

import pytest

from cudawrap.base import cgroup
from cudawrap.confine.cgroups import RUN_PREFIX, RunCgroups, install_tag
from support.confine import Cgroups, Nodes, Probe, cgroups, gpu_nodes, run_cgroups  # noqa: F401
from support.procs import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, mknod)")


@pytest.fixture
def gpus(machine, monkeypatch):
    fake = machine("four-gpus")
    fake.activate(monkeypatch)
    return fake.gpu_uuids()  # node minors 0..3, their indices


def service(cg: Cgroups, tmp_path) -> RunCgroups:
    said = []
    rc = RunCgroups(cg.mech, str(tmp_path), install_tag(str(tmp_path)), said.append)
    rc.said = said  # type: ignore[attr-defined]
    return rc


def placed(cg: Cgroups, *argv: str) -> subprocess.Popen:
    """A process of the test's, moved into the test parent (its run cgroup then goes below it)."""
    proc = subprocess.Popen(argv or ["sleep", "60"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    cg.mech.move(cg.top, proc.pid)
    return proc


def probe_in(cg: Cgroups, nodes: Nodes) -> Probe:
    probe = Probe("here", [nodes.gpu(m) for m in range(4)])
    cg.mech.move(cg.top, probe.pid)
    return probe


def opened(nodes: Nodes, results):
    return [m for m in range(4) if results[nodes.gpu(m)] == "ENXIO"]


def test_a_void_grant_narrows_the_run_to_what_it_still_holds(cgroups: Cgroups, gpu_nodes: Nodes, gpus, tmp_path):
    rc = service(cgroups, tmp_path)
    probe = probe_in(cgroups, gpu_nodes)
    rc.enter(probe.pid, 0)
    assert rc.allow(probe.pid, [gpus[1], gpus[3]])  # two grants sent
    assert rc.allow(probe.pid, [gpus[3]])  # one of them void
    assert opened(gpu_nodes, probe.results()) == [3]


def test_before_any_grant_the_run_opens_no_gpu(cgroups: Cgroups, gpu_nodes: Nodes, gpus, tmp_path):
    rc = service(cgroups, tmp_path)
    probe = probe_in(cgroups, gpu_nodes)
    rc.enter(probe.pid, 0)
    rc._settled(probe.pid)
    assert opened(gpu_nodes, probe.results()) == []


def test_an_ended_run_s_cgroup_goes_once_empty_and_not_before(cgroups: Cgroups, gpus, tmp_path):
    rc = service(cgroups, tmp_path)
    run = placed(cgroups)
    rc.enter(run.pid, 0)
    assert rc.allow(run.pid, [gpus[0]])
    path = rc.runs[run.pid]
    child = subprocess.Popen(["sleep", "60"])  # a leftover: moved in as a run's child would be
    cgroups.mech.move(path, child.pid)
    run.kill()
    run.wait()
    assert rc.allow(run.pid, [])  # its grant ended
    assert os.path.isdir(os.path.join(cgroups.mech.roots[0], path.lstrip("/")))  # the leftover is there
    assert not select.select([rc.fileno()], [], [], 0.2)[0]  # nothing to do while it runs
    child.kill()
    child.wait()
    # Its exit is what the service's loop wakes for (no poll, no other run's end): then it goes.
    assert select.select([rc.fileno()], [], [], 10)[0]
    rc.emptied()
    assert not any(os.path.exists(os.path.join(r, path.lstrip("/"))) for r in cgroups.mech.roots)
    assert run.pid not in rc.runs
    assert not select.select([rc.fileno()], [], [], 0)[0]


def test_a_stop_removes_every_empty_cgroup_of_its_install_before_it_returns(cgroups: Cgroups, gpus, tmp_path):
    """Spares, an ended run's whose leftover has just exited (its exit not yet read), and one a
    killed service left behind go at the stop; a held run's, with its process, stays."""
    mech = cgroups.mech
    stale = mech.make(cgroups.top, f"{RUN_PREFIX}{install_tag(str(tmp_path))}-999999-7")  # a crashed service's
    rc = service(cgroups, tmp_path)
    ended, held = placed(cgroups), placed(cgroups)
    for proc, uuid in ((ended, gpus[0]), (held, gpus[1])):
        rc.enter(proc.pid, 0)
        assert rc.allow(proc.pid, [uuid])
    rc.worker.submit(lambda: None).result()
    spare = rc.spares[cgroups.top][0]
    ended_path, held_path = rc.runs[ended.pid], rc.runs[held.pid]
    ended.kill()
    ended.wait()
    rc.close()
    exists = lambda path: any(os.path.exists(os.path.join(r, path.lstrip("/"))) for r in mech.roots)  # noqa: E731
    assert [exists(p) for p in (stale, spare, ended_path, held_path)] == [False, False, False, True]
    held.kill()
    held.wait()


def test_a_stop_lets_a_waiting_client_out_and_keeps_a_holder_in(cgroups: Cgroups, gpus, tmp_path):
    """A client still waiting for its decision at the stop goes back where it came from (it
    may go on without the service, root deciding for itself, and must then open what it
    takes); its cgroup goes. A run that holds a GPU stays in its own, confined."""
    mech = cgroups.mech
    rc = service(cgroups, tmp_path)
    waiting, held = placed(cgroups), placed(cgroups)
    rc.enter(waiting.pid, 0)
    rc.enter(held.pid, 0)
    assert rc.allow(held.pid, [gpus[1]])
    waiting_path = rc._settled(waiting.pid)
    assert mech.parent_of(waiting.pid) == waiting_path
    assert rc.allow(waiting.pid, [])  # the stop drops its connection first (Grants.gone)
    rc.close()
    assert mech.parent_of(waiting.pid) == cgroups.top
    assert mech.parent_of(held.pid) == rc.runs[held.pid]
    assert not any(os.path.exists(os.path.join(r, waiting_path.lstrip("/"))) for r in mech.roots)
    for proc in (waiting, held):
        proc.kill()
        proc.wait()


def test_a_nested_run_goes_beside_its_parent_run(cgroups: Cgroups, gpus, tmp_path):
    rc = service(cgroups, tmp_path)
    outer = placed(cgroups)
    rc.enter(outer.pid, 0)
    assert rc.allow(outer.pid, [gpus[0]])
    inner = subprocess.Popen(["sleep", "60"])
    cgroups.mech.move(rc.runs[outer.pid], inner.pid)  # started by the outer run
    rc.enter(inner.pid, 0)
    assert rc.allow(inner.pid, [gpus[1]])
    assert os.path.dirname(rc.runs[inner.pid]) == cgroups.top == os.path.dirname(rc.runs[outer.pid])
    for p in (outer, inner):
        p.kill()
        p.wait()


def test_never_below_a_cgroup_the_user_can_write(cgroups: Cgroups, gpus, tmp_path, mu_world):
    """A run in a cgroup its user owns (a delegated subtree) gets its run cgroup above it:
    there the user could move it out again."""
    user = mu_world.alice
    mine = cgroups.mech.make(cgroups.top, "delegated")
    for root in cgroups.mech.roots:
        where = os.path.join(root, mine.lstrip("/"))
        os.chown(where, user.uid, user.gid)
        os.chown(os.path.join(where, "cgroup.procs"), user.uid, user.gid)
    run = subprocess.Popen(["sleep", "60"])
    cgroups.mech.move(mine, run.pid)
    rc = service(cgroups, tmp_path)
    rc.enter(run.pid, user.uid)
    assert rc.allow(run.pid, [gpus[0]])
    assert os.path.dirname(rc.runs[run.pid]) == cgroups.top
    rc2 = service(cgroups, tmp_path)
    run2 = subprocess.Popen(["sleep", "60"])
    cgroups.mech.move(mine, run2.pid)
    rc2.enter(run2.pid, 0)  # root's process there: the cgroup is not its user's
    assert rc2.allow(run2.pid, [gpus[1]])
    assert os.path.dirname(rc2.runs[run2.pid]) == mine
    for p in (run, run2):
        p.kill()
        p.wait()


def test_a_restart_keeps_held_runs_and_removes_the_others(cgroups: Cgroups, gpu_nodes: Nodes, gpus, tmp_path):
    mech = cgroups.mech
    ours = f"{RUN_PREFIX}{install_tag(str(tmp_path))}-"
    gone = mech.make(cgroups.top, f"{ours}999999-1")  # a run that ended while no service ran
    # Another install's service, on the same host, made this one ahead: not this service's to remove.
    theirs = mech.make(cgroups.top, f"{RUN_PREFIX}{install_tag(str(tmp_path / 'other'))}-999999-1")
    probe = probe_in(cgroups, gpu_nodes)
    held = mech.make(cgroups.top, f"{ours}1-1")
    mech.confine(held, service(cgroups, tmp_path).rule(gpus))  # as wide as a crashed service left it
    mech.move(held, probe.pid)
    rc = service(cgroups, tmp_path)
    rc.reconcile({probe.pid: [gpus[2]]})
    assert not any(os.path.exists(os.path.join(r, gone.lstrip("/"))) for r in mech.roots)
    assert all(os.path.isdir(os.path.join(r, theirs.lstrip("/"))) for r in mech.roots)
    assert rc.runs[probe.pid] == held
    assert opened(gpu_nodes, probe.results()) == [2]


def test_the_next_run_there_takes_a_cgroup_made_ahead(cgroups: Cgroups, gpus, tmp_path):
    """As a run's grant goes out a spare is made below the same place, confined; the next run
    there is moved into it (its entry is then a move alone); a stop or a restart removes a spare."""
    rc = service(cgroups, tmp_path)
    first = placed(cgroups)
    rc.enter(first.pid, 0)
    rc._settled(first.pid)
    rc.worker.submit(lambda: None).result()
    assert cgroups.top not in rc.spares  # not while its decision is made
    assert rc.allow(first.pid, [gpus[1]])  # its grant goes out: the spare is made meanwhile
    rc.worker.submit(lambda: None).result()
    spare = rc.spares[cgroups.top][0]
    assert cgroups.mech.pids(spare) == [] and os.path.dirname(spare) == cgroups.top
    second = placed(cgroups)
    rc.enter(second.pid, 0)
    assert rc.allow(second.pid, [gpus[0]])
    assert rc.runs[second.pid] == spare
    rc.worker.submit(lambda: None).result()
    assert service(cgroups, tmp_path).reconcile({second.pid: [gpus[0]]}) is None
    assert not os.path.exists(os.path.join(cgroups.mech.roots[0], rc.spares[cgroups.top][0].lstrip("/")))
    assert os.path.exists(os.path.join(cgroups.mech.roots[0], spare.lstrip("/")))  # held: kept
    rc3 = service(cgroups, tmp_path)  # the restarted service's
    third = placed(cgroups)
    rc3.enter(third.pid, 0)
    assert rc3.allow(third.pid, [gpus[2]])
    rc3.worker.submit(lambda: None).result()
    last = rc3.spares[cgroups.top][0]
    rc3.close()  # the service stops
    assert not os.path.exists(os.path.join(cgroups.mech.roots[0], last.lstrip("/")))
    third.kill()
    third.wait()
    for p in (first, second):
        p.kill()
        p.wait()


def test_a_pid_that_could_not_be_confined_gets_no_grant(cgroups: Cgroups, gpus, tmp_path):
    rc = service(cgroups, tmp_path)
    proc = subprocess.Popen(["true"])
    proc.wait()
    before = set(run_cgroups(cgroups.mech, by=[os.getpid()]))
    rc.enter(proc.pid, 0)  # gone before it was moved
    assert rc.allow(proc.pid, [gpus[0]]) is False
    assert rc.allow(proc.pid, [gpus[0]]) is False  # nor at a later grant
    assert any("could not be confined" in line for line in rc.said)  # type: ignore[attr-defined]
    assert set(run_cgroups(cgroups.mech, by=[os.getpid()])) == before  # the cgroup made for it is gone


def test_a_process_exiting_is_not_confined_and_leaves_no_cgroup_anywhere(cgroups: Cgroups, gpus, tmp_path):
    """A client killed as it asked: the kernel skips an exiting process when it is written
    into cgroup.procs (the write succeeds), and v1 says it is in "/" meanwhile. It gets no
    grant, and no cgroup is made for it or for the next run at the hierarchy's top."""
    rc = service(cgroups, tmp_path)
    proc = subprocess.Popen(["true"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    before = set(run_cgroups(cgroups.mech, by=[os.getpid()]))
    rc.enter(proc.pid, 0)
    assert rc.allow(proc.pid, [gpus[0]]) is False
    rc.worker.submit(lambda: None).result()
    assert set(run_cgroups(cgroups.mech, by=[os.getpid()])) == before
    assert rc.allow(proc.pid, [gpus[0]]) is False  # refused while its connection lasts
    rc.forget(proc.pid)  # its connection closed: the number may come back as another process
    assert rc.allow(proc.pid, [gpus[0]]) is True  # one that never enters (a Slurm job's client)
    proc.wait()


def test_leftovers_are_ended_through_their_run_cgroup_daemons_and_all(cgroups: Cgroups, gpus, tmp_path):
    """[health] leftover_action = "kill" on a leftover in a run cgroup: the whole cgroup goes,
    a child that daemonized included (a SIGTERM to the leftover's pid would miss it)."""
    from cudawrap.health import leftovers
    from cudawrap.base.proc import start_time

    rc = service(cgroups, tmp_path)
    run = placed(cgroups, "sh", "-c", "read go; setsid sleep 300 & exec sleep 300")
    rc.enter(run.pid, 0)
    assert rc.allow(run.pid, [gpus[0]])
    path = rc.runs[run.pid]
    run.stdin.write("go\n")
    run.stdin.flush()
    wait_for(lambda: len(cgroups.mech.pids(path)) == 2, what="the run and its daemon in its cgroup")
    assert rc.allow(run.pid, [])  # its lease ended: what is left in its cgroup are leftovers
    left = leftovers.Leftover(run.pid, gpus[0], "root", "probe", None, start_time(run.pid), 0.0)
    assert leftovers.end(left)
    run.wait(timeout=10)
    wait_for(lambda: not cgroups.mech.pids(path), what="every leftover gone")


def test_a_leftover_outside_any_run_cgroup_is_not_ended_through_one(cgroups: Cgroups):
    from cudawrap.confine.runkill import kill_run_of
    from cudawrap.base.proc import start_time

    other = placed(cgroups)
    assert kill_run_of(other.pid, start_time(other.pid)) is False
    assert other.poll() is None
    other.kill()
    other.wait()
