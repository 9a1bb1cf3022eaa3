"""Leftover processes: a worker that outlived its wrapped run on a GPU is reported with its
owner, keeps exclusive runs away while it lasts, and is ended with leftover_action = "kill"
(real accounts)."""
from __future__ import annotations

import json
import os
import time

from support.installed import ready_line
from support.procs import wait_for
from cudawrap.health.keeper import MonitorHealth
from cudawrap.ledger.looks import observe
from cudawrap.monitor.loop import refresh_once
from support.machine import pid_alive


def cycle(hook: MonitorHealth, inst) -> None:  # type: ignore[no-untyped-def]
    assert refresh_once(inst.layout) is None
    hook.cycle()


def notes(inst, *kinds: str) -> list:  # type: ignore[no-untyped-def]
    from cudawrap.ledger.files import ledger_path, read

    problems: list = []
    found = list(read([ledger_path(inst.layout)], problems, kinds))
    assert problems == []
    return found


def test_a_leftover_is_reported_keeps_exclusive_runs_away_and_is_killed_when_asked(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    world, gpus = inst.world, inst.machine.gpu_uuids()
    recon = inst.wrap()
    # A process that never held a lease: foreign, as before, never a leftover.
    inst.machine.add_process(os.getpid(), gpus[1])
    hook = MonitorHealth(inst.layout)
    run = inst.start(world.alice, str(recon), "--hold", "0.5", "--orphan", "120")
    device = ready_line(run)["devices"][0]
    observe(inst.layout)  # the ledger sees the grant
    orphan = json.loads(run.stdout.readline())["orphan"]
    assert run.wait(timeout=30) == 0
    observe(inst.layout)  # ... and the end
    cycle(hook, inst)
    ended = time.strftime("%H:%M", time.localtime(
        notes(inst, "end")[-1]["end"]))
    words = f"leftover: pid {orphan} {world.alice.name} (from recon, ended {ended})"
    for user in (None, world.alice, world.bob):
        status = inst.cli(user, "status").stdout.decode()
        assert f"{device}: {words}" in status, status
        # The foreign one is not (its own line names its command: this test's, "…test_leftovers.py").
        assert "leftover:" not in status.replace(f"{device}: {words}", "")
    assert words in inst.cli(world.bob, "health").stdout.decode()
    from cudawrap.monitor.metrics import leftover_counts

    assert leftover_counts(inst.layout) == {(device, world.alice.name): 1}
    (seen,) = notes(inst, "leftover")  # once, however many cycles see it
    assert (seen["device"], seen["pid"], seen["uid"], seen["program"]) == (device, orphan, world.alice.uid, "recon")
    # Exclusive runs stay off its device while it lasts.
    others = [inst.start(world.bob, str(recon), "--hold", "60", CUDAWRAP_WAIT="0") for _ in range(2)]
    got = {ready_line(p)["devices"][0] for p in others}
    assert device not in got and gpus[1] not in got
    late = inst.run(world.carol, str(recon), CUDAWRAP_WAIT="0")
    assert late.returncode == 75, late.stderr
    for p in others:
        p.kill()
        p.wait()
    # Report only by default: still there after the grace period's default would be up.
    cycle(hook, inst)
    assert pid_alive(orphan)
    inst.layout.config_file.write_text('[health]\nleftover_action = "kill"\nleftover_grace_s = 0\n')
    inst.layout.config_file.chmod(0o644)
    cycle(hook, inst)
    wait_for(lambda: not pid_alive(orphan), timeout=30)
    cycle(hook, inst)
    assert "leftover:" not in inst.cli(None, "status").stdout.decode()
    assert [(n["device"], n["pid"]) for n in notes(inst, "leftover-killed")] == [(device, orphan)]
    assert len(notes(inst, "leftover")) == 1 and leftover_counts(inst.layout) == {}


def test_an_idle_lease_is_flagged_after_idle_after_min_and_activity_clears_it(mu) -> None:  # type: ignore[no-untyped-def]
    from cudawrap.monitor.metrics import device_rows
    from cudawrap.devices.nvml import inventory

    inst = mu("four-gpus")
    inst.layout.config_file.write_text("[health]\nidle_after_min = 1\n")
    inst.layout.config_file.chmod(0o644)
    recon = inst.wrap()
    hook = MonitorHealth(inst.layout)
    holder = inst.start(inst.world.alice, str(recon), "--hold", "120")
    device = ready_line(holder)["devices"][0]
    t0 = time.time()

    def at(now: float) -> str:
        assert refresh_once(inst.layout) is None
        hook.cycle(now)
        return inst.cli(inst.world.bob, "status").stdout.decode()

    assert "IDLE" not in at(t0)
    assert "IDLE" not in at(t0 + 59)  # quiet for 59 s of the 60
    shown = at(t0 + 61)
    assert f"{device}: IDLE for 1 min: pid {holder.pid} {inst.world.alice.name} " \
           f"(0 % utilisation and unchanged memory)" in shown, shown
    rows = {r["uuid"]: r for r in device_rows(inst.layout, inventory())}
    assert rows[device]["idle_s"] == 61 and all("idle_s" not in r for u, r in rows.items() if u != device)
    # It computes again: the quiet spell is over.
    inst.machine.write(inst.machine.read().replace(f"uuid={device} ", f"uuid={device} util=40 "))
    assert notes(inst, "idle") == []  # flagged, not over
    assert "IDLE" not in at(t0 + 200)
    (spell,) = notes(inst, "idle")  # over: from its first quiet sample to its last
    assert (spell["device"], spell["pid"], spell["uid"], spell["program"]) == \
        (device, holder.pid, inst.world.alice.uid, "recon")
    assert spell["end"] - spell["start"] == 61.0
    inst.machine.write(inst.machine.read().replace(f"uuid={device} util=40 ", f"uuid={device} "))
    assert "IDLE" not in at(t0 + 201)
    assert "IDLE for 1 min" in at(t0 + 262)
    # Usage: the spell that ended (61 s) and the one going on now (from the busy sample at 200: 62 s).
    until = time.strftime("%Y-%m-%dT%H:%M", time.localtime(t0 + 600))
    for user in (None, inst.world.alice):
        done = inst.cli(user, "usage", "--since", "1h", "--until", until, "--json")
        assert done.returncode == 0, done.stderr
        (row,) = [r for r in json.loads(done.stdout) if r["user"] == inst.world.alice.name]
        assert row["idle_device_hours"] == round(123 / 3600, 4), row
    assert "IDLE" in inst.cli(inst.world.alice, "usage").stdout.decode()


def test_idle_notify_writes_on_the_holders_own_terminal_and_never_its_pipe(mu) -> None:  # type: ignore[no-untyped-def]
    import pty
    import select
    import subprocess

    inst = mu("four-gpus")
    inst.layout.config_file.write_text('[health]\nidle_after_min = 1\nidle_action = "notify"\n')
    inst.layout.config_file.chmod(0o644)
    recon = inst.wrap()
    alice = inst.world.alice
    master, slave = pty.openpty()
    os.fchown(slave, alice.uid, -1)  # her terminal, as login makes it
    at_tty = subprocess.Popen(alice.argv([str(recon), "--hold", "120"]), env=inst.environ(),
                              stdout=subprocess.PIPE, stderr=slave, cwd=inst.dir)
    inst.spawned.add(at_tty)
    os.close(slave)
    at_pipe = inst.start(inst.world.bob, str(recon), "--hold", "120")
    device = ready_line(at_tty)["devices"][0]
    ready_line(at_pipe)
    hook = MonitorHealth(inst.layout)
    t0 = time.time()
    for now in (t0, t0 + 30):
        assert refresh_once(inst.layout) is None
        hook.cycle(now)
    assert not select.select([master], [], [], 0)[0]  # not idle long enough yet
    assert refresh_once(inst.layout) is None
    hook.cycle(t0 + 61)
    assert select.select([master], [], [], 10)[0]
    said = os.read(master, 4096).decode()
    assert f"cudawrap: your run (pid {at_tty.pid}) has held {device} idle for 1 min" in said, said
    assert not select.select([at_pipe.stderr], [], [], 0)[0]  # a pipe is the run's output, not ours
    assert refresh_once(inst.layout) is None
    hook.cycle(t0 + 120)
    assert not select.select([master], [], [], 0)[0]  # told once a spell
    os.close(master)
