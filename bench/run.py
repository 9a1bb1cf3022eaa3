#!/usr/bin/env python3
"""cudawrap's benchmark: launch overhead, burst correctness, scale, NVML cost and a launch after an
unwrapped CUDA program, side by side with the peers (gpuselect, nvisel, a getgpu-style script),
on the simulated machine.

    python3 bench/run.py            # the full run (~9-13 min on 2 idle cores); updates bench/RESULTS.md
    python3 bench/run.py --quick    # the same sections, smaller (~2 min)
    python3 bench/run.py --tiny     # a few seconds per section; what tests/test_bench.py runs

Results: bench/results/latest.json and PNG plots in bench/results/ (gitignored). Sets up
its own environment in a temporary directory: cudawrap installed by install.sh --prefix,
the fake libnvidia-ml.so.1, one machine per scenario, the stand-ins wrapped by the
installed create-cudawrap. gpuselect pins an older nvidia-ml-py, so it lives in a
venv of its own, bench/results/peers-venv, created on first use (pip install gpuselect
matplotlib; --no-install skips that and runs without gpuselect). See bench/README.md.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEV_PYTHON = REPO / ".venv" / "bin" / "python"

# `python3 bench/run.py` from any interpreter: cudawrap and pynvml come from the dev venv.
if (importlib.util.find_spec("cudawrap") is None or importlib.util.find_spec("pynvml") is None) \
        and DEV_PYTHON.exists() and Path(sys.executable) != DEV_PYTHON and not os.environ.get("CUDAWRAP_BENCH_REEXEC"):
    os.environ["CUDAWRAP_BENCH_REEXEC"] = "1"
    os.execv(str(DEV_PYTHON), [str(DEV_PYTHON), __file__] + sys.argv[1:])

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from typing import Any, Callable, Dict, List, Tuple  # noqa: E402

sys.path.insert(0, str(BENCH))

import report  # noqa: E402
from about import checkout, machine_info  # noqa: E402
from resultsmd import write_section  # noqa: E402
from sim import Bench, find_peers  # noqa: E402

SECTIONS = ("launch", "burst", "scale", "nvml", "foreign")

# Sizes per mode. Full: the numbers. Quick: ~2 minutes. Tiny: the test's.
MODES: Dict[str, Dict[str, Any]] = {
    "full": {
        "launch": {"topologies": ["a100-mig7", "dgx-a100-mig56"], "reps": 30, "warmup": 3, "rss_reps": 5,
                   "breakdown_reps": 7, "monitor_s": 20.0},
        "burst": {"topologies": ["a100-mig7", "four-gpus"], "n": 100, "hold": 1.0, "standin_reps": 7,
                  "release_leads": [0.3, 1.5], "makespan": {"n": 50, "hold": 1.0}},
        # Releases spread 0.1 s apart: 2 cores start about 10 stand-ins a second with room
        # to spare, so dispatch measures cudawrap rather than a saturated CPU.
        "scale": {"topology": "dgx-a100-mig56", "waiters": [50, 500], "hold": 6.0, "window": 10.0, "settle": 3.0,
                  "spread": 5.6, "stagger": 0.005, "decision_reps": 3},
        "nvml": {"topology": "four-gpus", "delays_ms": [0, 100, 500, 2000], "reps": 5},
        "foreign": {"rounds": 10, "hold": 0.3, "waiting": 5},
    },
    "quick": {
        "launch": {"topologies": ["a100-mig7", "dgx-a100-mig56"], "reps": 5, "warmup": 1, "rss_reps": 1,
                   "breakdown_reps": 1, "monitor_s": 4.0},
        "burst": {"topologies": ["a100-mig7"], "n": 20, "hold": 0.4, "standin_reps": 2,
                  "release_leads": [0.3], "makespan": {"n": 20, "hold": 0.4}},
        "scale": {"topology": "dgx-a100-mig56", "waiters": [20, 60], "hold": 2.0, "window": 1.5, "settle": 1.0,
                  "spread": 2.0, "stagger": 0.005, "decision_reps": 1},
        "nvml": {"topology": "four-gpus", "delays_ms": [0, 500], "reps": 1},
        "foreign": {"rounds": 10, "hold": 0.3, "waiting": 2},
    },
    "tiny": {
        "launch": {"topologies": ["a100-mig7"], "reps": 2, "warmup": 1, "rss_reps": 1, "breakdown_reps": 1,
                   "monitor_s": 1.0},
        "burst": {"topologies": ["a100-mig7"], "n": 9, "hold": 0.2, "standin_reps": 1,
                  "release_leads": [0.2], "makespan": {"n": 9, "hold": 0.2}},
        "scale": {"topology": "a100-mig7", "waiters": [3, 8], "hold": 0.2, "window": 0.3, "settle": 0.1,
                  "spread": 0.1, "stagger": 0.005, "decision_reps": 1},
        "nvml": {"topology": "four-gpus", "delays_ms": [0, 50], "reps": 1},
        "foreign": {"rounds": 2, "hold": 0.1, "waiting": 1},
    },
}


class ForeignCpu:
    """CPU the rest of the machine used: all busy CPU time minus this benchmark's own.

    This process and every descendant it (or they) waited for are counted as ours, through
    getrusage; /proc/stat gives the machine's total. lap() returns the others' share since
    the previous lap, as % of all cores: near 0 means the figures had the machine alone.
    """

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")
        self.last = self._read()

    def _read(self) -> tuple:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / self.tick  # minus idle, iowait
        own = 0.0
        import resource

        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
            usage = resource.getrusage(who)
            own += usage.ru_utime + usage.ru_stime
        return time.monotonic(), busy, own

    def lap(self) -> float:
        now = self._read()
        wall = now[0] - self.last[0]
        others = max((now[1] - self.last[1]) - (now[2] - self.last[2]), 0.0)
        self.last = now
        return round(100.0 * others / (wall * (os.cpu_count() or 1)), 1) if wall > 0 else 0.0


def draw(results_path: Path, out_dir: Path, peers_venv: Path) -> List[str]:
    """Plots via the peers venv (matplotlib) if it has it, else SVG from this interpreter."""
    python = peers_venv / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", "import matplotlib"],
                                             capture_output=True).returncode != 0:
        python = Path(sys.executable)
    done = subprocess.run([str(python), str(BENCH / "plots.py"), str(results_path), str(out_dir)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        print(f"bench: plots failed: {done.stderr.strip()[-500:]}", file=sys.stderr)
        return []
    return done.stdout.split()


def section(name: str, bench: Bench, c: Dict[str, Any]) -> Tuple[str, Callable[[], Any]]:
    """What section NAME says as it starts, and how it runs with its sizes C."""
    if name == "launch":
        from overhead import run_launch

        return (f"launch overhead on {', '.join(c['topologies'])}",
                lambda: run_launch(bench, c["topologies"], c["reps"], c["warmup"], c["rss_reps"],
                                   c["breakdown_reps"], c["monitor_s"]))
    if name == "burst":
        from burst import run_burst

        return (f"bursts of {c['n']} on {', '.join(c['topologies'])}",
                lambda: run_burst(bench, c["topologies"], c["n"], c["hold"], c["standin_reps"],
                                  c["release_leads"], c.get("makespan")))
    if name == "scale":
        from scale import run_scale

        return (f"scale, {c['waiters']} waiters on {c['topology']}",
                lambda: run_scale(bench, c["topology"], c["waiters"], c["hold"], c["window"],
                                  c["settle"], c["spread"], c["stagger"], c["decision_reps"]))
    if name == "nvml":
        from overhead import run_nvml

        return f"slow NVML init {c['delays_ms']} ms", lambda: run_nvml(bench, c["topology"], c["delays_ms"], c["reps"])
    from foreign import run_foreign

    return (f"launches after {c['rounds']} unwrapped runs",
            lambda: run_foreign(bench, c["rounds"], c["hold"], c["waiting"]))


def results_section(results: Dict[str, Any], text: str) -> str:
    """run.py's own section of RESULTS.md: the summary block, then every table."""
    mode = results["mode"]
    provisional = "" if mode == "full" else (
        f"**Provisional: a {mode} run, not the published figures; `python3 bench/run.py` replaces it.**\n\n")
    return (provisional + "Written by `python3 bench/run.py`; how it measures: bench/README.md. The summary below "
            "is the block the documentation's benchmark pages show, written by the same run.\n\n## Summary\n\n"
            + report.summary(results) + "\n" + text)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/run.py", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sizes, ~2 minutes")
    size.add_argument("--tiny", action="store_true", help="smallest sizes (the test suite's)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--out", type=Path, default=BENCH / "results", help="where latest.json and plots go")
    parser.add_argument("--peers-venv", type=Path, default=BENCH / "results" / "peers-venv",
                        help="venv with gpuselect and matplotlib (created unless --no-install)")
    parser.add_argument("--no-install", action="store_true", help="never create the peers venv")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--keep-work", action="store_true", help="keep the temporary work directory")
    parser.add_argument("--results-md", type=Path, default=BENCH / "RESULTS.md",
                        help="file whose `run` section the full run's tables replace (only a full run writes it)")
    parser.add_argument("--publish", action="store_true",
                        help="write RESULTS.md from a --quick or --tiny run too "
                             "(marked with its mode; for checking the output, not for publishing figures)")
    parser.add_argument("--nvml-timing", default="", metavar="COSTS",
                        help="what the stand-in NVML charges (FAKENVML_TIMING, tests/fakenvml/FORMAT.md): "
                             "default an H200's; 'none' charges nothing (the launch's own cost). "
                             "Only a run at the default writes RESULTS.md")
    args = parser.parse_args(argv)
    mode = "tiny" if args.tiny else ("quick" if args.quick else "full")
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]}; choose from {', '.join(SECTIONS)}")
    config = {s: MODES[mode][s] for s in sections}

    started = time.monotonic()
    peers = find_peers(args.peers_venv, install=not args.no_install)
    work = Path(tempfile.mkdtemp(prefix="cudawrap-bench-"))
    results: Dict[str, Any] = {
        "schema": 1, "mode": mode, "nvml_timing": args.nvml_timing or "H200 (the default)",
        "command": " ".join(["python3", "bench/run.py"] + argv),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(), "checkout": checkout(), "config": config,
        "peers": {"available": peers.available(), "notes": peers.notes,
                  "gpuselect_python": peers.gpuselect_python, "nvisel": peers.nvisel},
    }
    timings: Dict[str, float] = {}
    foreign: Dict[str, float] = {}
    meter = ForeignCpu()
    results["section_s"] = timings
    results["foreign_cpu_pct"] = foreign
    try:
        bench = Bench(work, peers, nvml_timing=args.nvml_timing)
        results["interpreter"] = bench.install.describe
        timings["setup"] = time.monotonic() - started
        for name in SECTIONS:
            if name in config:
                what, run = section(name, bench, config[name])
                print(f"bench: {what} ...", file=sys.stderr, flush=True)
                results[name] = run()
                timings[name] = time.monotonic() - started - sum(timings.values())
                foreign[name] = meter.lap()
    finally:
        if args.keep_work:
            print(f"bench: work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    results["elapsed_s"] = time.monotonic() - started
    results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["targets"] = report.targets(results)

    args.out.mkdir(parents=True, exist_ok=True)
    latest = args.out / "latest.json"
    latest.write_text(json.dumps(results, indent=1) + "\n")
    text = report.render(results)
    print(text)
    if not args.no_plots:
        plots = draw(latest, args.out, args.peers_venv)
        if plots:
            print("plots: " + ", ".join(plots))
    print(f"results: {latest}")
    if (mode == "full" or args.publish) and set(sections) == set(SECTIONS) and not args.nvml_timing:
        write_section("run", results_section(results, text), args.results_md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
