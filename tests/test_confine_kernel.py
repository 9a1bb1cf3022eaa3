"""The kernel confines: a process moved into a run's cgroup opens its own GPU nodes and no other.

Real nodes (mknod, major 195 and a capability major), real cgroups on both mechanisms of
this host (v1 devices controller, v2 BPF device program): an open the kernel lets through
fails ENXIO (no driver), one a cgroup refuses fails EPERM. Each cgroup and node is removed
at teardown, passed or failed (tests/support/confine.py).
"""
from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from cudawrap.base import bpfdev, cgroup, devcgroup_v1
from cudawrap.base.devrule import GPU_MAJOR, Rule, Span, gpu_rule

from support.confine import CAP_MINORS, Cgroups, Nodes, Probe, cgroups, gpu_nodes  # noqa: F401
from support.procs import wait_for

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, mknod)")


def run_rule(nodes: Nodes, gpus=(1,), caps=(1, 2, 3)) -> Rule:
    return gpu_rule(frozenset(gpus), nodes.caps_major, frozenset(caps), caps_high=64)


def all_paths(nodes: Nodes):
    return [nodes.gpu(m) for m in range(4)] + [nodes.ctl] + [nodes.cap(m) for m in CAP_MINORS]


def expected(nodes: Nodes, gpus=(1,), caps=(1, 2, 3)):
    out = {nodes.gpu(m): "ENXIO" if m in gpus else "EPERM" for m in range(4)}
    out[nodes.ctl] = "ENXIO"
    out.update({nodes.cap(m): "ENXIO" if m in caps else "EPERM" for m in CAP_MINORS})
    return out


def run_cgroup(cg: Cgroups, name: str = "run") -> str:
    return cg.mech.make(cg.top, name)


@pytest.mark.parametrize("mode", ["here", "fork", "daemon", "exec"])
def test_a_moved_process_opens_its_own_nodes_only(cgroups: Cgroups, gpu_nodes: Nodes, mode: str) -> None:
    run = run_cgroup(cgroups)
    cgroups.mech.confine(run, run_rule(gpu_nodes))
    probe = Probe(mode, all_paths(gpu_nodes))
    cgroups.mech.move(run, probe.pid)
    assert probe.results() == expected(gpu_nodes)


def test_outside_the_cgroup_every_node_opens(cgroups: Cgroups, gpu_nodes: Nodes) -> None:
    """The control: the same probe, not moved, reaches every driver (ENXIO), so EPERM above is the cgroup's."""
    run = run_cgroup(cgroups)
    cgroups.mech.confine(run, run_rule(gpu_nodes))
    assert set(Probe("here", all_paths(gpu_nodes)).results().values()) == {"ENXIO"}


def test_narrowing_again_closes_a_node_to_a_process_already_inside(cgroups: Cgroups, gpu_nodes: Nodes) -> None:
    run = run_cgroup(cgroups)
    cgroups.mech.confine(run, run_rule(gpu_nodes, gpus=(1, 2)))
    probe = Probe("here", all_paths(gpu_nodes))
    cgroups.mech.move(run, probe.pid)
    cgroups.mech.confine(run, run_rule(gpu_nodes, gpus=(2,), caps=(1, 2)))
    assert probe.results() == expected(gpu_nodes, gpus=(2,), caps=(1, 2))
    if isinstance(cgroups.mech, cgroup.V2):  # the program it replaced is gone, not piled up (the kernel keeps 64)
        assert len(bpfdev.attached(cgroups.mech._abs(run)).prog_ids) == 1


def test_the_services_way_widening_and_narrowing_from_the_rule_before(cgroups: Cgroups, gpu_nodes: Nodes) -> None:
    """As the service confines: the rule it last applied given, so that only what differs is
    written (v1) or the program is replaced by descriptor (v2, its programs kept loaded)."""
    mech = cgroups.mech
    run = run_cgroup(cgroups)
    steps = [((), ()), ((1,), (1, 2, 3)), ((), ()), ((2, 3), (4, 5)), ((2,), (4,)), ((1,), (1, 2, 3))]
    before = None
    for gpus, caps in steps:
        rule = run_rule(gpu_nodes, gpus, caps)
        mech.confine(run, rule, before)
        before = rule
        probe = Probe("here", all_paths(gpu_nodes))
        mech.move(run, probe.pid)
        assert probe.results() == expected(gpu_nodes, gpus, caps), (gpus, caps)
        if isinstance(mech, cgroup.V2):
            assert len(bpfdev.attached(mech._abs(run)).prog_ids) == 1
    if isinstance(mech, cgroup.V2):
        # Not as it left it (a replace that failed half-way, a restart): confined whole, its
        # program already attached kept, every other detached.
        other = run_rule(gpu_nodes, (3,), (6,))
        mech.confine(run, other, before)
        fd = os.open(mech._abs(run), os.O_RDONLY | os.O_DIRECTORY)
        try:  # a second program beside it, BEFORE's loaded afresh (not the one mech keeps)
            bpfdev.attach(fd, before, bpfdev.BPF_F_ALLOW_MULTI, run)
        finally:
            os.close(fd)
        assert len(bpfdev.attached(mech._abs(run)).prog_ids) == 2
        mech.confine(run, other, before)  # its BEFORE is not the one there, and OTHER's is there already
        assert len(bpfdev.attached(mech._abs(run)).prog_ids) == 1
        probe = Probe("here", all_paths(gpu_nodes))
        mech.move(run, probe.pid)
        assert probe.results() == expected(gpu_nodes, (3,), (6,))


