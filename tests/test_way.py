"""`cudawrap way service|daemonless` with real accounts and real runs holding and waiting:
no lease lost, none granted twice, a waiting run keeps its turn (docs/admin/ways.md).

The switch refuses (75, one line, nothing changed) while runs wait on the side it leaves,
and goes through once none does; runs holding leases keep them across it either way.
"""
from __future__ import annotations

import os
import stat
import subprocess
from typing import Iterator, List

import pytest

from support.installed import ready_line
from support.procs import root_only, wait_for
from support.users import MuInstall

pytestmark = [pytest.mark.root, root_only]

OPEN, SEALED = (0o755, 0o755, 0o1777), (0o700, 0o700, 0o1700)


def _modes(inst: MuInstall) -> tuple:
    layout = inst.layout
    return tuple(stat.S_IMODE(os.stat(p).st_mode) for p in (layout.lease_dir, layout.share_dir, layout.queue_dir))


def _way(inst: MuInstall) -> str:
    return inst.layout.way_file.read_text().strip() if inst.layout.way_file.exists() else "daemonless"


@pytest.fixture
def one_gpu(mu) -> Iterator[MuInstall]:
    """An install whose runs may take one device (so a second run waits), recon wrapped; its
    service (if a test starts one) stopped after."""
    inst = mu("four-gpus")
    d0 = inst.machine.leaf_uuids()[0]
    inst.layout.config_file.write_text(f'[service]\nconnect_retry_s = 20\n[devices]\nallow = ["{d0}"]\n')
    inst.layout.config_file.chmod(0o644)
    inst.sync()
    inst.wrap("recon")
    inst.d0 = d0  # type: ignore[attr-defined]
    yield inst
    inst.cli(None, "serve", "--stop")


