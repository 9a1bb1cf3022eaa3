"""[service] private_status with real accounts: what bob (cwtest2) sees of alice's (cwtest1)
runs, processes and leftovers, daemonless and through the service, from one test body.

With it on, nothing that names alice's runs (her name, their pids, programs, command lines)
reaches bob by any way cudawrap offers: status (table and --json), why, health, the service's
raw answers, the files the monitor leaves in the runtime directory. Without it they do (as
`ps` and `squeue` would show them), which is what proves the test sees them at all.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
from typing import Dict, Iterator, List, Optional

import pytest

from support.installed import ready_line, waiting_line
from support.procs import cli_code, root_only, wait_for
from support.users import MuInstall
from test_mps import mu_mps  # noqa: F401 - a fixture

pytestmark = [pytest.mark.root, root_only]

# Bob's look at the monitor's files: each one's data as text, or why he cannot read it.
READ_FILES = r"""
import errno, json, marshal, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        raw = open(path, "rb").read()
    except OSError as exc:
        out[os.path.basename(path)] = errno.errorcode.get(exc.errno, str(exc.errno))
        continue
    data = json.loads(raw) if path.endswith(".json") else marshal.loads(raw)
    out[os.path.basename(path)] = json.dumps(data, default=str)
print(json.dumps(out))
"""

# Bob's raw question to the service: STATUS with the whole status, as a client sends it.
ASK = r"""
import json, sys
sys.path[:0] = json.loads(sys.argv[2])
from cudawrap import wire
from cudawrap.launch import client
print(json.dumps(client.question(sys.argv[1], wire.STATUS, {"whole": "1"})))
"""


class Machine:
    """The install with its service, or with a monitor loop alone (daemonless), as root."""

    def __init__(self, inst: MuInstall, served: bool) -> None:
        self.inst, self.served = inst, served
        self.proc = inst.start(None, inst.world.python, "-I", "-c", cli_code(inst.path),
                               "serve" if served else "monitor")
        if served:
            line = self.proc.stdout.readline().decode()
            assert "listening on" in line, line + self.proc.stderr.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture(params=["daemonless", "served"])
def way(request, mu) -> Iterator[tuple]:  # type: ignore[no-untyped-def]
    yield mu("four-gpus"), request.param == "served"


def _texts(inst: MuInstall, machine: Machine) -> Dict[str, str]:
    """Everything bob may ask cudawrap or read of the monitor's, each as text."""
    bob = inst.world.bob
    out = {}
    for name, args in (("status --json", ("status", "--json")), ("status", ("status",)), ("why", ("why",)),
                       ("why --json", ("why", "--json")), ("health", ("health",)), ("health --json", ("health", "--json"))):
        done = inst.cli(bob, *args)
        assert b"Traceback" not in done.stderr, done.stderr.decode()
        out[name] = done.stdout.decode() + done.stderr.decode()
    runtime = inst.layout.runtime_dir
    files = inst.py_json(bob, READ_FILES, *(str(runtime / f) for f in ("memory.json", "health.state", "health.public")))
    out.update({f"file {k}": v for k, v in files.items()})
    if machine.served:
        done = inst.py(bob, ASK, str(inst.layout.root), json.dumps(list(inst.path)))
        assert done.returncode == 0, done.stderr.decode()
        reply = json.loads(done.stdout)
        out.update({f"service {k}": v for k, v in reply.items()})
    return out


def _named(text: str, name: str, pids: List[int], words: List[str]) -> List[str]:
    """What in TEXT names alice's runs: her NAME, one of their PIDS, one of their WORDS."""
    found = [name] if name in text else []
    found += [str(p) for p in pids if re.search(rf"(?<![\w.]){p}(?![\w.])", text)]
    return found + [w for w in words if w in text]


