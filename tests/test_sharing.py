"""Sharing one device between shared runs: slots, fill-first, exclusive runs, kill -9, inheritance.

Through the installed shim on the stand-in machine: the stand-in CUDA program logs what it
was given, and the lock table is read back to count sharers per device.
"""
import json
import os
import signal
from collections import defaultdict
from typing import Dict, List, Tuple

import pytest

from support.installed import Installed

SHARE = {"CUDAWRAP_SHARE": "1"}


def share_config(inst: Installed, slots: int = 2, extra: str = "", allow: Tuple[str, ...] = ()) -> None:
    inst.configure(f"[sharing]\nslots = {slots}\n{extra}", *allow)



def share_pids(lease_dir) -> Dict[str, List[int]]:  # type: ignore[no-untyped-def]
    """uuid -> the pid that took each shared lock on its lease file now (from /proc/locks)."""
    from cudawrap.lease.files import lock_table

    table = lock_table()
    out = {}
    for name in os.listdir(lease_dir):
        st = os.stat(os.path.join(lease_dir, name))
        locks = table.get((st.st_dev, st.st_ino), [])
        if locks and not any(ex for _pid, ex in locks):
            out[name] = [pid for pid, _ex in locks]
    return out


def sharers(inst: Installed) -> Dict[str, int]:
    """uuid -> shares held on it now."""
    return {uuid: len(pids) for uuid, pids in share_pids(inst.layout.lease_dir).items()}


def test_shared_runs_fill_one_device_before_opening_another(both):
    way = both("four-gpus")
    inst = way.inst
    share_config(inst, slots=3)
    first = [inst.hold(60, **SHARE) for _ in range(3)]
    devices = {info["devices"][0] for _p, info in first}
    assert len(devices) == 1  # three slots of one device, three other devices untouched
    assert sharers(inst) == {devices.pop(): 3}
    fourth, info = inst.hold(60, **SHARE)
    assert info["devices"][0] not in {i["devices"][0] for _p, i in first}
    # Whole devices are left for exclusive runs: two of the four are still free.
    whole = [inst.hold(60) for _ in range(2)]
    assert len({i["devices"][0] for _p, i in whole} | {info["devices"][0]} | {first[0][1]["devices"][0]}) == 4
    assert inst.run("recon", CUDAWRAP_WAIT="0").returncode == 75  # nothing whole is left
    for p, _ in first + whole + [(fourth, info)]:
        p.kill()
        p.wait()


def test_never_more_sharers_than_slots_in_a_burst(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    uuids = inst.machine.leaf_uuids()[:2]
    share_config(inst, slots=3, allow=tuple(uuids))
    procs = [inst.start("recon", "--hold", "0.3", "--log", str(inst.log), **SHARE) for _ in range(24)]
    exclusive = [inst.start("recon", "--hold", "0.2", "--log", str(inst.log)) for _ in range(6)]
    procs += exclusive
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0] * len(procs), [p.stderr.read() for p in procs if p.returncode]
    jobs = inst.jobs()
    assert len(jobs) == 2 * len(procs)
    starts = {j["pid"]: j for j in jobs if j["event"] == "start"}
    whole_pids = {p.pid for p in exclusive}  # the shim execs the program: same pid
    events = defaultdict(list)
    for j in jobs:
        if j["event"] == "end":
            begun = starts[j["pid"]]
            whole = j["pid"] in whole_pids
            for d in begun["devices"]:
                events[d] += [(begun["time"], 1, whole), (j["time"], -1, whole)]
    for device, evs in events.items():
        shared_now = whole_now = 0
        for _t, step, whole in sorted(evs, key=lambda e: (e[0], e[1])):
            if whole:
                whole_now += step
            else:
                shared_now += step
            assert shared_now <= 3, f"{device}: {shared_now} sharers"
            assert whole_now <= 1 and not (whole_now and shared_now), f"{device}: exclusive with sharers"


