#!/usr/bin/env python3
"""A wrapped launch right after an unwrapped CUDA program ended, the monitor running.

Each round runs the stand-in CUDA program unwrapped (a foreign process, cudawrap's snapshot
lists it while it runs) for HOLD seconds on the machine's one GPU, waits for it to exit,
then times one wrapped `true` from spawn to exit. The GPU is idle by then, so the launch
should cost what a launch on an idle GPU costs (the baseline rounds, with no foreign run
before them). Before the snapshot discounted an exited foreign process and waiters woke on
its exit, each such launch waited for the next decision, ~1 s.

Then, WAITING rounds: a wrapped `true` started while an unwrapped run holds the GPU (listed
in the snapshot by then) waits in line; the time from the unwrapped run's exit to the
wrapped `true`'s is how long the idle GPU stayed unused (a second at most, before waiters
woke on the foreign process's exit and on the snapshot's rewrite).

    python3 bench/foreign.py [--rounds 10] [--hold 0.3] [--waiting 5]   # prints the times
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from overhead import time_launch  # noqa: E402
from sim import Bench, Sim, find_peers  # noqa: E402
from stats import summary_ms  # noqa: E402

TOPOLOGY = str(BENCH / "h200.topo")  # one GPU, as the H200 the stall was seen on
TARGET_S = 0.25  # the slowest launch after a foreign exit


def rounds(sim: Sim, n: int, hold: float) -> Dict[str, Any]:
    """N launches of the wrapped `true` each right after a foreign run of HOLD s, and N
    without a foreign run before (the baseline); failures are launches that did not exit 0."""
    env = sim.environ()
    foreign = sim.argv("direct", "job", ["--hold", f"{hold:g}", "--require", "1"])
    wrapped = sim.argv("cudawrap", "true", [])
    after: List[float] = []
    idle: List[float] = []
    failures = 0
    with sim.monitor():
        for _ in range(n):
            elapsed, rc = time_launch(wrapped, env)
            idle.append(elapsed)
            failures += rc != 0
            done = subprocess.run(foreign, env=env, capture_output=True, timeout=60)
            if done.returncode != 0:
                raise RuntimeError(f"the unwrapped run failed ({done.returncode}): {done.stderr[-500:]!r}")
            elapsed, rc = time_launch(wrapped, env)
            after.append(elapsed)
            failures += rc != 0
    return {"topology": Path(sim.topology_name).stem, "rounds": n, "foreign_hold_s": hold,
            "after_foreign_ms": [round(t * 1000, 1) for t in after], "after_foreign": summary_ms(after),
            "idle_ms": [round(t * 1000, 1) for t in idle], "idle": summary_ms(idle), "failures": failures,
            "slowest_after_foreign_ms": round(max(after) * 1000, 1), "target_ms": TARGET_S * 1000,
            "met": max(after) <= TARGET_S and failures == 0}


def queued(sim: Sim, n: int) -> Dict[str, Any]:
    """N wrapped launches queued behind an unwrapped run: from its exit to theirs, ms."""
    env = sim.environ()
    foreign = sim.argv("direct", "job", ["--hold", "1.2", "--require", "1"])
    wrapped = sim.argv("cudawrap", "true", [])
    gaps: List[float] = []
    failures = 0
    with sim.monitor():
        for _ in range(n):
            holder = subprocess.Popen(foreign, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            holder.stdout.readline()  # registered: NVML lists it from now on
            time.sleep(0.6)  # a snapshot (every 0.5 s) lists it too
            waiter = subprocess.Popen(wrapped, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            holder.wait()
            freed = time.perf_counter()
            rc = waiter.wait()
            gaps.append(time.perf_counter() - freed)
            failures += rc != 0 or holder.returncode != 0
    return {"rounds": n, "gap_ms": [round(t * 1000, 1) for t in gaps], "gap": summary_ms(gaps),
            "failures": failures}


def run_foreign(bench: Bench, n: int, hold: float, waiting: int = 0) -> Dict[str, Any]:
    sim = bench.sim(TOPOLOGY)
    result = rounds(sim, n, hold)
    if waiting:
        result["queued"] = queued(sim, waiting)
        result["failures"] += result["queued"]["failures"]
        result["met"] = result["met"] and result["queued"]["failures"] == 0
    return result


def render(result: Dict[str, Any]) -> str:
    lines = [f"wrapped `true` right after an unwrapped CUDA run of {result['foreign_hold_s']:g} s, "
             f"monitor running, {result['topology']} (simulated):",
             "  after a foreign exit, ms: " + " ".join(f"{t:g}" for t in result["after_foreign_ms"]),
             "  idle GPU (baseline), ms: " + " ".join(f"{t:g}" for t in result["idle_ms"]),
             f"  median {result['after_foreign']['median_ms']} ms after a foreign exit vs "
             f"{result['idle']['median_ms']} ms idle; slowest {result['slowest_after_foreign_ms']} ms "
             f"(target <= {result['target_ms']:g} ms: {'met' if result['met'] else 'NOT met'}); "
             f"failures {result['failures']}"]
    if "queued" in result:
        q = result["queued"]
        lines += ["wrapped `true` queued behind an unwrapped run, from its exit to the wrapped run's, ms: "
                  + " ".join(f"{t:g}" for t in q["gap_ms"]),
                  f"  median {q['gap']['median_ms']} ms, slowest {max(q['gap_ms']):g} ms; failures {q['failures']}"]
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/foreign.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--hold", type=float, default=0.3, help="seconds the unwrapped run holds the GPU")
    parser.add_argument("--waiting", type=int, default=5, help="rounds of a wrapped run queued behind one")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="cudawrap-foreign-"))
    try:
        result = run_foreign(Bench(work, find_peers(BENCH / "results" / "peers-venv", install=False)),
                             args.rounds, args.hold, args.waiting)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