@pytest.mark.parametrize("private", [True, False], ids=["private", "public"])
def test_private_status_shows_a_user_others_runs_only_as_busy_devices_and_counts(way, private: bool) -> None:
    inst, served = way
    alice, bob = inst.world.alice, inst.world.bob
    inst.write_config(f'[policy]\nforeign = "ignore"\n[service]\nprivate_status = {str(private).lower()}\n')
    inst.wrap("recon")
    inst.wrap("train")  # alice's program: a name nothing of bob's carries
    machine = Machine(inst, served)
    procs: List[subprocess.Popen] = []
    orphan: Optional[int] = None
    try:
        # A leftover: a worker of an ended run of alice's, still on its GPU.
        first = inst.start(alice, "train", "--hold", "0.2", "--orphan", "300")
        ready_line(first)
        orphan = json.loads(first.stdout.readline())["orphan"]
        assert first.wait(timeout=30) == 0
        # Her leases, on every device (foreign processes are ignored: the leftover's too).
        holders = [inst.start(alice, "train", "--hold", "120") for _ in range(4)]
        procs += holders
        devices = [ready_line(h)["devices"][0] for h in holders]
        # Foreign work: a process of hers that cudawrap did not start, on a GPU.
        foreign = inst.start(alice, "sleep", "300")
        procs.append(foreign)
        inst.machine.add_process(foreign.pid, devices[0])
        # She waits, and bob waits behind her.
        hers = inst.start(alice, "train", CUDAWRAP_WAIT="120")
        procs.append(hers)
        waiting_line(hers)
        his = inst.start(bob, "recon", CUDAWRAP_WAIT="120")
        procs.append(his)
        waiting_line(his)
        wait_for(lambda: "leftover" in inst.cli(None, "status").stdout.decode()
                 and (inst.layout.runtime_dir / "memory.json").exists(), timeout=30, what="the monitor's look",
                 details=lambda: str(inst.cli(None, "status")) + str(sorted(
                     p.name for p in inst.layout.runtime_dir.iterdir())))
        pids = [h.pid for h in holders] + [orphan, foreign.pid, hers.pid]
        words = ["train", "sleep 300", "--hold", "--orphan"]
        # Root sees everything, whatever the setting.
        root_view = inst.cli(None, "status", "--json").stdout.decode()
        assert not {str(p) for p in pids} - set(_named(root_view, alice.name, pids, words)), root_view
        seen = _texts(inst, machine)
        shown = {k: _named(v, alice.name, pids, words) for k, v in seen.items()}
        if private:
            assert {k: v for k, v in shown.items() if v} == {}, {k: seen[k] for k, v in shown.items() if v}
            # ... and they are busy devices and counts: held, five processes, two waiting.
            status = json.loads(seen["status --json"])
            assert all(d["holder"] is not None for d in status["devices"])
            assert sorted(w["user"] for w in status["waiting"]) == ["?", bob.name]  # fair share: bob first
            assert sum(len(d["processes"] or ()) for d in status["devices"]) >= 5
            assert "leftover: another user's process" in seen["status"]
            assert re.search(r"^\d+\s+\?\s+\?\s+1\s+\?\s", seen["status"], re.M), seen["status"]  # POS USER PID N PROGRAM
            assert seen["file memory.json"] == "EACCES" and seen["file health.state"] == "EACCES"
            for verb in ("why", "cancel"):  # not told whose it is
                done = inst.cli(bob, verb, str(hers.pid))
                assert done.returncode != 0 and alice.name not in done.stderr.decode(), (verb, done.stderr)
        else:
            # Without it everyone sees who runs what (as `ps` would), each of these ways.
            for where in ("status --json", "status", "health", "file memory.json", "file health.state"):
                assert shown[where], (where, seen[where])
            assert str(hers.pid) in shown["status --json"] and "train" in shown["status --json"]
            assert seen["file health.public"] == "ENOENT"
            if served:
                assert str(hers.pid) in shown["service service_pids"] and alice.name in shown["service status"]
            for verb in ("why", "cancel"):
                done = inst.cli(bob, verb, str(hers.pid))
                assert done.returncode != 0 and alice.name in done.stderr.decode(), (verb, done.stderr)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        if orphan is not None:
            try:
                import os

                os.kill(orphan, signal.SIGKILL)
            except ProcessLookupError:
                pass
        machine.stop()