def test_an_exclusive_run_waits_for_the_sharers_and_they_for_it(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    share_config(inst, slots=2, allow=(d0,))
    sharer, _ = inst.hold(60, **SHARE)
    assert inst.run("recon", CUDAWRAP_WAIT="0").returncode == 75  # a sharer is on the only device
    waiter = inst.start("recon", "--log", str(inst.log), CUDAWRAP_WAIT="30")
    assert b"waiting" in waiter.stderr.readline()
    # The second slot is free, so another sharer still gets in while the exclusive run waits.
    second, info = inst.hold(60, **SHARE)
    assert info["devices"] == [d0] and sharers(inst) == {d0: 2}
    sharer.kill()
    sharer.wait()
    assert waiter.poll() is None  # one sharer is left
    second.kill()  # kill -9: the kernel drops both of its locks
    second.wait()
    assert waiter.wait(timeout=15) == 0
    whole, _ = inst.hold(60)
    assert inst.run("recon", CUDAWRAP_WAIT="0", **SHARE).returncode == 75  # no share beside a whole run
    whole.kill()
    whole.wait()


def test_kill_9_of_a_sharer_frees_its_slot(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    share_config(inst, slots=2, allow=(d0,))
    first, _ = inst.hold(60, **SHARE)
    second, _ = inst.hold(60, **SHARE)
    assert inst.run("recon", CUDAWRAP_WAIT="0", **SHARE).returncode == 75
    waiter = inst.start("recon", "--hold", "0", CUDAWRAP_WAIT="30", **SHARE)
    assert b"waiting" in waiter.stderr.readline()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert waiter.wait(timeout=15) == 0
    second.kill()
    second.wait()
    assert sharers(inst) == {}


def test_a_child_wrapped_program_keeps_its_parents_share(installed, tmp_path):
    inst = installed("four-gpus")
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    share_config(inst, slots=2, allow=(d0,))
    outer = tmp_path / "outer"
    outer.write_text("#!/bin/sh\necho \"$CUDAWRAP_LEASE\"\nexec recon --hold 0\n")
    outer.chmod(0o755)
    inst.wrap("outer", outer)
    other, _ = inst.hold(60, **SHARE)  # the second slot is taken: the child cannot get a new share
    r = inst.run("outer", CUDAWRAP_WAIT="0", **SHARE)
    assert r.returncode == 0, r.stderr
    marker = r.stdout.decode().splitlines()[0]
    assert marker.count(":") == 2 and d0 in marker  # fd:uuid:slot-fd
    child = json.loads(r.stdout.decode().splitlines()[1])
    assert child["devices"] == [d0]
    other.kill()
    other.wait()


def test_status_shows_the_slots_and_who_holds_them(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    share_config(inst, slots=4, allow=(d0,))
    procs = [inst.hold(60, **SHARE)[0] for _ in range(2)]
    r = inst.cli("status")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.decode().splitlines() if d0[:12] in x)
    user = __import__("pwd").getpwuid(os.geteuid()).pw_name[:8]
    assert f"2/4 shared: {user} pid {min(p.pid for p in procs)}, {user} pid {max(p.pid for p in procs)}" in line \
        or f"2/4 shared: {user} pid {max(p.pid for p in procs)}, {user} pid {min(p.pid for p in procs)}" in line
    data = json.loads(inst.cli("status", "--json").stdout)
    device = next(d for d in data["devices"] if d["uuid"] == d0)
    assert device["shares"]["used"] == 2 and device["shares"]["slots"] == 4
    assert sorted(h["pid"] for h in device["shares"]["holders"]) == sorted(p.pid for p in procs)
    for p in procs:
        p.kill()
        p.wait()


def test_shares_count_towards_the_users_limit(both):
    way = both("four-gpus")
    inst = way.inst
    d0, d1 = inst.machine.leaf_uuids()[:2]
    share_config(inst, slots=2, extra="\n[limits]\nmax_devices_per_user = 1\n", allow=(d0, d1))
    procs = [inst.hold(60, **SHARE)[0] for _ in range(2)]  # 2 x 1/2 = the whole limit
    r = inst.run("recon", CUDAWRAP_WAIT="0", **SHARE)
    assert r.returncode == 75
    waiter = inst.start("recon", "--hold", "0", CUDAWRAP_WAIT="30", **SHARE)
    assert b"your limit is 1" in waiter.stderr.readline()
    procs[0].kill()
    procs[0].wait()
    assert waiter.wait(timeout=15) == 0
    procs[1].kill()
    procs[1].wait()


def test_one_slot_means_a_shared_run_takes_the_device_whole(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    share_config(inst, slots=1, allow=(d0,))
    proc, info = inst.hold(60, **SHARE)
    assert info["devices"] == [d0]
    assert inst.run("recon", CUDAWRAP_WAIT="0", **SHARE).returncode == 75
    assert sharers(inst) == {}  # held exclusively
    proc.kill()
    proc.wait()


def test_per_device_slots_and_sync_follows_a_change(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    d0, d1 = inst.machine.leaf_uuids()[:2]
    share_config(inst, slots=2, extra=f'\n[sharing.devices."{d1[:9]}"]\nslots = 3\n', allow=(d0, d1))
    names = sorted(os.listdir(inst.layout.share_dir))
    assert [n for n in names if n.startswith(d0)] == [f"{d0}.1", f"{d0}.2"]
    assert [n for n in names if n.startswith(d1)] == [f"{d1}.1", f"{d1}.2", f"{d1}.3"]
    holder, _ = inst.hold(60, **SHARE)  # on d0's or d1's slot 1
    share_config(inst, slots=1, allow=(d0, d1))
    left = os.listdir(inst.layout.share_dir)
    assert len(left) == 1  # only the held slot file stays, until it is free
    holder.kill()
    holder.wait()
    inst.sync()
    assert os.listdir(inst.layout.share_dir) == []


@pytest.mark.parametrize("text", ["slots = 0", "slots = -1", "slots = 100000", 'mode = "spacetime"',
                                  "slots = 2.5", "thread_percentage = 0", "counts_as = 2"])
def test_bad_sharing_config_stops_every_launch_with_78(installed, text):
    inst = installed("four-gpus")
    inst.wrap("recon")
    inst.write_config(f"[sharing]\n{text}\n")
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 78
    lines = r.stderr.decode().splitlines()
    assert "config.toml:2: bad value for" in lines[0] and len(lines) <= 2
    assert os.listdir(inst.layout.queue_dir) == []


@pytest.mark.parametrize("value", ["maybe", "2", "-1"])
def test_bad_share_asks_are_usage_errors(installed, value):
    inst = installed("four-gpus")
    inst.wrap("recon")
    r = inst.run("recon", CUDAWRAP_SHARE=value)
    assert r.returncode == 64
    assert f"CUDAWRAP_SHARE={value!r}: not 1 or 0" in r.stderr.decode().splitlines()[0]


def test_a_user_may_not_unshare_a_shared_program(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    inst.write_config('[sharing]\nslots = 2\n[programs."recon"]\nshare = true\n')
    inst.sync()
    r = inst.run("recon", CUDAWRAP_SHARE="0")
    assert r.returncode == 64
    assert "may not take it whole" in r.stderr.decode()
    assert inst.run("recon").returncode == 0


def test_mps_mode_gives_the_client_its_pipe_and_shares(installed, tmp_path):
    inst = installed("four-gpus")
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    share_config(inst, slots=4, extra='mode = "mps"\n', allow=(d0,))
    out = tmp_path / "env"
    r = inst.run("recon", "--env-out", str(out), **SHARE)
    # No daemon runs here (tests/test_mps.py starts them): the stand-in client writes what it
    # was given, then cannot connect, as a client on an EXCLUSIVE_PROCESS device (46).
    assert r.returncode == 46 and b"cannot connect to the MPS control daemon" in r.stderr, r.stderr
    env = dict(item.split(b"=", 1) for item in out.read_bytes().split(b"\0") if b"=" in item)
    assert env[b"CUDA_MPS_PIPE_DIRECTORY"] == f"{inst.layout.root}/run/cudawrap/mps/{d0}".encode()
    assert env[b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == b"25"
    assert env[b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == b"0=10240M"  # 40960 MiB / 4
    # An exclusive run bypasses MPS, even when it was started from a shared run's environment.
    r = inst.run("recon", "--env-out", str(out), CUDA_MPS_PIPE_DIRECTORY=env[b"CUDA_MPS_PIPE_DIRECTORY"].decode())
    assert r.returncode == 0, r.stderr
    assert b"CUDA_MPS_PIPE_DIRECTORY" not in out.read_bytes()
    r = inst.run("recon", CUDAWRAP_GPUS="2", **SHARE)
    assert r.returncode == 75 and b"an MPS client uses one device" in r.stderr


def test_mps_settings_override_the_derived_shares(installed, tmp_path):
    inst = installed("four-gpus")
    inst.wrap("recon")
    share_config(inst, slots=4, extra='mode = "mps"\nthread_percentage = 40\nmemory_limit_mib = 0\n')
    out = tmp_path / "env"
    assert inst.run("recon", "--env-out", str(out), **SHARE).returncode == 46  # no daemon: see above
    env = out.read_bytes()
    assert b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40\0" in env
    assert b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env


def test_accounting_counts_each_share_as_its_part_of_the_device(installed):
    from cudawrap.ledger import looks as ledger
    from cudawrap.monitor.metrics import device_rows, render, Counters

    inst = installed("four-gpus")
    inst.wrap("recon")
    d0 = inst.machine.leaf_uuids()[0]
    share_config(inst, slots=4, allow=(d0,))
    procs = [inst.hold(60, **SHARE)[0] for _ in range(2)]
    obs = ledger.observe(inst.layout, "test", (64 << 20, 4))
    mine = [g for g in obs.grants if g["pid"] in {p.pid for p in procs}]
    assert len(mine) == 2  # both sharers, not one holder per device
    assert all(g["shared"] and g["devices_held"] == 0.25 and g["devices"] == [d0] for g in mine)
    rows = [r for r in device_rows(inst.layout, None) if r["uuid"] == d0]
    assert rows[0]["shares"] == 2
    assert f'cudawrap_device_shares{{device="{d0}",gpu="-1",name="?"}} 2' in render(rows, {}, Counters())
    for p in procs:
        p.kill()
        p.wait()
    ends = [e for e in ledger.observe(inst.layout, "test", (64 << 20, 4)).ends if e["pid"] in {p.pid for p in procs}]
    assert len(ends) == 2 and all(e["devices_held"] == 0.25 for e in ends)


def test_doctor_notices_missing_slot_files_and_repair_makes_them(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    inst.write_config("[sharing]\nslots = 3\n")  # no sync: no slot files yet
    r = inst.cli("doctor")
    assert r.returncode != 0 and b"fewer slot files than [sharing] slots for 4 device(s)" in r.stdout + r.stderr
    r = inst.cli("doctor", "--repair")
    assert len(os.listdir(inst.layout.share_dir)) == 4 * 3
    r = inst.cli("doctor")
    assert b"slot files for every shared device" in r.stdout + r.stderr
