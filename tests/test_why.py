"""`cudawrap why` and the waiting rows of status: place, reason and an estimated start whose
value a ledger of known run lengths fixes (real accounts)."""
from __future__ import annotations

import json
import time
from typing import Any, Dict, List

import pytest

from support.installed import ready_line
from support.procs import wait_for
from cudawrap.ledger.eta import estimate, medians, shown
from cudawrap.ledger.files import ledger_path
from cudawrap.monitor.loop import refresh_once


def ends(program: str, lengths: List[float], t0: float) -> List[Dict[str, Any]]:
    return [{"v": 1, "event": "end", "id": f"{program}-{i}", "program": program, "start": t0 + i * 1000,
             "end": t0 + i * 1000 + length} for i, length in enumerate(lengths)]


def test_the_median_is_of_the_last_20_runs_of_each_program() -> None:
    records = ends("recon", [10.0] * 7 + [600.0] * 20, 0) + ends("other", [100, 300, 900], 0)
    assert medians(records) == {"recon": (600.0, 20), "other": (300.0, 3)}


def test_estimates_read_as_people_say_them() -> None:
    assert [shown(s) for s in (None, 0.2, 100, 598, 4000)] == ["unknown", "now", "about 2 min", "about 10 min",
                                                                 "about 1 h 07 min"]


def test_a_holder_past_its_median_makes_the_estimate_unknown_with_why() -> None:
    now = time.time()
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now - 700))
    device = {"uuid": "GPU-a", "holder": {"program": "recon", "since": since, "user": "alice"}, "drains": []}
    row = {"pid": 1, "user": "bob", "count": 1, "candidates": None, "position": 1, "kind": "busy", "program": "x"}
    seconds, why = estimate(row, [row], [device], {"recon": (600.0, 20)}, now)
    assert seconds is None and "run past its median of 10 min" in why



def test_a_run_whose_devices_are_all_drained_has_no_estimate_and_says_why() -> None:
    # Pure: the run itself gives up at its next look once every device it may use is drained
    # (docs/admin/drains.md), so a running test can only race it; the rule is checked here.
    now = time.time()
    device = {"uuid": "GPU-a", "holder": None, "drains": [{"reason": "fan"}]}
    row = {"pid": 1, "user": "bob", "count": 1, "candidates": None, "position": 1, "kind": "busy", "program": "x"}
    seconds, why = estimate(row, [row], [device], {"x": (600.0, 20)}, now)
    assert seconds is None and "only 0 undrained device(s) it may use, 1 needed" in why

def test_a_program_without_run_lengths_is_named_with_where_it_runs() -> None:
    # Which run's length is missing, in words: the holder of a device, or a run ahead in line.
    now = time.time()
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now - 10))
    device = {"uuid": "GPU-abcdef123456-x", "holder": {"program": "recon", "since": since, "user": "alice"},
              "drains": []}
    row = {"pid": 1, "user": "bob", "count": 1, "candidates": None, "position": 2, "kind": "busy", "program": "x"}
    seconds, why = estimate(row, [row], [device], {"x": (600.0, 20)}, now)
    assert (seconds, why) == (None, "no finished run in the ledger of recon, the program on GPU-abcdef12")
    ahead = dict(row, pid=2, position=1, program="other")
    seconds, why = estimate(row, [ahead, row], [dict(device, holder=None)], {"x": (600.0, 20)}, now)
    assert (seconds, why) == (None, "no finished run in the ledger of other, which waits ahead in line")


def write_ledger(inst: Any) -> None:
    t0 = time.time() - 100000
    records = ends("recon", [5.0] * 6 + [600.0] * 20, t0) + ends("other", [60.0, 60.0, 60.0], t0)
    path = ledger_path(inst.layout)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    path.chmod(0o600)


def test_status_and_why_give_place_reason_and_start(both) -> None:  # type: ignore[no-untyped-def]
    way = both("h200", users=True)
    inst = way.inst
    world = inst.world
    recon, other = inst.bindir / "recon", inst.wrap("other")
    write_ledger(inst)
    holder = inst.start(world.alice, str(recon), "--hold", "120")
    ready_line(holder)
    first = inst.start(world.bob, str(recon))

    def waiting() -> List[Dict[str, Any]]:
        r = inst.cli(None, "status", "--json"); assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["waiting"]

    wait_for(lambda: len(waiting()) == 1, timeout=30)
    second = inst.start(world.carol, str(other))
    wait_for(lambda: len(waiting()) == 2, timeout=30)
    # Users cannot read the ledger: without the monitor's run lengths, "unknown", and why. (The
    # service's own monitor child keeps them: through the service they are known already.)
    def bob_asks() -> list:
        asked = inst.cli(world.bob, "why", "--json")
        assert asked.returncode == 0, asked.stderr
        return json.loads(asked.stdout)

    rows = bob_asks()
    assert [r["pid"] for r in rows] == [first.pid]
    if not way.served:
        assert rows[0]["start"] == "unknown" and "the monitor keeps them" in rows[0]["start_basis"]
    else:  # once the monitor child has read the ledger written above (a period, more when loaded)
        wait_for(lambda: bob_asks()[0]["start"] == "about 10 min", timeout=15,
                 what="bob's why gives the start from the monitor's run lengths", details=lambda: str(bob_asks()))
    # Root reads the ledger itself; a user reads what the monitor keeps.
    rows = waiting()
    assert [(r["pid"], r["position"]) for r in rows] == [(first.pid, 1), (second.pid, 2)]
    assert rows[0]["start"] == "about 10 min" and 560 <= rows[0]["start_s"] <= 600, rows[0]
    assert "recon 10 min (median of 20)" in rows[0]["start_basis"] and "no run ahead" in rows[0]["start_basis"]
    # Carol's starts when bob's recon has had its median run after alice's: 10 + 10 min.
    assert rows[1]["start"] == "about 20 min" and "1 run ahead" in rows[1]["start_basis"], rows[1]
    assert refresh_once(inst.layout) is None
    from cudawrap.health.keeper import MonitorHealth

    MonitorHealth(inst.layout).cycle()  # the monitor keeps the run lengths for everyone
    done = inst.cli(world.bob, "why", str(first.pid))
    text = done.stdout.decode()
    assert done.returncode == 0, done.stderr
    assert f"pid {first.pid} ({world.bob.name}, recon, 1 device): position 1 in line" in text
    assert "why: every device it may use is busy" in text
    # Alice's program is not bob's to know where he cannot name her process; when it usually
    # ends is. (The service names every holder to everyone, private_status aside.)
    basis = "recon 10 min (median of 20)" if way.served else "1 other user's run ending at its program's median"
    assert f"start: about 10 min (run lengths: {basis}; no run ahead)" in text, text
    table = inst.cli(world.carol, "status").stdout.decode()
    assert "START" in table and "about 20 min" in table
    # Someone else's run: root only. Not a waiting run: one line each.
    denied = inst.cli(world.bob, "why", str(second.pid))
    assert denied.returncode == 77 and f"{world.carol.name}'s run" in denied.stderr.decode()
    assert inst.cli(None, "why", str(second.pid)).returncode == 0
    for arg, words in ((str(holder.pid), "is not waiting"), ("abc", "not a process id")):
        bad = inst.cli(world.bob, "why", arg)
        lines = bad.stderr.decode().splitlines()
        assert bad.returncode == 64 and words in lines[0] and len(lines) == 2, lines