@pytest.mark.parametrize("private", [True, False], ids=["private", "public"])
def test_mps_status_shows_a_user_others_servers_only_counted(mu_mps, private: bool) -> None:  # type: ignore[no-untyped-def]
    """Without [service] enforce any user may ask a device's MPS daemon for its servers:
    `cudawrap mps status` names alice's server (pid, user) to bob unless private_status."""
    from test_mps import FAKEMPS

    inst = mu_mps
    alice, bob = inst.world.alice, inst.world.bob
    d0 = inst.machine.leaf_uuids()[0]
    inst.write_config(f'[sharing]\nmode = "mps"\nslots = 2\n\n[devices]\nallow = ["{d0}"]\n'
                      f'[service]\nprivate_status = {str(private).lower()}\n')
    inst.sync()
    bindir = inst.dir / "mpsbin"  # the stand-in's control program, where bob may run it too
    bindir.mkdir(mode=0o755)
    (bindir / "nvidia-cuda-mps-control").write_text(f'#!/bin/sh\nexec {inst.world.python} {FAKEMPS} "$@"\n')
    (bindir / "nvidia-cuda-mps-control").chmod(0o755)
    path = f"{bindir}:/usr/bin:/bin"
    started = inst.cli(None, "mps", "start", PATH=path)
    assert started.returncode == 0, started.stderr
    inst.wrap("recon")
    share = inst.start(alice, "recon", "--hold", "600", CUDAWRAP_SHARE="1", CUDAWRAP_WAIT="30")
    try:
        server = ready_line(share)["mps_server"]
        assert server is not None
        for viewer in (None, bob):
            done = inst.cli(viewer, "mps", "status", "--json", PATH=path)
            assert done.returncode == 0, done.stderr
            (row,) = [r for r in json.loads(done.stdout)["devices"] if r["uuid"] == d0]
            hidden = private and viewer is not None
            assert [(s["pid"], s["user"]) for s in row["servers"]] == \
                [(None, "?") if hidden else (server, alice.name)], row
            assert [len(s["clients"]) for s in row["servers"]] == [1]
            text = inst.cli(viewer, "mps", "status", PATH=path).stdout.decode()
            assert (alice.name in text) is not hidden and (str(server) in text) is not hidden, text
    finally:
        share.kill()
        share.wait()


def test_an_estimate_behind_another_users_hidden_run_names_no_program() -> None:
    """Under private_status a run ahead of yours is another user's without its program: the
    start is unknown, and the basis says why without guessing a name (the ledger knows it)."""
    import time

    from cudawrap.ledger.eta import estimate
    from cudawrap.policy.privacy import waiter

    now = time.time()
    device = {"uuid": "GPU-a", "holder": None, "drains": []}
    theirs = {"key": "1.7.1s", "pid": 7, "user": "alice", "count": 1, "candidates": None, "position": 1,
              "kind": "busy", "program": "train"}
    mine = {"key": "2.9.1s", "pid": 9, "user": "bob", "count": 1, "candidates": None, "position": 2,
            "kind": "busy", "program": "recon"}
    runs = {"train": (600.0, 20), "recon": (60.0, 20)}
    assert estimate(mine, [theirs, mine], [device], runs, now) == (600.0, "run lengths: train 10 min (median of 20); "
                                                                    "1 run ahead")
    hidden = waiter(theirs, "bob")
    assert (hidden["pid"], hidden["user"], hidden["program"], hidden["key"]) == (None, "?", "?", "?")
    seconds, why = estimate(mine, [hidden, mine], [device], runs, now)
    assert seconds is None and why == "another user's run is ahead, and its program is not shown to you"
