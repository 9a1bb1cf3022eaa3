"""What moving a process into a run's cgroup costs: p50/p95 of N moves, on each mechanism.

    sudo .venv/bin/python bench/cgroupmove.py [--moves 400]

Each move is the service's work for one run: make the run's cgroup below the mover's own,
confine it (the BPF program on v2, the devices lists on v1), move a waiting process in
(the write to cgroup.procs), and, separately, the write alone. The process then exits and
the cgroup is removed, outside the timed part. Figures in microseconds. Run as root.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cudawrap.base import cgroup  # noqa: E402
from cudawrap.base.devrule import gpu_rule  # noqa: E402


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(kind: str, moves: int):
    mech = cgroup.choose(kind)
    top = mech.make(mech.parent_of(os.getpid()), f"cudawrap-bench-{os.getpid()}")
    rule = gpu_rule(frozenset({1}))
    setup, move = [], []
    try:
        for i in range(moves):
            proc = subprocess.Popen(["sleep", "30"])
            t0 = time.perf_counter()
            run = mech.make(top, f"run{i}")
            mech.confine(run, rule)
            t1 = time.perf_counter()
            mech.move(run, proc.pid)
            t2 = time.perf_counter()
            proc.kill()
            proc.wait()
            while mech.pids(run):
                time.sleep(0.0005)
            mech.remove(run)
            setup.append((t1 - t0) * 1e6)
            move.append((t2 - t1) * 1e6)
    finally:
        mech.remove(top)
    return setup, move


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moves", type=int, default=400)
    args = ap.parse_args()
    print(f"kernel {os.uname().release}, {args.moves} moves each, microseconds")
    print(f"{'mechanism':10} {'make+confine p50':>17} {'p95':>8} {'move p50':>9} {'p95':>8}")
    for kind in ("v1", "v2"):
        setup, move = measure(kind, args.moves)
        print(f"{kind:10} {pct(setup, .5):17.0f} {pct(setup, .95):8.0f} {pct(move, .5):9.0f} {pct(move, .95):8.0f}")


if __name__ == "__main__":
    main()
