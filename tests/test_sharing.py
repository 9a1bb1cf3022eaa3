"""Sharing one device between shared runs: slots, fill-first, exclusive runs, kill -9, inheritance.

Through the installed shim on the stand-in machine: the stand-in CUDA program logs what it
was given, and the lock table is read back to count sharers per device.
"""
import json
import os
import signal
import subprocess
import time
from collections import defaultdict
from typing import Dict, List, Tuple

import pytest

from corefix import Installed, ready_line, wait_for

SHARE = {"CUDAWRAP_SHARE": "1"}


def share_config(inst: Installed, slots: int = 2, extra: str = "", allow: Tuple[str, ...] = ()) -> None:
    text = f"[sharing]\nslots = {slots}\n{extra}"
    if allow:
        text += "\n[devices]\nallow = [%s]\n" % ", ".join(f'"{u}"' for u in allow)
    inst.write_config(text)
    inst.sync()  # root makes the slot files


def hold(inst: Installed, seconds: float = 60, **env: str) -> Tuple[subprocess.Popen, dict]:
    proc = inst.start("recon", "--hold", str(seconds), "--log", str(inst.log), **env)
    return proc, ready_line(proc)


def sharers(inst: Installed) -> Dict[str, int]:
    """uuid -> shared locks on its lease file now (from /proc/locks)."""
    from cudawrap.leases import lock_table

    table = lock_table()
    out = {}
    for name in os.listdir(inst.layout.lease_dir):
        st = os.stat(inst.layout.lease_dir / name)
        locks = table.get((st.st_dev, st.st_ino), [])
        if locks and not any(ex for _pid, ex in locks):
            out[name] = len(locks)
    return out


def test_shared_runs_fill_one_device_before_opening_another(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    share_config(inst, slots=3)
    first = [hold(inst, **SHARE) for _ in range(3)]
    devices = {info["devices"][0] for _p, info in first}
    assert len(devices) == 1  # three slots of one device, three other devices untouched
    assert sharers(inst) == {devices.pop(): 3}
    fourth, info = hold(inst, **SHARE)
    assert info["devices"][0] not in {i["devices"][0] for _p, i in first}
    # Whole devices are left for exclusive runs: two of the four are still free.
    whole = [hold(inst) for _ in range(2)]
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
