"""GPU health: a reset-class XID drains its GPU (and only it), recovery comes after the
condition has been clear for recover_after_s and never before, an admin's drain is kept."""
from __future__ import annotations

import json
import threading
from typing import Any, Dict

import pytest

from support.installed import ready_line
from support.procs import cli_code, wait_for
from test_metrics_file import textfile
from cudawrap.policy.config import DEFAULTS
from cudawrap.sched.drains import drain, drained, health_drained, resume
from cudawrap.health.keeper import DRAINED, HEALTHY, HISTORY, Event, GpuHealth, MonitorHealth, Policy, load, step
from cudawrap.monitor.loop import refresh_once

POLICY = Policy.from_config(DEFAULTS)


def quick(recover_after_s: float = 60.0, unknown: str = "drain") -> Policy:
    return Policy(POLICY.drain_xids, POLICY.ignore_xids, unknown, recover_after_s)


# --- the rules, pure ------------------------------------------------------------------------


@pytest.mark.parametrize("xid,drains", [(79, True), (48, True), (63, True), (64, True), (74, True),
                                        (92, True), (94, True), (95, True), (119, True), (120, True),
                                        (13, False), (31, False), (43, False), (45, False), (68, False)])
def test_xids_are_classified_by_the_catalog(xid: int, drains: bool) -> None:
    gpus: Dict[str, GpuHealth] = {}
    moves = step(gpus, [Event("GPU-a", "xid", xid, 100.0)], {}, 100.0, quick())
    assert [m.to for m in moves] == ([DRAINED] if drains else [])
    assert gpus["GPU-a"].state == (DRAINED if drains else HEALTHY)


def test_an_unknown_xid_follows_unknown_xid() -> None:
    assert step({}, [Event("GPU-a", "xid", 999, 1.0)], {}, 1.0, quick(unknown="drain"))[0].to == DRAINED
    assert step({}, [Event("GPU-a", "xid", 999, 1.0)], {}, 1.0, quick(unknown="ignore")) == []


def test_recovery_waits_for_a_clear_condition_and_a_new_event_restarts_the_clock() -> None:
    gpus: Dict[str, GpuHealth] = {}
    policy = quick(recover_after_s=60)
    (first,) = step(gpus, [Event("GPU-a", "dbe", 0, 1000.0)], {}, 1000.0, policy)
    assert first.reason.startswith("health: double-bit ECC error at ")
    assert step(gpus, [], {"GPU-a": "row remapping pending"}, 1100.0, policy) == []  # persists
    assert step(gpus, [], {}, 1159.0, policy) == []  # clear for 59 s only
    assert step(gpus, [Event("GPU-a", "xid", 48, 1159.5)], {}, 1159.5, policy) == []
    assert step(gpus, [], {}, 1219.0, policy) == []  # the new event counts from 1159.5
    (back,) = step(gpus, [], {}, 1219.5, policy)
    assert back.to == HEALTHY and gpus["GPU-a"].state == HEALTHY


def test_a_storm_keeps_a_bounded_history() -> None:
    gpus: Dict[str, GpuHealth] = {}
    storm = [Event("GPU-a", "xid", 13, float(i)) for i in range(5000)]
    assert step(gpus, storm, {}, 5000.0, quick()) == []
    assert len(gpus["GPU-a"].events) == HISTORY


# --- the monitor on a machine, with real accounts ------------------------------------------


def health_config(inst: Any, text: str) -> None:
    inst.layout.config_file.write_text(text)
    inst.layout.config_file.chmod(0o644)


def ledger_notes(inst: Any) -> list:
    """The ledger's health transitions, in order."""
    from cudawrap.ledger.files import ledger_path, read

    problems: list = []
    found = list(read([ledger_path(inst.layout)], problems, ("health-drain", "health-resume")))
    assert problems == []
    return found


def monitor_cycle(hook: MonitorHealth, inst: Any, now: Any = None) -> list:
    assert refresh_once(inst.layout) is None
    return hook.cycle(now)