@pytest.mark.parametrize("cgroups", ["v2"], indirect=True)  # v1 loads no program
def test_v2_keeps_a_bounded_number_of_programs_loaded(cgroups: Cgroups, gpu_nodes: Nodes, monkeypatch) -> None:
    monkeypatch.setattr(cgroups.mech, "KEPT", 3)
    run = run_cgroup(cgroups)
    before = None
    for gpu in range(6):
        rule = run_rule(gpu_nodes, (gpu % 4,), (gpu,))
        cgroups.mech.confine(run, rule, before)
        before = rule
    assert len(cgroups.mech.programs) == 3 and not cgroups.mech.using
    probe = Probe("here", all_paths(gpu_nodes))
    cgroups.mech.move(run, probe.pid)
    assert probe.results() == expected(gpu_nodes, (1,), (5,))


def test_a_child_cgroup_never_widens_its_parents_refusal(cgroups: Cgroups, gpu_nodes: Nodes) -> None:
    """A run's cgroup below one that refuses GPU 1 (a parent run, an admin's cgroup) allows GPU 1:
    the kernel still refuses it (v1 copies the parent's list; v2 runs both programs)."""
    outer = run_cgroup(cgroups, "outer")
    cgroups.mech.confine(outer, run_rule(gpu_nodes, gpus=(0, 2)))
    inner = cgroups.mech.make(outer, "inner")
    cgroups.mech.confine(inner, run_rule(gpu_nodes, gpus=(1, 2)))
    probe = Probe("here", all_paths(gpu_nodes))
    cgroups.mech.move(inner, probe.pid)
    assert probe.results() == expected(gpu_nodes, gpus=(2,))


@pytest.mark.parametrize("flags,why", [(bpfdev.BPF_F_ALLOW_OVERRIDE, "BPF_F_ALLOW_OVERRIDE"), (0, "no flag")])
def test_v2_refuses_to_attach_below_a_program_it_would_override_or_that_forbids_it(
        gpu_nodes: Nodes, flags: int, why: str) -> None:
    mech = cgroup.choose("v2")
    top = os.path.join(mech.parent_of(os.getpid()), f"cudawrap-test-{os.getpid()}")
    from support.confine import teardown
    try:
        mech.make(*os.path.split(top))
        fd = os.open(mech._abs(top), os.O_RDONLY | os.O_DIRECTORY)
        try:
            bpfdev.attach(fd, run_rule(gpu_nodes, gpus=()), flags, top)
        finally:
            os.close(fd)
        run = mech.make(top, "run")
        with pytest.raises(cgroup.CgroupError, match=why) as e:
            mech.confine(run, run_rule(gpu_nodes))
        assert e.value.errno == errno.EPERM and "cannot confine" in str(e.value)
        assert bpfdev.attached(mech._abs(run)).prog_ids == ()
    finally:
        teardown(mech, top)


def test_v1_refuses_below_a_cgroup_that_allows_by_list(gpu_nodes: Nodes) -> None:
    mech = cgroup.choose("v1")
    top = os.path.join(mech.parent_of(os.getpid()), f"cudawrap-test-{os.getpid()}")
    from support.confine import teardown
    try:
        mech.make(*os.path.split(top))
        devices = os.path.join(mech.devices, top.lstrip("/"))
        with open(os.path.join(devices, "devices.deny"), "w") as f:
            f.write("a")
        with open(os.path.join(devices, "devices.allow"), "w") as f:
            f.write("c *:* rwm")
        run = mech.make(top, "run")
        with pytest.raises(cgroup.CgroupError, match="allows devices by a list"):
            mech.confine(run, run_rule(gpu_nodes))
    finally:
        teardown(mech, top)


