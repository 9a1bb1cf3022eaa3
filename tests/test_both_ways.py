"""One rule, both ways: what a run gets or is told, daemonless and through `cudawrap serve`.

Each test body runs twice (the fixture ``both``, tests/support/ways.py): once where runs decide
for themselves and once through the service of the same install. A difference is a bug.
"""
from __future__ import annotations

import json
import os
import time

import pytest

from support.installed import ready_line
from support.procs import root_only

pytestmark = [pytest.mark.root, root_only]

NO_WAIT = "recon: no free device: {why}; waiting is off (wait = 0)\nrecon: hint: set CUDAWRAP_WAIT=SECONDS to wait\n"
BUSY = "every device it may use is busy; position 1 in line"


def devices_of(r) -> list:  # type: ignore[no-untyped-def]
    assert r.returncode == 0, r.stderr.decode()
    return json.loads(r.stdout.splitlines()[0])["devices"]


def test_bobs_hand_run_program_on_a_mig_instance_is_seen_by_alices_runs_both_ways(both) -> None:  # type: ignore[no-untyped-def]
    """bob runs the real program past its shim on one MIG instance, after the service has
    read the machine (issue 51 item 19): alice's run naming it is refused, one free to
    choose goes elsewhere; once bob's program ends the instance is granted again."""
    way = both("a100-mig7", users=True)
    inst = way.inst
    migs = inst.machine.leaf_uuids()
    inst.allow(*migs[:2])
    bobs = way.by_hand(inst.world.bob, migs[0])
    alice = inst.world.alice
    named = inst.run(alice, "recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=migs[0])
    assert (named.returncode, named.stderr.decode()) == (75, NO_WAIT.format(
        why=BUSY)), way
    for _ in range(3):
        assert devices_of(inst.run(alice, "recon", CUDAWRAP_WAIT="0")) == [migs[1]], way
    bobs.kill()
    bobs.wait()
    way.listed()
    assert devices_of(inst.run(alice, "recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=migs[0])) == [migs[0]], way


def test_a_run_whose_only_devices_are_drained_exits_75_at_once_both_ways(both) -> None:  # type: ignore[no-untyped-def]
    way = both(users=True)
    inst = way.inst
    gpus = inst.machine.gpu_uuids()
    done = inst.cli(None, "drain", "1", "--reason", "fan replacement")
    assert done.returncode == 0, done.stderr
    began = time.monotonic()
    r = inst.run(inst.world.alice, "recon", CUDA_VISIBLE_DEVICES=gpus[1], CUDAWRAP_WAIT="600", timeout=30)
    assert time.monotonic() - began < 20
    assert (r.returncode, r.stderr.decode()) == (75, (
        f"recon: 1 device asked for, but {gpus[1]} is drained by an admin (fan replacement) and only 0 can be "
        "used now\nrecon: hint: `cudawrap status` says why and since when; try again after `cudawrap resume`\n")), way
    assert devices_of(inst.run(inst.world.alice, "recon", CUDAWRAP_WAIT="0")) != [gpus[1]], way


def waiting_behind_bob(way, index: int):  # type: ignore[no-untyped-def]
    """bob holding GPU INDEX and alice's run waiting for it: (bob's, alice's, her first line)."""
    inst = way.inst
    gpu = inst.machine.gpu_uuids()[index]
    holder = inst.start(inst.world.bob, "recon", "--hold", "60", CUDA_VISIBLE_DEVICES=gpu)
    ready_line(holder)
    waiter = inst.start(inst.world.alice, "recon", CUDA_VISIBLE_DEVICES=gpu, CUDAWRAP_WAIT="600")
    said = waiter.stderr.readline().decode()
    assert "waiting for a device" in said, (way, said)
    return holder, waiter, said


def test_a_waiting_run_whose_devices_are_drained_meanwhile_exits_75_both_ways(both) -> None:  # type: ignore[no-untyped-def]
    way = both(users=True)
    inst = way.inst
    holder, waiter, _said = waiting_behind_bob(way, 0)
    done = inst.cli(None, "drain", "0", "--reason", "fan replacement")
    assert done.returncode == 0, done.stderr
    assert waiter.wait(timeout=20) == 75, way
    assert waiter.stderr.read().decode() == (
        "recon: the devices this run may use were drained by an admin while it waited\n"
        "recon: hint: `cudawrap status` says why and since when\n"), way
    holder.kill()


def test_a_run_that_waited_says_what_it_got_and_after_how_long_both_ways(both) -> None:  # type: ignore[no-untyped-def]
    """Through the service, whether the run waits in the waiter (shims/cudawrap-wait.c) or, where
    there is none (no C compiler at install), in the shim itself."""
    way = both(users=True)
    gpus = way.inst.machine.gpu_uuids()
    for _waiter_built in (True, False):
        holder, waiter, said = waiting_behind_bob(way, 2)
        assert said == f"recon: waiting for a device: {BUSY} (pid {waiter.pid})\n", way
        time.sleep(1.2)
        holder.kill()
        assert ready_line(waiter)["devices"] == [gpus[2]], way
        assert waiter.wait(timeout=20) == 0, way
        said = waiter.stderr.read().decode()
        assert said.startswith(f"recon: got {gpus[2]} after ") and said.endswith(" s\n"), (way, said)
        assert 1.0 <= float(said.split()[-2]) < 30, (way, said)
        holder.wait()
        way.inst.layout.waiter.unlink(missing_ok=True)


def test_a_resume_gives_a_waiting_run_the_device_resumed_both_ways(both) -> None:  # type: ignore[no-untyped-def]
    """Every device drained but one, which bob holds: alice waits (her run can be served once
    bob's ends); a resume of another gives it to her at once, though it was drained when she came."""
    way = both(users=True)
    inst = way.inst
    gpus = inst.machine.gpu_uuids()
    holder = inst.start(inst.world.bob, "recon", "--hold", "60", CUDA_VISIBLE_DEVICES=gpus[0])
    ready_line(holder)
    done = inst.cli(None, "drain", "1", "2", "3", "--reason", "maintenance")
    assert done.returncode == 0, done.stderr.decode()
    waiter = inst.start(inst.world.alice, "recon", CUDAWRAP_WAIT="60")
    assert "waiting for a device" in waiter.stderr.readline().decode(), way
    done = inst.cli(None, "resume", "2")
    assert done.returncode == 0, done.stderr.decode()
    assert ready_line(waiter)["devices"] == [gpus[2]], way
    waiter.kill()
    holder.kill()


def wrapped(way, name: str, *switches: str) -> str:  # type: ignore[no-untyped-def]
    """NAME wrapped by `create-cudawrap SWITCHES` (the switches kept in the registry)."""
    import sys

    from support.machine import FAKECUDA

    inst = way.inst
    program = inst.bindir / name
    program.write_bytes(f"#!{sys.executable} -IS\n".encode() + FAKECUDA.read_bytes().split(b"\n", 1)[1])
    program.chmod(0o755)
    done = inst.cli("wrap", *switches, str(program))
    assert done.returncode == 0, done.stderr.decode()
    return name


def test_a_programs_own_foreign_rule_holds_both_ways(both) -> None:  # type: ignore[no-untyped-def]
    """A program wrapped with --foreign (or --busy-memory-mib) unlike the config's [policy] is
    judged by its own rule, through the service as without it: one that ignores foreign work
    is given the GPU a process cudawrap did not start is on, one that avoids it is refused."""
    way = both("four-gpus")
    inst = way.inst
    gpus = inst.machine.leaf_uuids()
    careless = wrapped(way, "careless", "--foreign", "ignore")
    careful = wrapped(way, "careful", "--foreign", "avoid")
    inst.machine.add_process(os.getpid(), gpus[0], 2048)
    way.listed()
    on_gpu0 = dict(CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=gpus[0])
    refused = NO_WAIT.format(why=BUSY).replace("recon:", f"{careful}:")
    for foreign in ("avoid", "ignore"):  # the config's rule: each program's own holds over it
        inst.write_config(f'[policy]\nforeign = "{foreign}"\n')
        r = inst.run(careful, **on_gpu0)
        assert (r.returncode, r.stderr.decode()) == (75, refused), (way, foreign)
        assert devices_of(inst.run(careless, **on_gpu0)) == [gpus[0]], (way, foreign)
        r = inst.run("recon", **on_gpu0)  # recon has none: the config's
        assert r.returncode == (75 if foreign == "avoid" else 0), (way, foreign, r.stderr.decode())
        assert devices_of(inst.run(careful, CUDAWRAP_WAIT="0")) == [gpus[1]], (way, foreign)


def test_a_programs_own_busy_memory_threshold_holds_both_ways(both) -> None:  # type: ignore[no-untyped-def]
    """Where NVML hides process lists, a program's own --busy-memory-mib says when the memory
    used keeps it off a device, through the service as without it."""
    way = both("a100-mig7")
    inst = way.inst
    gpus = inst.machine.leaf_uuids()  # MIG instances: their processes hidden by the fault below
    strict = wrapped(way, "strict", "--busy-memory-mib", "100")
    inst.machine.set_fault("no_permission", "all")
    inst.machine.add_process(4242, gpus[0], 512)  # 512 MiB used: under the default 1024, over 100
    way.listed()
    on_gpu0 = dict(CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=gpus[0])
    r = inst.run(strict, **on_gpu0)
    assert (r.returncode, r.stderr.decode()) == (75, NO_WAIT.format(why=BUSY).replace("recon:", f"{strict}:")), way
    assert devices_of(inst.run("recon", **on_gpu0)) == [gpus[0]], way
