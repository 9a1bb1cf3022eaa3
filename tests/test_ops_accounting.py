"""The ledger, `cudawrap usage` and the metrics file, against a real `cudawrap monitor` and real
accounts (run as root; skipped otherwise).

The truth is what the stand-in program logs (its start, its end) and, for kill -9, when the
test killed it; the ledger must agree within 0.5 s plus one monitor period.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict, List

import pytest

from support.installed import ready_line
from support.procs import cli_code, root_only, wait_for
from cudawrap.base.audit import channel_problem
from test_multiuser import probe
from support.users import MuInstall

pytestmark = [pytest.mark.root, root_only]

PERIOD = 0.2
TOLERANCE = 0.5 + PERIOD


def start_monitor(inst: MuInstall) -> subprocess.Popen:
    code = cli_code(inst.path)
    return inst.start(None, inst.world.python, "-I", "-c", code, "monitor", "--period", str(PERIOD))


def ledger(inst: MuInstall) -> List[dict]:
    path = inst.layout.state_dir / "ledger"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ends(inst: MuInstall) -> Dict[int, dict]:
    return {r["pid"]: r for r in ledger(inst) if r["event"] == "end"}


def logged(inst: MuInstall) -> Dict[int, Dict[str, dict]]:
    out: Dict[int, Dict[str, dict]] = {}
    for line in inst.log.read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["pid"], {})[record["event"]] = record
    return out


def test_ledger_within_half_a_second_for_normal_end_signal_and_kill_9(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    metrics = inst.dir / "metrics" / "cudawrap.prom"
    metrics.parent.mkdir()
    inst.layout.config_file.write_text(f'[metrics]\ntextfile = "{metrics}"\n')
    inst.layout.config_file.chmod(0o644)
    monitor = start_monitor(inst)
    wait_for(lambda: metrics.exists(), timeout=20)

    normal = inst.start(alice, "recon", "--hold", "2", "--log", str(inst.log))
    by_signal = inst.start(bob, "recon", "--hold", "60", "--log", str(inst.log))
    killed = inst.start(alice, "recon", "--hold", "60", "--log", str(inst.log))
    for proc in (normal, by_signal, killed):
        ready_line(proc)
    # While they run: the metrics show each held device with its holder.
    wait_for(lambda: metrics.read_text().count('user="cwtest') == 3, timeout=10)
    time.sleep(1.5)
    by_signal.terminate()
    before = time.time()
    os.kill(killed.pid, signal.SIGKILL)
    after = time.time()
    killed_at = (before + after) / 2
    for proc in (normal, by_signal, killed):
        proc.wait(timeout=20)
    assert normal.returncode == 0 and by_signal.returncode == -signal.SIGTERM
    try:
        wait_for(lambda: {normal.pid, by_signal.pid, killed.pid} <= set(ends(inst)), timeout=15)
    except AssertionError:
        monitor.kill()
        raise AssertionError((ledger(inst), (normal.pid, by_signal.pid, killed.pid), monitor.stderr.read()))

    truth = logged(inst)
    recorded = ends(inst)
    grants = {r["pid"]: r for r in ledger(inst) if r["event"] == "grant"}
    for proc, user, end_truth in ((normal, alice, truth[normal.pid]["end"]["time"]),
                                  (by_signal, bob, truth[by_signal.pid]["end"]["time"]),
                                  (killed, alice, killed_at)):
        record = recorded[proc.pid]
        assert grants[proc.pid]["id"] == record["id"]  # the grant was recorded at its time, too
        assert record["user"] == user.name and record["uid"] == user.uid and record["program"] == "recon"
        assert record["devices"] == truth[proc.pid]["start"]["devices"]
        assert abs(record["start"] - truth[proc.pid]["start"]["time"]) <= TOLERANCE, (record, truth[proc.pid])
        assert abs(record["end"] - end_truth) <= TOLERANCE, (record, end_truth)
        assert record["start_lo"] <= record["start"] <= record["start_hi"]
        assert record["end_lo"] <= record["end"] <= record["end_hi"]
        assert record["how"] == "ended" and record["seen_by"] == "monitor"
        assert record["wait_s"] is not None and 0 <= record["wait_s"] <= TOLERANCE  # nobody waited

    # Durable and root's only: mode 0600, and users cannot read or add to it.
    path = inst.layout.state_dir / "ledger"
    assert path.stat().st_uid == 0 and path.stat().st_mode & 0o777 == 0o600
    got = probe(inst, bob, [("read", "open", str(path), ["O_RDONLY"]),
                            ("append", "open", str(path), ["O_WRONLY", "O_APPEND"])])
    assert set(got.values()) <= {"EACCES", "EPERM"}, got

    # usage: root sees both users, each user their own finished runs only.
    def usage(user, *args: str) -> list:  # type: ignore[no-untyped-def]
        done = inst.cli(user, "usage", "--since", "1h", "--json", *args)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    rows = {r["user"]: r for r in usage(None)}
    assert set(rows) == {"cwtest1", "cwtest2"} and rows["cwtest1"]["runs"] == 2
    expected = sum(truth[p]["end"]["time"] - truth[p]["start"]["time"] for p in (normal.pid,)) + (
        killed_at - truth[killed.pid]["start"]["time"])
    assert abs(rows["cwtest1"]["device_seconds"] - expected) <= 2 * TOLERANCE
    assert [r["user"] for r in usage(alice)] == ["cwtest1"]
    assert [r["user"] for r in usage(bob)] == ["cwtest2"]
    assert abs(usage(bob)[0]["device_seconds"] - rows["cwtest2"]["device_seconds"]) < 0.01
    programs = usage(None, "--by", "program")
    assert [r["program"] for r in programs] == ["recon"] and programs[0]["runs"] == 3
    assert {"device_seconds", "runs", "wait_p95_s"} <= set(programs[0])
    table = inst.cli(None, "usage", "--by", "device").stdout.decode()
    assert "DEVICE-HOURS" in table and "total" in table

    # The metrics file: counters as observed, and the ledger's device-seconds per user.
    text = metrics.read_text()
    assert "cudawrap_grants_total 3" in text
    assert 'cudawrap_ledger_device_seconds_total{user="cwtest1"}' in text
    assert text.count('cudawrap_device_held{') == 4 and 'user=""} 0' in text
    assert 'cudawrap_wait_seconds_bucket{le="+Inf"} 3' in text
    monitor.terminate()
    monitor.wait(timeout=10)
    # Without a syslog socket the monitor says so once, not every cycle; the ledger has it all.
    said = monitor.stderr.read().decode().count("syslog messages (the audit trail) are lost")
    assert said == (1 if channel_problem() else 0)


def test_without_the_monitor_a_root_command_records_with_its_precision(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice = inst.world.alice
    inst.wrap("recon")
    assert inst.cli(None, "status").returncode == 0  # a first look
    job = inst.start(alice, "recon", "--hold", "60", "--log", str(inst.log))
    ready_line(job)
    time.sleep(1.0)
    assert inst.cli(None, "status").returncode == 0  # root looks: the grant is recorded
    grant = [r for r in ledger(inst) if r["event"] == "grant"][0]
    assert grant["seen_by"] == "cudawrap status" and grant["pid"] == job.pid
    job.kill()
    job.wait()
    time.sleep(1.0)
    assert inst.cli(alice, "status").returncode == 0  # a user's look writes nothing
    assert [r["event"] for r in ledger(inst)] == ["grant"]
    done = inst.cli(None, "usage", "--json")
    assert done.returncode == 0, done.stderr
    end = [r for r in ledger(inst) if r["event"] == "end"][0]
    # The end lies between the last look that saw it held and this one: stated, not guessed.
    assert end["end_lo"] <= end["end"] <= end["end_hi"] and end["end_hi"] - end["end_lo"] >= 1.0
    assert end["seen_by"] == "cudawrap usage"


def test_an_unwritable_ledger_is_one_line_and_nothing_is_lost(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice = inst.world.alice
    inst.wrap("recon")
    path = inst.layout.state_dir / "ledger"
    path.mkdir()  # nothing can append to it
    job = inst.start(alice, "recon", "--hold", "60")
    ready_line(job)
    done = inst.cli(None, "status")
    assert done.returncode == 0
    warning = [line for line in done.stderr.decode().splitlines() if "ledger" in line]
    assert len(warning) == 1 and f"cannot write the ledger {path}" in warning[0], done.stderr
    path.rmdir()
    assert inst.cli(None, "status").returncode == 0
    assert [(r["event"], r["pid"]) for r in ledger(inst)] == [("grant", job.pid)]


def test_a_corrupted_line_is_skipped_with_one_line_and_the_rest_is_counted(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice = inst.world.alice
    inst.wrap("recon")
    for _ in range(2):
        job = inst.start(alice, "recon", "--hold", "0.5")
        ready_line(job)
        assert inst.cli(None, "status").returncode == 0
        job.wait()
        assert inst.cli(None, "status").returncode == 0
    path = inst.layout.state_dir / "ledger"
    lines = path.read_text().splitlines()
    assert len(lines) == 4
    path.write_text("\n".join(lines[:2] + ['{"event": "end", "id": 3', "\x00\x01garbage"] + lines[2:]) + "\n")
    # And a line torn by a crash mid-write at the end: the next record must not be glued onto it.
    with open(path, "a") as f:
        f.write('{"v":1,"event":"grant","id":"torn')
    job = inst.start(alice, "recon", "--hold", "60")
    ready_line(job)
    done = inst.cli(None, "usage", "--json")
    assert done.returncode == 0, done.stderr
    warnings = done.stderr.decode().splitlines()
    assert len(warnings) == 3 and all("unreadable record skipped" in w for w in warnings), warnings
    assert f"{path}:3:" in warnings[0] and f"{path}:4:" in warnings[1] and f"{path}:7:" in warnings[2]
    rows = json.loads(done.stdout)
    assert rows[0]["user"] == "cwtest1" and rows[0]["runs"] == 3  # two finished, one running now


def test_a_full_disk_loses_nothing(mu, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from support.strace import inject, needs_strace, traced  # noqa: F401

    import shutil

    if shutil.which("strace") is None:
        pytest.skip("needs strace")
    inst = mu("four-gpus")
    alice = inst.world.alice
    inst.wrap("recon")
    assert inst.cli(None, "status").returncode == 0
    job = inst.start(alice, "recon", "--hold", "60")
    ready_line(job)
    saved = tmp_path / "saved"
    shutil.copytree(inst.layout.state_dir, saved, symlinks=True)
    code = cli_code(inst.path)
    argv = [inst.world.python, "-I", "-c", code, "status"]
    env = inst.environ()
    done, calls = traced(argv, env, inst.dir, calls=["write"])
    assert done.returncode == 0, done.stderr
    path = inst.layout.state_dir / "ledger"
    target = [c for c in calls if c.syscall == "write" and c.touches(path)]
    assert len(target) == 1, [c.text for c in calls]
    shutil.rmtree(inst.layout.state_dir)
    shutil.copytree(saved, inst.layout.state_dir, symlinks=True)
    before = path.read_bytes() if path.exists() else b""
    done, hit = inject(argv, target[0], "error=ENOSPC", env, inst.dir)
    assert hit is not None and hit.touches(path), hit
    assert done.returncode == 0, done.stderr
    warning = [line for line in done.stderr.splitlines() if "ledger" in line]
    assert len(warning) == 1 and "No space left on device" in warning[0], done.stderr
    assert (path.read_bytes() if path.exists() else b"") == before  # nothing half-written
    assert inst.cli(None, "status").returncode == 0  # space again: the grant is recorded now
    assert [(r["event"], r["pid"]) for r in ledger(inst)] == [("grant", job.pid)]


@pytest.mark.parametrize("args, words", [
    (["--since", "2026-13-01"], "--since '2026-13-01': not a date"),
    (["--since", "yesterday-ish"], "not a date"),
    (["--until", "99x"], "--until '99x': not a date"),
    (["--since", "1d", "--until", "2d"], "is not before --until"),
    (["--by", "colour"], "colour"),
    (["--plot", ""], "--plot: empty file name"),
])
def test_bad_usage_arguments(mu, args, words) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    done = inst.cli(None, "usage", *args)
    assert done.returncode == 64, done.stderr
    lines = done.stderr.decode().splitlines()
    assert words in lines[0] and len(lines) <= 2, lines
