"""The ledger's appends (bounded, rotated, never glued onto a torn line) and the metrics text."""
import json
import re
from pathlib import Path

from cudawrap.ops.ledger import Observation, append, read, rotated
from cudawrap.ops.metrics import Counters, render


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