@pytest.fixture
def runs() -> Iterator[List[subprocess.Popen]]:
    started: List[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _switch(inst: MuInstall, way: str) -> subprocess.CompletedProcess:
    return inst.cli(None, "way", way, timeout=90)


def _waiting(inst: MuInstall) -> int:
    return len(inst.status(None)["waiting"])


def test_to_the_service_and_back_with_runs_holding_and_waiting(one_gpu: MuInstall, runs) -> None:
    inst, d0 = one_gpu, one_gpu.d0  # type: ignore[attr-defined]
    alice, bob, carol = inst.world.alice, inst.world.bob, inst.world.carol
    # Daemonless: alice holds the device, bob waits for it in the queue directory.
    holder = inst.start(alice, "recon", "--hold", "120", CUDAWRAP_WAIT="0")
    runs.append(holder)
    assert ready_line(holder)["cvd"] == d0
    waiter = inst.start(bob, "recon", "--hold", "120", CUDAWRAP_WAIT="120")
    runs.append(waiter)
    wait_for(lambda: _waiting(inst) == 1, timeout=20, what="bob waiting in the queue directory")
    refused = _switch(inst, "service")
    err = refused.stderr.decode().splitlines()
    assert refused.returncode == 75 and "wait in" in err[0] and "nothing changed" in err[0], err
    assert (_way(inst), _modes(inst)) == ("daemonless", OPEN)  # nothing changed
    # Alice lets go: bob's turn, as it was; then nobody waits and the switch goes through.
    holder.kill()
    holder.wait()
    assert ready_line(waiter)["cvd"] == d0
    switched = _switch(inst, "service")
    assert switched.returncode == 0, switched.stderr
    assert (_way(inst), _modes(inst)) == ("service", SEALED)
    # Bob keeps his lease: the service grants it to nobody else (carol is told, not given it).
    told = inst.run(carol, "recon", "--hold", "0", CUDAWRAP_WAIT="0")
    assert told.returncode == 75 and b"no free device" in told.stderr, told.stderr
    # Carol waits in the service's line now: the switch back refuses, and she keeps her turn.
    queued = inst.start(carol, "recon", "--hold", "120", CUDAWRAP_WAIT="120")
    runs.append(queued)
    wait_for(lambda: _waiting(inst) == 1, timeout=20, what="carol waiting in the service's line")
    refused = _switch(inst, "daemonless")
    err = refused.stderr.decode().splitlines()
    assert refused.returncode == 75 and "wait in the service's line" in err[0], err
    assert (_way(inst), _modes(inst)) == ("service", SEALED)
    waiter.kill()
    waiter.wait()
    assert ready_line(queued)["cvd"] == d0
    # Back to daemonless with carol holding through the service: her lease stands.
    switched = _switch(inst, "daemonless")
    assert switched.returncode == 0, switched.stderr
    assert (_way(inst), _modes(inst)) == ("daemonless", OPEN)
    assert not inst.layout.runtime_dir.joinpath("cudawrap.sock").exists()
    told = inst.run(alice, "recon", "--hold", "0", CUDAWRAP_WAIT="0")
    assert told.returncode == 75 and b"no free device" in told.stderr, told.stderr
    queued.kill()
    queued.wait()
    done = inst.run(alice, "recon", "--hold", "0", CUDAWRAP_WAIT="10")
    assert done.returncode == 0, done.stderr


def test_a_service_started_by_hand_is_the_only_arbiter_and_adopts_roots_runs(one_gpu: MuInstall, runs) -> None:
    """A daemonless install's service, started by hand: the directories become root's, a user's
    shared run goes through it too; root's run, taken while it was down, is adopted."""
    inst, d0 = one_gpu, one_gpu.d0  # type: ignore[attr-defined]
    alice = inst.world.alice
    mine = inst.start(None, "recon", "--hold", "120", CUDAWRAP_WAIT="0")
    runs.append(mine)
    assert ready_line(mine)["cvd"] == d0
    started = inst.cli(None, "serve", "--daemon")
    assert started.returncode == 0, started.stderr
    wait_for(lambda: inst.layout.runtime_dir.joinpath("cudawrap.sock").exists(), timeout=20, what="listening")
    assert (_way(inst), _modes(inst)) == ("daemonless", SEALED)
    told = inst.run(alice, "recon", "--hold", "0", CUDAWRAP_WAIT="0")
    assert told.returncode == 75 and b"no free device" in told.stderr, told.stderr
    doctor = inst.cli(None, "doctor").stdout.decode()
    assert "started by hand: this install runs daemonless" in doctor, doctor
    mine.kill()
    mine.wait()
    done = inst.run(alice, "recon", "--hold", "0", CUDAWRAP_WAIT="10")
    assert done.returncode == 0, done.stderr
    # Stopped, it gives the directories back: the install runs daemonless, as recorded.
    assert inst.cli(None, "serve", "--stop").returncode == 0
    assert _modes(inst) == OPEN
    done = inst.run(alice, "recon", "--hold", "0", CUDAWRAP_WAIT="0")
    assert done.returncode == 0, done.stderr


def test_a_service_does_not_start_while_users_wait_in_the_queue_directory(one_gpu: MuInstall, runs) -> None:
    """Started by hand beside a daemonless waiter, the service would strand it (it could not
    open a lease file once the directories are root's): it refuses, one line, 75, and the
    waiter gets its turn as it would have."""
    inst, d0 = one_gpu, one_gpu.d0  # type: ignore[attr-defined]
    holder = inst.start(inst.world.alice, "recon", "--hold", "120", CUDAWRAP_WAIT="0")
    runs.append(holder)
    assert ready_line(holder)["cvd"] == d0
    waiter = inst.start(inst.world.bob, "recon", "--hold", "0", CUDAWRAP_WAIT="120")
    runs.append(waiter)
    wait_for(lambda: _waiting(inst) == 1, timeout=20, what="bob waiting in the queue directory")
    for flags in ((), ("--daemon",)):
        refused = inst.cli(None, "serve", *flags, timeout=30)
        err = refused.stderr.decode().splitlines()
        assert refused.returncode == 75 and "wait in" in err[0] and "not started" in err[0], (flags, err)
        assert _modes(inst) == OPEN
    holder.kill()
    holder.wait()
    assert waiter.wait(timeout=30) == 0, waiter.stderr.read()


def test_the_way_command_says_the_way_and_refuses_bad_input(one_gpu: MuInstall) -> None:
    inst = one_gpu
    said = inst.cli(inst.world.alice, "way")
    assert said.returncode == 0 and said.stdout.decode().startswith("daemonless ("), said.stdout
    for args, code in ((("sideways",), 64), (("service",), 77)):
        who = None if code == 64 else inst.world.alice
        done = inst.cli(who, "way", *args)
        lines = done.stderr.decode().strip().splitlines()
        assert done.returncode == code and lines[0].startswith("cudawrap: "), (args, done.stderr)
    assert _way(inst) == "daemonless"
    assert inst.cli(None, "status").stdout.decode().splitlines()[0].endswith(" (runs daemonless)")