def test_kill_ends_every_process_of_the_run_daemons_included_and_then_it_goes(cgroups: Cgroups) -> None:
    mech = cgroups.mech
    run = run_cgroup(cgroups)
    # A shell that daemonizes a sleeper (setsid, its parent gone) and waits itself.
    proc = subprocess.Popen(["sh", "-c", "read go; setsid sh -c 'sleep 300 & exit' ; sleep 300"],
                            stdin=subprocess.PIPE, text=True)
    mech.move(run, proc.pid)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    wait_for(lambda: len(mech.pids(run)) >= 3, what="the run's sleepers")
    assert mech.remove(run) is False  # populated: EBUSY, left as it is
    mech.kill(run)
    proc.wait(timeout=10)
    wait_for(lambda: not mech.pids(run), what="every process of the run gone")
    assert mech.remove(run) is True
    assert all(not os.path.exists(os.path.join(r, run.lstrip("/"))) for r in mech.roots)


def test_moving_a_process_that_is_gone_says_so(cgroups: Cgroups) -> None:
    run = run_cgroup(cgroups)
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(cgroup.CgroupError, match=f"process {proc.pid} is gone"):
        cgroups.mech.move(run, proc.pid)


# Pure: the rule, the program, the v1 lines, the mounts.

def test_the_rule_refuses_gpus_and_capabilities_but_its_own() -> None:
    rule = gpu_rule(frozenset({2}), 240, frozenset({1, 2, 7}), caps_high=100)
    assert [m for m in range(256) if not rule.refuses(GPU_MAJOR, m)] == [2, 254, 255]
    assert [m for m in range(101) if not rule.refuses(240, m)] == [1, 2, 7]
    assert not rule.refuses(10, 200) and not rule.refuses(241, 0)
    assert gpu_rule(frozenset()).refused == (Span(GPU_MAJOR, 0, 253),)


def test_v1_lines_refuse_minor_by_minor_and_a_whole_major_only_without_holes() -> None:
    deny, allow = devcgroup_v1.lines(gpu_rule(frozenset({3}), 240, frozenset({1}), caps_high=9))
    assert len(deny) == 253 + 9 and "c 195:3 rwm" not in deny and "c 195:253 rwm" in deny
    assert allow == ["c 195:3 rwm", "c 240:1 rwm"]
    assert devcgroup_v1.lines(gpu_rule(frozenset(), 240))[0][-1] == "c 240:* rwm"
    with pytest.raises(devcgroup_v1.DevicesError, match="cannot refuse all of major 240 but"):
        devcgroup_v1.lines(gpu_rule(frozenset(), 240, frozenset({1})))


def test_v1_changes_from_the_holes_are_the_lines_that_differ() -> None:
    def by_lines(before: Rule, after: Rule):
        (old_deny, old_allow), (deny, allow) = devcgroup_v1.lines(before), devcgroup_v1.lines(after)
        return set(deny) - set(old_deny), (set(allow) - set(old_allow)) | (set(old_deny) - set(deny))

    rules = [gpu_rule(frozenset(g), 240, frozenset(c), caps_high=4400)
             for g, c in [((), ()), ((1,), (1, 2, 3)), ((1, 2), (2, 3, 4400)), ((253,), (0,)), ((0, 7), ())]]
    rules.append(gpu_rule(frozenset({1, 5}), 240, frozenset({9}), caps_high=30))  # another span: by the lines
    for before in rules:
        for after in rules:
            deny, allow = devcgroup_v1.changes(before, after)
            assert (set(deny), set(allow)) == by_lines(before, after), (before, after)
            assert len(deny) == len(set(deny))


def test_the_program_is_what_the_verifier_loads() -> None:
    code = bpfdev.assemble(gpu_rule(frozenset({0, 5}), 240, frozenset({1}), caps_high=4351))
    assert len(code) % 8 == 0
    os.close(bpfdev.load(gpu_rule(frozenset({0, 5}), 240, frozenset({1}), caps_high=4351)))


def test_mounts_reads_both_hierarchies(tmp_path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "30 25 0:26 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw\n"
        "31 25 0:27 / /sys/fs/cgroup/devices rw,nosuid shared:10 - cgroup cgroup rw,devices\n"
        "32 25 0:28 / /sys/fs/cgroup/freezer rw - cgroup cgroup rw,freezer\n"
        "33 25 0:28 / /mnt/again rw - cgroup cgroup rw,freezer\n")
    assert cgroup.mounts(str(info)) == {"unified": "/sys/fs/cgroup/unified", "devices": "/sys/fs/cgroup/devices", "freezer": "/sys/fs/cgroup/freezer"}
    assert isinstance(cgroup.choose("auto", cgroup.mounts(str(info))), cgroup.V1)
    with pytest.raises(cgroup.CgroupError, match="no cgroup v1 devices and freezer controller"):
        cgroup.choose("v1", {"unified": "/u"})
