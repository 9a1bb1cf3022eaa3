"""A launch through `cudawrap serve`, against the interpreter the shim runs on, started as the shim starts it.

For each topology: a block without the service (the launch decides for itself), then a
block with `cudawrap serve` running, each alternating round-robin between a wrapped C
`true`, the bare interpreter (`-IS -c pass`, the shim's own flags, and `-I -c pass`) and
`true` itself; medians and ratios to the bare interpreter of the same block are printed.
The issue's targets for the service block: <= 1.25x `-IS -c pass`, <= 1.0x `-I -c pass`.

Then, with the service still running, the ledger's accuracy: RUNS wrapped C programs
(bench/hold.c, no interpreter) hold their device HOLD seconds one after another; each run's
lease in the ledger (written by the service at its grant and at its release) is compared
with the interval the program logs itself (its start, its end). The issue's target: every
run counted, each lease within 10 ms of the logged interval. Figures only: nothing here
asserts a time.

    sudo python3 bench/service.py [--reps 40] [--topologies a100-mig7 dgx-a100-mig56]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import BARE, BARE_S, measure  # noqa: E402
from sim import Bench, Peers, Sim  # noqa: E402

WRAPPED = "wrapped true"


def _block(sim: Sim, reps: int) -> Dict[str, dict]:
    cmds: Dict[str, List[str]] = {
        WRAPPED: [str(sim.true_wrapped)],
        BARE_S: [sim.install.python, "-IS", "-c", "pass"],
        BARE: [sim.install.python, "-I", "-c", "pass"],
        "direct": [str(sim.true)],
    }
    return measure(cmds, sim.environ(), reps)


def _answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


LEDGER_RUNS = 12
LEDGER_HOLD_S = 0.1


def ledger_accuracy(sim: Sim, runs: int, hold: float) -> dict:
    """RUNS wrapped hold.c runs of HOLD s through the service, one after another: how many
    the ledger counts, and how far each lease (grant to release) exceeds the interval the
    program logged (its start to its end), in ms."""
    if sim.hold_wrapped is None:
        return {"error": "no C compiler: bench/hold.c was not built"}
    log = sim.work / "ledger-runs.log"
    pids = []
    for _ in range(runs):
        done = subprocess.run([str(sim.hold_wrapped), f"{hold:g}", str(log)], env=sim.environ(),
                              capture_output=True, timeout=60)
        if done.returncode != 0:
            return {"error": f"a run failed ({done.returncode}): {done.stderr.decode()[-300:]}"}
    logged: Dict[int, Dict[str, float]] = {}
    for rec in map(json.loads, log.read_text().splitlines()):
        logged.setdefault(rec["pid"], {})[rec["event"]] = rec["time"]
    pids = set(logged)
    ledger = sim.layout.state_dir / "ledger"
    deadline = time.monotonic() + 10
    ends: List[dict] = []
    while time.monotonic() < deadline:
        if ledger.exists():
            ends = [r for r in map(json.loads, ledger.read_text().splitlines())
                    if r.get("event") == "end" and r.get("pid") in pids]
        if len(ends) >= len(pids):
            break
        time.sleep(0.05)
    before = [1000.0 * (logged[r["pid"]]["start"] - r["start"]) for r in ends]
    after = [1000.0 * (r["end"] - logged[r["pid"]]["end"]) for r in ends]
    excess = [b + a for b, a in zip(before, after)]
    return {"runs": runs, "counted": len(ends), "grant_to_start_ms": before, "end_to_release_ms": after,
            "excess_median_ms": statistics.median(excess) if excess else None,
            "excess_max_ms": max(excess) if excess else None,
            # The ledger keeps times to the millisecond: half of one is its rounding.
            "inside": all(b >= -0.5 and a >= -0.5 for b, a in zip(before, after))}


def run(bench: Bench, topology: str, reps: int) -> dict:
    sim = bench.sim(topology)
    out = {"devices": sim.devices, "without service": _block(sim, reps)}
    sock = sim.layout.runtime_dir / "cudawrap.sock"
    proc = subprocess.Popen([sim.install.cudawrap, "serve"], env=sim.machine.environ(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not _answers(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cudawrap serve did not start: {proc.stderr.read().decode()[-1000:]}")
            time.sleep(0.05)
        out["with service"] = _block(sim, reps)
        out["ledger"] = ledger_accuracy(sim, LEDGER_RUNS, LEDGER_HOLD_S)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


def show(topology: str, result: dict) -> None:
    print(f"\n{topology} ({result['devices']} devices)")
    for block in ("without service", "with service"):
        rows = result[block]
        print(f"  {block}:")
        for name, row in rows.items():
            print(f"    {name:<20} median {row['median_ms']:7.2f} ms   x(-IS -c pass) {row['x_bare_python_S']:5.2f}"
                  f"   x(-I -c pass) {row['x_bare_python']:5.2f}   failures {row['failures']}")
    led = result.get("ledger", {})
    if "error" in led:
        print(f"  ledger: {led['error']}")
    elif led:
        print(f"  ledger: {led['counted']} of {led['runs']} runs of {LEDGER_HOLD_S:g} s counted; lease minus logged "
              f"interval median {led['excess_median_ms']:.1f} ms, max {led['excess_max_ms']:.1f} ms "
              f"(grant to the program's start max {max(led['grant_to_start_ms']):.1f} ms, its end to the "
              f"release max {max(led['end_to_release_ms']):.1f} ms); every lease spans its run: {led['inside']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--topologies", nargs="+", default=["a100-mig7", "dgx-a100-mig56"])
    parser.add_argument("--work", type=Path, help="work directory (default: a new temporary one)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="cudawrap-bench-service-"))
    bench = Bench(work, Peers(None, None, []))
    results = {t: run(bench, t, args.reps) for t in args.topologies}
    for topology, result in results.items():
        show(topology, result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
