"""What moving a process into a run's cgroup costs: p50/p95 of N moves, on each mechanism.

    sudo .venv/bin/python bench/cgroupmove.py [--moves 400] [--gap-ms 30] [--no-write]

Each round is the service's work for one run under [confine] runs = true, in three parts
timed apart: making the run's cgroup below the mover's own and confining it to no GPU (the
BPF program on v2, 254 devices.deny lines on v1: the service does this ahead, for the next
run), moving a waiting process in (the write to cgroup.procs: at the run's request, on a
worker while its decision is made), and widening it to one GPU (before the grant is sent:
the part on a launch's path). The process then exits and the cgroup is removed, outside the
timed parts. Figures in microseconds. Run as root.

--gap-ms: a pause before each round. With none, moves follow each other and the kernel's
rcu_sync stays in its slow mode: a move costs ~0.05 ms. Launches are apart (30 ms, say), and
a move alone waits for an RCU grace period first (~10 ms measured on a 6.18 VM) unless a
cgroup hierarchy is mounted with favordynmods.

What it prints becomes its section of bench/RESULTS.md (unless --no-write), with when, on
which commit and on which kernel it ran: one section with a cgroup hierarchy mounted with
favordynmods, one without (the kernel keeps the flag until the next boot once it is set).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cudawrap.base import cgroup  # noqa: E402
from cudawrap.base.devrule import gpu_rule  # noqa: E402


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(kind: str, moves: int, gap_s: float = 0.0):
    mech = cgroup.choose(kind)
    top = mech.make(mech.parent_of(os.getpid()), f"cudawrap-bench-{os.getpid()}")
    rule, none = gpu_rule(frozenset({1})), gpu_rule(frozenset())
    setup, move, widen = [], [], []
    try:
        for i in range(moves):
            proc = subprocess.Popen(["sleep", "30"])
            time.sleep(gap_s)
            t0 = time.perf_counter()
            run = mech.make(top, f"run{i}")
            mech.confine(run, none)
            t1 = time.perf_counter()
            mech.move(run, proc.pid)
            t2 = time.perf_counter()
            mech.confine(run, rule, none)
            t3 = time.perf_counter()
            proc.kill()
            proc.wait()
            while mech.pids(run):
                time.sleep(0.0005)
            mech.remove(run)
            setup.append((t1 - t0) * 1e6)
            move.append((t2 - t1) * 1e6)
            widen.append((t3 - t2) * 1e6)
    finally:
        mech.remove(top)
    return setup, move, widen


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--moves", type=int, default=400)
    ap.add_argument("--gap-ms", type=float, default=0.0, help="pause before each round (launches are apart)")
    ap.add_argument("--no-write", action="store_true", help="print the figures only, not into bench/RESULTS.md")
    args = ap.parse_args()
    from resultsmd import printed_section, recording, write_section  # (bench/, this script's directory)

    dyn = cgroup.favors_dynmods()
    with recording(["bench/cgroupmove.py"] + sys.argv[1:]) as recorded:
        print(f"kernel {os.uname().release}, cgroups {'' if dyn else 'not '}mounted with favordynmods; "
              f"{args.moves} moves each, {args.gap_ms:g} ms apart, microseconds")
        print(f"{'mechanism':10} {'make+confine p50':>17} {'p95':>8} {'move p50':>9} {'p95':>8} {'widen p50':>10} "
              f"{'p95':>8}")
        for kind in ("v1", "v2"):
            parts = measure(kind, args.moves, args.gap_ms / 1000)
            print(f"{kind:10} " + " ".join(f"{pct(v, .5):{w}.0f} {pct(v, .95):8.0f}" for v, w in zip(parts, (17, 9, 10))))
    if not args.no_write:
        # One section per state of the kernel's flag: once set, it stays until the next boot.
        write_section("cgroupmove-favordynmods" if dyn else "cgroupmove", printed_section(
            "## Moving a run into its cgroup (`bench/cgroupmove.py`), cgroups "
            + ("mounted with favordynmods" if dyn else "not mounted with favordynmods"), recorded,
            "The service's work for one run under `[confine] runs = true` (bench/README.md says what each part "
            "is); what confinement adds to a served launch is judged in the service's section."))


if __name__ == "__main__":
    main()
