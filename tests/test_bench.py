"""The benchmark keeps working: its tiny mode runs every section and writes the JSON.

Timings are not asserted (they depend on the machine); correctness figures are:
cudawrap never puts two jobs on one device and every one of its jobs runs. And a run writes
its summary and tables to RESULTS.md only (the docs include that file as it is; no figure is
copied into the README).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import report  # noqa: E402


def test_results_carry_their_summary_and_the_readme_none():
    results = (REPO / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    block = report.block_of(results)
    assert "Measured in one run of `python3 bench/run.py` (full mode)" in block and "checkout" in block
    assert report.START not in (REPO / "README.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    # --no-install: never create the peers venv from a test (gpuselect is skipped if absent).
    # --publish into a copy: RESULTS.md as a full run writes it.
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "run.py"), "--tiny", "--no-install", "--no-plots", "--publish",
         "--out", str(out), "--results-md", str(out / "RESULTS.md")],
        capture_output=True, text=True, timeout=400, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def tiny(tiny_run: Path) -> dict:
    return json.loads((tiny_run / "latest.json").read_text())


def test_a_run_writes_its_summary_with_date_commit_and_machine_to_results(tiny_run, tiny):
    results = (tiny_run / "RESULTS.md").read_text(encoding="utf-8")
    block = report.block_of(results)
    assert "Provisional: a tiny run" in results
    assert tiny["date"] in block and tiny["interpreter"]["version"] in block
    assert tiny["machine"]["cpu"] in block and "checkout" in block
    assert "issue" not in results.lower()


def test_ratios_are_against_the_installed_shims_interpreter(tiny):
    interp = tiny["interpreter"]
    assert "/opt/cudawrap/venv/bin/python" in interp["python"]
    for topology in tiny["launch"].values():
        assert topology["commands"]["python -I -c pass"].split()[0] == interp["python"]
        assert topology["commands"]["python -IS -c pass"].split()[0] == interp["python"]
        for name in ("cudawrap", "cudawrap+monitor"):
            assert topology["methods"][name]["x_bare_python_S"] > 0
        assert topology["monitor_cpu"]["pct_of_one_core"] >= 0
        assert topology["nvisel_threshold"]["separates"]


def test_tiny_run_has_every_section(tiny):
    assert tiny["mode"] == "tiny"
    for key in ("schema", "date", "machine", "config", "peers", "targets",
                "launch", "burst", "scale", "nvml", "foreign"):
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
        # From the jobs' own logged start times: stand-in jitter may count, so only its range.
        assert 0 <= (ours["order"]["kendall_distance"] or 0) <= 1
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


def test_foreign_section(tiny):
    """Launches after an unwrapped CUDA run: every one ran (times are the bench's to judge)."""
    foreign = tiny["foreign"]
    assert foreign["failures"] == 0
    assert len(foreign["after_foreign_ms"]) == foreign["rounds"] == len(foreign["idle_ms"])
    assert len(foreign["queued"]["gap_ms"]) == foreign["queued"]["rounds"]
    assert "foreign_exit_launch_within_250ms" in tiny["targets"]
