"""The benchmark keeps working: its tiny mode runs every section and writes the JSON.

Timings are not asserted (they depend on the machine); correctness figures are:
cudawrap never puts two jobs on one device and every one of its jobs runs. And every
benchmark writes its figures to its own section of RESULTS.md only, with when, on what
commit, machine and interpreter they were measured (the docs include that file as it is;
no figure is copied into the README).
"""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "RESULTS.md"
sys.path.insert(0, str(REPO / "bench"))

import report  # noqa: E402
import resultsmd  # noqa: E402

HEADER = re.compile(r"^Measured by `[^`]+`( \(\w+ mode\))?, 20\d\d-\d\d-\d\d \d\d:\d\d UTC, checkout [0-9a-f]{7,}"
                    r"( \+ uncommitted changes)?; .+, \d+ cores.*; interpreter `[^`]+` \(→ .+\), Python 3\.\d+", re.M)


def test_results_carry_their_summary_and_the_readme_none():
    results = RESULTS.read_text(encoding="utf-8")
    block = report.block_of(results)
    assert "Measured in one run of `python3 bench/run.py` (full mode)" in block and "checkout" in block
    assert report.START not in (REPO / "README.md").read_text(encoding="utf-8")


def test_each_benchmark_has_its_own_section_and_nothing_is_outside_one():
    text = RESULTS.read_text(encoding="utf-8")
    sections = resultsmd.sections(text)
    assert {"run", "service", "health"} <= set(sections), sorted(sections)
    assert resultsmd.SECTION.sub("", text).strip() == resultsmd.PREAMBLE.strip()
    for name, section in sections.items():
        if name == "run":
            continue
        assert len(HEADER.findall(section)) == 1, f"{name}: no header line with date, commit, machine, interpreter"
        if not name.startswith(("attacks-", "cgroupmove")):  # (their figures as printed)
            assert "| what | measured | target |" in section, name
            assert re.search(r"\*\*(met|MISSED)\*\*", section), name
            assert re.search(r"^\d+ of \d+ targets met", section, re.M), name
        if name == "attacks-service":  # its figures as printed, its target judged in them
            assert re.search(r"^ +unread .* (met|MISSED)$", section, re.M), name
            assert re.search(r"^target: .* \d+ of \d+ met", section, re.M), name


def test_a_benchmark_replaces_its_own_section_only():
    text = resultsmd.replace_section("", "health", "H1")
    assert text.startswith(resultsmd.PREAMBLE)
    text = resultsmd.replace_section(text, "attacks-storm", "A1")
    text = resultsmd.replace_section(text, "run", "R1")  # goes first, whatever came before it
    text = resultsmd.replace_section(text, "service", "S1")
    assert list(resultsmd.sections(text)) == ["run", "service", "health", "attacks-storm"]
    again = resultsmd.replace_section(text, "service", "S2\ntwo lines")
    assert again == text.replace("\nS1\n", "\nS2\ntwo lines\n")
    # A file as run.py used to write it, whole and without sections, starts again.
    assert resultsmd.replace_section("# Benchmark results\n\nold\n", "run", "R") == \
        resultsmd.PREAMBLE + "\n<!-- bench:run:start -->\nR\n<!-- bench:run:end -->\n"


def test_targets_are_judged_and_a_miss_is_said():
    rows = [("a", 1.5, "≤ 2", resultsmd.at_most(1.5, 2.0)), ("b", 2.5, "≤ 2", resultsmd.at_most(2.5, 2.0)),
            ("c", None, "< 5", resultsmd.below(None, 5.0))]
    table = resultsmd.targets_table(rows)
    assert "| a | 1.50 | ≤ 2 | **met** |" in table and "| b | 2.50 | ≤ 2 | **MISSED** |" in table
    assert "| c | not measured | < 5 | – |" in table
    assert resultsmd.tally(rows) == "1 of 2 targets met, **1 MISSED**."


def _copy_of_results(tmp: Path) -> Path:
    copy = tmp / "RESULTS.md"
    shutil.copy(RESULTS, copy)
    return copy


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    _copy_of_results(out)
    # --no-install: never create the peers venv from a test (gpuselect is skipped if absent).
    # --publish into a copy of RESULTS.md: its run section as a full run writes it.
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


def test_a_run_leaves_the_other_benchmarks_sections_as_they_were(tiny_run, tiny):
    before = resultsmd.sections(RESULTS.read_text(encoding="utf-8"))
    after = resultsmd.sections((tiny_run / "RESULTS.md").read_text(encoding="utf-8"))
    assert list(after) == list(before)
    assert tiny["date"] in after["run"] and tiny["date"] not in before["run"]
    assert {k: v for k, v in after.items() if k != "run"} == {k: v for k, v in before.items() if k != "run"}


@pytest.mark.slow
def test_health_writes_its_own_section(tmp_path: Path):
    copy = _copy_of_results(tmp_path)
    done = subprocess.run([sys.executable, str(REPO / "bench" / "health.py"), "--rounds", "1", "--leftover-rounds",
                           "1", "--work", str(tmp_path / "work"), "--results-md", str(copy)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    before = resultsmd.sections(RESULTS.read_text(encoding="utf-8"))
    after = resultsmd.sections(copy.read_text(encoding="utf-8"))
    assert set(after) == set(before) | {"health"}
    assert {k: v for k, v in after.items() if k != "health"} == {k: v for k, v in before.items() if k != "health"}
    health = after["health"]
    assert HEADER.search(health) and "--rounds 1 --leftover-rounds 1" in health
    assert health.count("(n=1)") == 3 and "3 targets" in health


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


def test_a_script_that_prints_its_figures_gets_them_as_printed_in_its_section():
    # attacks.py's way: what the block prints is kept, still printed, and becomes its section.
    with resultsmd.recording(["bench/attacks.py", "service"]) as recorded:
        print("| attack | p95 |\n| none | 28.6 ms |")
    section = resultsmd.printed_section("## Attacks (`bench/attacks.py service`)", recorded, "A note.")
    assert "bench/attacks.py service" in recorded.run.header()
    assert "```text\n| attack | p95 |\n| none | 28.6 ms |\n```" in section
