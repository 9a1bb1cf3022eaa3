"""The ledger's appends (bounded, rotated, never glued onto a torn line) and the metrics text."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from cudawrap.install.units import MONITOR_NICE
from cudawrap.ledger.looks import Observation
from cudawrap.ledger.files import append, read, rotated
from cudawrap.monitor.metrics import Counters, render


def record(n: int) -> dict:
    return {"v": 1, "event": "grant", "id": f"lease-{n}", "pid": n, "devices": ["GPU-0"], "start": float(n)}


def test_appends_rotate_at_the_limit_and_keep_only_so_many_files(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    size = len(json.dumps(record(10), sort_keys=True, separators=(",", ":"))) + 1
    for n in range(10, 60):
        append(path, [record(n)], max_bytes=5 * size, keep=2)
    files = [p for p in rotated(path, 2) if p.exists()]
    assert [p.name for p in files] == ["ledger.2", "ledger.1", "ledger"]
    assert all(p.stat().st_size <= 5 * size for p in files) and path.stat().st_mode & 0o777 == 0o600
    problems: list = []
    ids = [r["id"] for r in read(files, problems)]
    assert problems == [] and ids == [f"lease-{n}" for n in range(45, 60)]  # the newest 15, in order
    assert not (tmp_path / "ledger.3").exists()


def test_a_torn_last_line_is_left_alone_and_the_next_record_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    append(path, [record(1)], 1 << 20, 4)
    with open(path, "a") as f:
        f.write('{"v":1,"event":"gra')  # a crash in the middle of a write
    append(path, [record(2)], 1 << 20, 4)
    problems: list = []
    assert [r["id"] for r in read([path], problems)] == ["lease-1", "lease-2"]
    assert problems == [f"{path}:2: unreadable record skipped"]


def test_the_metrics_text_is_valid_exposition_format() -> None:
    counters = Counters()
    counters.add(Observation(grants=[{"wait_s": 0.05}, {"wait_s": 30.0}, {"wait_s": None}],
                             ends=[{"user": 'e"ve', "start": 0.0, "end": 10.0, "devices": ["a", "b"]}], abandoned=2))
    devices = [{"uuid": "GPU-1", "gpu": 0, "name": "A100", "user": "ann", "drained": True, "memory_used_bytes": 1 << 30},
               {"uuid": "MIG-2", "gpu": 1, "name": "1g.10gb", "user": "", "drained": False, "memory_used_bytes": None}]
    text = render(devices, {0: 3}, counters)
    sample = re.compile(r'^[a-z_]+(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? -?[0-9.e+]+$')
    for line in text.splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    assert 'cudawrap_device_held{device="GPU-1",gpu="0",name="A100",user="ann"} 1' in text
    assert 'cudawrap_device_drained{device="GPU-1",gpu="0",name="A100"} 1' in text
    assert 'cudawrap_device_memory_used_bytes{device="GPU-1",gpu="0",name="A100"} 1073741824' in text
    assert "MIG-2" not in text.split("cudawrap_device_memory_used_bytes")[2]  # unknown memory: no sample
    assert 'cudawrap_queue_length{user="root"} 3' in text
    assert "cudawrap_grants_total 3" in text and "cudawrap_timeouts_total 2" in text
    assert 'cudawrap_wait_seconds_bucket{le="0.1"} 1' in text and 'cudawrap_wait_seconds_bucket{le="60"} 2' in text
    assert 'cudawrap_wait_seconds_bucket{le="+Inf"} 2' in text and "cudawrap_wait_seconds_count 2" in text
    assert 'cudawrap_ledger_device_seconds_total{user="e\\"ve"} 20.000' in text


# --- notes: what the monitor did about the GPUs' health, beside the leases ------------------

OLD = [record(1), dict(record(1), event="end", end=5.0, user="ann", uid=1000, program="p", how="ended")]
NOTES = [{"v": 1, "event": "health-drain", "device": "GPU-0", "at": 3.0, "reason": "health: Xid 79"},
         {"v": 1, "event": "leftover", "device": "GPU-0", "at": 4.0, "pid": 42, "uid": 1000, "user": "ann"},
         {"v": 1, "event": "idle", "device": "GPU-0", "at": 4.0, "uid": 1000, "user": "ann", "start": 2.0, "end": 4.0},
         {"v": 1, "event": "health-resume", "device": "GPU-0", "at": 9.0, "reason": "clear for 60 s"}]


def write_lines(path: Path, records: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_lease_readers_pass_over_notes_and_an_old_ledger_reads_as_before(tmp_path: Path) -> None:
    from cudawrap.ops.usage import leases

    old, mixed = tmp_path / "old", tmp_path / "mixed"
    write_lines(old, OLD)
    write_lines(mixed, OLD[:1] + NOTES[:2] + OLD[1:] + NOTES[2:])
    problems: list = []
    assert list(read([old], problems)) == OLD == list(read([mixed], problems))
    assert problems == []
    (lease,) = leases(read([mixed], problems, ("grant", "end", "idle")), (), 10.0, problems)
    assert (lease.user, lease.start, lease.end) == ("ann", 1.0, 5.0) and problems == []
    notes = list(read([mixed], problems, ("health-drain", "health-resume", "leftover", "idle")))
    assert [n["event"] for n in notes] == ["health-drain", "leftover", "idle", "health-resume"]


def test_a_note_without_its_device_or_time_and_an_unknown_kind_are_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "ledger"
    write_lines(path, [{"v": 1, "event": "leftover", "at": 1.0}, {"v": 1, "event": "idle", "device": "GPU-0"},
                       {"v": 1, "event": "reboot", "device": "GPU-0", "at": 1.0}, NOTES[0]])
    problems: list = []
    assert [r["event"] for r in read([path], problems, ("health-drain", "leftover", "idle"))] == ["health-drain"]
    assert problems == [f"{path}:{n}: unreadable record skipped" for n in (1, 2, 3)]


def test_notes_wait_for_a_writable_ledger_and_are_written_once(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from cudawrap.ledger.files import Notes

    layout = SimpleNamespace(state_dir=tmp_path)
    (tmp_path / "ledger").mkdir()  # not a file: the append fails
    notes = Notes(layout)  # type: ignore[arg-type]
    notes.add("health-drain", "GPU-0", 3.0, reason="health: Xid 79")
    assert "cannot write the ledger" in (notes.flush((1 << 20, 2)) or "")
    (tmp_path / "ledger").rmdir()
    notes.add("health-resume", "GPU-0", 9.0, reason="clear")
    assert notes.flush((1 << 20, 2)) is None and notes.flush((1 << 20, 2)) is None
    problems: list = []
    got = list(read([tmp_path / "ledger"], problems, ("health-drain", "health-resume")))
    assert [(r["event"], r["at"]) for r in got] == [("health-drain", 3.0), ("health-resume", 9.0)] and problems == []


def test_the_metrics_text_counts_leftover_processes_per_device_and_user() -> None:
    text = render([], {}, Counters(), leftovers={("GPU-1", "ann"): 2, ("MIG-2", "ben"): 1})
    assert "# TYPE cudawrap_leftover_processes gauge" in text
    assert 'cudawrap_leftover_processes{device="GPU-1",user="ann"} 2' in text
    assert 'cudawrap_leftover_processes{device="MIG-2",user="ben"} 1' in text


def test_the_services_monitor_holds_the_ledgers_lock_at_the_services_nice(tmp_path: Path) -> None:
    """The service's grants wait for this lock: its monitor (at MONITOR_NICE) holds it at the
    service's nice, and goes back below once it lets go. Root raises a nice; CI runs as root."""
    code = """
import os
from pathlib import Path
from cudawrap.install.units import MONITOR_NICE
from cudawrap.ledger.files import Locked, hold_at_nice
from cudawrap.paths import Layout
layout = Layout(Path(os.environ["ROOT"]))
layout.state_dir.mkdir(parents=True)
hold_at_nice(os.getpriority(os.PRIO_PROCESS, 0))
os.setpriority(os.PRIO_PROCESS, 0, MONITOR_NICE)
with Locked(layout):
    inside = os.getpriority(os.PRIO_PROCESS, 0)
print(inside, os.getpriority(os.PRIO_PROCESS, 0))
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "ROOT": str(tmp_path / "root")},
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(os.getpriority(os.PRIO_PROCESS, 0)), str(MONITOR_NICE)]