def test_xid_79_drains_that_gpu_alone_its_holder_finishes_the_others_keep_serving(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    world, gpus, root = inst.world, inst.machine.gpu_uuids(), str(inst.layout.root)
    recon = inst.wrap()
    hook = MonitorHealth(inst.layout)
    holder = inst.start(world.alice, str(recon), "--hold", "2")
    held = ready_line(holder)["devices"][0]
    inst.machine.inject_event(held, "xid", 79)
    (move,) = monitor_cycle(hook, inst)  # within the cycle that sees it
    assert move.uuid == held and move.to == DRAINED
    reason = drained(root)[held].reason
    assert reason.startswith("health: Xid 79 (GPU has fallen off the bus) at "), reason
    # A burst from two users: the three other GPUs serve; nothing lands on the drained one.
    burst = [inst.start(user, str(recon), "--hold", "30", CUDAWRAP_WAIT="0")
             for user in (world.bob, world.carol, world.bob)]
    got = sorted(ready_line(p)["devices"][0] for p in burst)
    assert got == sorted(u for u in gpus if u != held)
    late = inst.run(world.carol, str(recon), CUDAWRAP_WAIT="0")
    assert late.returncode == 75, late.stderr
    assert holder.wait(timeout=30) == 0  # left to finish
    again = inst.run(world.carol, str(recon), CUDAWRAP_WAIT="0")
    assert again.returncode == 75, again.stderr  # its device is free now, and still drained
    shown = json.loads(inst.cli(world.alice, "health", "--json").stdout)
    row = next(r for r in shown["gpus"] if r["uuid"] == held)
    assert row["state"] == "drained" and row["events"][-1]["what"].startswith("Xid 79")
    assert "recover_after_s" in row["back"]
    text = inst.cli(world.alice, "health").stdout.decode()
    assert "DRAINED (health: Xid 79 (GPU has fallen off the bus)" in text and "back: by itself in" in text
    status = json.loads(inst.cli(world.alice, "status", "--json").stdout)
    assert status["drained"][held]["reason"] == reason
    assert [(n["device"], n["reason"]) for n in ledger_notes(inst)] == [(held, reason)]


def test_the_running_monitor_drains_within_its_cycle_and_says_so_in_the_metrics(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    prom = textfile(inst, 0o755)
    gpus, root = inst.machine.gpu_uuids(), str(inst.layout.root)
    state = inst.layout.runtime_dir / "health.state"
    monitor = inst.start(None, inst.world.python, "-I", "-c",
                         cli_code(inst.path),
                         "monitor", "--period", "0.1")
    wait_for(state.exists, timeout=30)  # it has registered for the GPUs' events
    inst.machine.inject_event(gpus[3], "xid", 79)
    wait_for(lambda: gpus[3] in drained(root), timeout=30)
    wait_for(lambda: f'cudawrap_device_health{{device="{gpus[3]}"' in prom.read_text()
             and any(line.startswith(f'cudawrap_device_health{{device="{gpus[3]}"') and line.endswith(" 0")
                     for line in prom.read_text().splitlines()), timeout=30)
    healthy = [line for line in prom.read_text().splitlines()
               if line.startswith("cudawrap_device_health{") and line.endswith(" 1")]
    assert len(healthy) == 3
    monitor.terminate()
    monitor.wait(timeout=30)


def test_xid_13_changes_nothing(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    recon = inst.wrap()
    hook = MonitorHealth(inst.layout)
    holder = inst.start(inst.world.alice, str(recon), "--hold", "30")
    held = ready_line(holder)["devices"][0]
    inst.machine.inject_event(held, "xid", 13)
    assert monitor_cycle(hook, inst) == []
    assert drained(str(inst.layout.root)) == {}
    (event,) = load(str(inst.layout.root))[0][held].events
    assert event[1] == "Xid 13 (graphics engine exception)" and event[2] is False


def test_recovery_after_the_condition_clears_and_not_before(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    health_config(inst, "[health]\nrecover_after_s = 120\n")
    gpu = inst.machine.gpu_uuids()[2]
    root = str(inst.layout.root)
    hook = MonitorHealth(inst.layout)
    monitor_cycle(hook, inst, 1000.0)  # the monitor knows GPU 2 by index before it is lost
    inst.machine.inject_event(gpu, "xid", 79)
    inst.machine.set_fault("gpu_lost", gpu)
    assert [m.to for m in monitor_cycle(hook, inst, 1001.0)] == [DRAINED]
    # Lost for far longer than recover_after_s: never resumed while it persists.
    for now in (1200.0, 5000.0):
        assert monitor_cycle(hook, inst, now) == []
        assert gpu in health_drained(root)
    assert "lost" in load(root)[0][gpu].condition
    inst.machine.clear_fault("gpu_lost")  # reset: the driver answers for it again
    assert monitor_cycle(hook, inst, 5001.0) == []
    assert monitor_cycle(hook, inst, 5119.0) == []  # clear since 5000: 119 s
    (back,) = monitor_cycle(hook, inst, 5120.0)
    assert back.uuid == gpu and back.to == HEALTHY
    assert drained(root) == {}
    assert [(n["event"], n["device"], n["at"]) for n in ledger_notes(inst)] == \
        [("health-drain", gpu, 1001.0), ("health-resume", gpu, 5120.0)]


def test_an_admins_drain_is_never_lifted_nor_replaced_by_health(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    health_config(inst, "[health]\nrecover_after_s = 10\n")
    gpu = inst.machine.gpu_uuids()[1]
    root = str(inst.layout.root)
    drain(root, [gpu], "fan replacement", "root")
    hook = MonitorHealth(inst.layout)
    inst.machine.inject_event(gpu, "xid", 94)
    assert [m.to for m in monitor_cycle(hook, inst, 100.0)] == [DRAINED]
    assert drained(root)[gpu].reason == "fan replacement"  # the admin's is the one in force
    assert [m.to for m in monitor_cycle(hook, inst, 200.0)] == [HEALTHY]
    assert drained(root)[gpu].reason == "fan replacement" and health_drained(root) == {}
    # The other way round: the admin resumes; the health drain of a new error stays.
    inst.machine.inject_event(gpu, "xid", 95)
    monitor_cycle(hook, inst, 300.0)
    resume(root, [gpu])
    assert drained(root)[gpu].reason.startswith("health: Xid 95 (uncontained ECC error)")


def test_a_drain_of_a_mig_gpu_covers_its_instances(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("a100-mig7")
    recon = inst.wrap()
    hook = MonitorHealth(inst.layout)
    mig = inst.machine.leaf_uuids()[4]
    inst.machine.inject_event(mig, "xid", 48)  # an error in one instance is the board's
    (move,) = monitor_cycle(hook, inst)
    assert move.uuid == inst.machine.gpu_uuids()[0]
    done = inst.run(inst.world.alice, str(recon), CUDAWRAP_WAIT="0")
    assert done.returncode == 75, done.stderr


def test_an_event_storm_neither_blocks_grants_nor_grows_the_history(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    recon = inst.wrap()
    gpus = inst.machine.gpu_uuids()
    hook = MonitorHealth(inst.layout)
    stop = threading.Event()

    def storm() -> None:  # 1000 application errors a second, all on GPU 0
        while not stop.wait(0.001):
            inst.machine.inject_event(gpus[0], "xid", 13)

    thread = threading.Thread(target=storm)
    thread.start()
    try:
        for _ in range(5):
            monitor_cycle(hook, inst)
            done = inst.run(inst.world.bob, str(recon), CUDAWRAP_WAIT="0")
            assert done.returncode == 0, done.stderr
    finally:
        stop.set()
        thread.join()
    monitor_cycle(hook, inst)
    seen = hook.keeper.gpus[gpus[0]]
    assert len(seen.events) == HISTORY and seen.state == HEALTHY
    assert (inst.machine.state_dir / "events").stat().st_size > 40 * HISTORY  # it was a storm


def test_bad_health_settings_are_one_line_and_exit_78(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    for text in ("[health]\nunknown_xid = \"panic\"\n", "[health]\ndrain_xids = [79, \"x\"]\n",
                 "[health]\nrecover_after_s = -1\n", "[health]\nidle_after_min = 0\n"):
        health_config(inst, text)
        for args in (("config",), ("monitor",)):
            done = inst.cli(None, *args, timeout=30)
            lines = done.stderr.decode().splitlines()
            assert done.returncode == 78, (text, args, lines)
            assert lines[0].startswith(f"cudawrap: {inst.layout.config_file}:2: bad value for "), lines
    health_config(inst, "[health]\ndrain_xids = [79]\nunknown_xid = \"ignore\"\n")
    shown = inst.cli(None, "config").stdout.decode()
    assert "drain_xids" in shown and "unknown_xid" in shown and "recover_after_s" in shown
