"""The benchmark keeps working: its tiny mode runs every section and writes the JSON.

Timings are not asserted (they depend on the machine); correctness figures are:
cudawrap never puts two jobs on one device and every one of its jobs runs.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    # --no-install: never create the peers venv from a test (gpuselect is skipped if absent).
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--tiny", "--no-install", "--no-plots",
         "--out", str(out), "--results-md", str(out / "RESULTS.md")],
        capture_output=True, text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (out / "RESULTS.md").exists()  # only a full run writes the committed table
    return json.loads((out / "latest.json").read_text())


def test_tiny_run_has_every_section(tiny):
    assert tiny["mode"] == "tiny"
    for key in ("schema", "date", "machine", "config", "peers", "targets",
                "launch", "burst", "scale", "nvml"):
        assert key in tiny, key
    for key in ("cpu", "cores", "python", "kernel"):
        assert tiny["machine"][key]


def test_launch_section(tiny):
    for topology in tiny["launch"].values():
        methods = topology["methods"]
        for name in ("direct", "python -I -c pass", "cudawrap", "nvisel", "getgpu"):
            assert methods[name]["median_ms"] > 0, name
        assert methods["cudawrap"]["failures"] == 0
        assert methods["cudawrap"]["max_rss_mib"] > 0
        assert topology["breakdown"]["phases_ms"]
        assert topology["breakdown"]["importtime_self_by_package_ms"]


def test_burst_cudawrap_never_overlaps(tiny):
    for topology in tiny["burst"].values():
        ours = topology["tools"]["cudawrap"]
        assert ours["overlap_pairs"] == 0
        assert ours["failures"] == 0 and ours["ok"] == ours["n"]
        assert ours["order"]["queue_kendall_distance"] in (0, 0.0, None)
        for tool in ("nvisel", "getgpu"):
            assert tool in topology["tools"]
        for release in topology["simultaneous_release"].values():
            assert release["overlap_pairs"] == 0 and release["failures"] == 0


def test_scale_and_nvml_sections(tiny):
    for run in tiny["scale"]["runs"].values():
        assert run["overlap_pairs"] == 0 and run["failures"] == 0
        assert run["cpu_while_waiting"]["in_queue"] == run["waiters"]
        assert "all_waiters_pct_of_one_core" in run["cpu_while_waiting"]
    nvml = tiny["nvml"]
    assert set(nvml["launch_median_ms"]["cudawrap"]) == {str(d) for d in nvml["slow_init_ms"]}
