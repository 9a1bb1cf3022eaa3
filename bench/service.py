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

Then bench/servicescale.py's two (see there): a burst of N one-second C jobs through the
service on 7 MIG instances (grant from a release's exit to the next run's exec, makespan,
overlaps, failures; again with the jobs run by `nobody`, an ordinary account), and W waiting runs while 50
one-second jobs turn over (the CPU of the service, of its monitor loop and of the waiters).

    sudo python3 bench/service.py [--quick] [--reps 40] [--topologies a100-mig7 dgx-a100-mig56]
                                  [--parts launch,burst,waiters] [--waiters 1000] [--no-nobody]
                                  [--confine v1,v2]

--confine adds a block where the served launch of `true` plain and confined ([confine] runs =
true, each run moved into a cgroup of its own before its grant) with each mechanism named run
in the same rounds, each round in its own order: one install for each (a config is an
install's), each its own service, on copies of one machine. What confinement adds is its p95
against the plain launch's of the same block, so that the machine's drift between blocks
(a millisecond at p95 here) does not count as its cost.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Dict, Iterator, List, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import BARE, BARE_S, measure  # noqa: E402
from report import fmt, machine_line, table  # noqa: E402
from resultsmd import RESULTS, Run, at_most, below, tally, targets_table, write_section  # noqa: E402
from servicescale import ledger_records, run_servicescale, serving  # noqa: E402
from servicescale import show as show_servicescale  # noqa: E402
from sim import Bench, Peers, Sim  # noqa: E402

from cudawrap.base import cgroup  # noqa: E402

WRAPPED = "wrapped true"


def _launches(sim: Sim, wrapped: Dict[str, List[str]]) -> Dict[str, List[str]]:
    """WRAPPED and, to judge them by, the bare interpreter (as the shim starts it, and `-I`) and `true` itself."""
    return {**wrapped, BARE_S: [sim.install.python, "-IS", "-c", "pass"], BARE: [sim.install.python, "-I", "-c", "pass"],
            "direct": [str(sim.true)]}


def _block(sim: Sim, reps: int) -> Dict[str, dict]:
    return measure(_launches(sim, {WRAPPED: [str(sim.true_wrapped)]}), sim.environ(), reps)


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
    deadline = time.monotonic() + 10
    ends: List[dict] = []
    while time.monotonic() < deadline:
        ends = ledger_records(sim, "end", pids, service=False)
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


@contextmanager
def confined(sim: Sim, kind: str) -> Iterator[None]:
    """`[confine] runs = true` with cgroup = KIND for the block; the config put back after."""
    config = sim.layout.config_file
    saved = config.read_text() if config.exists() else None
    table = f'[confine]\nruns = true\ncgroup = "{kind}"\n'
    # The table in place of the config's own (a header line "[confine]", or "#[confine]" with
    # its keys commented out): TOML allows a table once, and a key set there twice is refused.
    kept, inside = [], False
    for line in (saved or "").splitlines(keepends=True):
        if line.startswith(("[", "#[")):
            inside = line.strip() in ("[confine]", "#[confine]")
        if not inside:
            kept.append(line)
    config.write_text("".join(kept) + "\n" + table)
    try:
        yield
    finally:
        if saved is None:
            config.unlink()
        else:
            config.write_text(saved)


def confined_block(bench: Bench, sim: Sim, kinds: Sequence[str], reps: int) -> Dict[str, dict]:
    """The served launch of `true` on SIM and, confined with each of KINDS, on an install of
    its own (bench.other_install), interleaved in REPS shuffled rounds with the bare starts."""
    others = {kind: bench.sim(sim.topology_name, bench.other_install(f"install-confine-{kind}")) for kind in kinds}
    with ExitStack() as stack:
        stack.enter_context(serving(sim))
        for kind, other in others.items():
            stack.enter_context(confined(other, kind))
            stack.enter_context(serving(other))
        cmds = _launches(sim, {SERVED: [str(sim.true_wrapped)],
                               **{CONFINED.format(kind): [str(other.true_wrapped)] for kind, other in others.items()}})
        envs = {CONFINED.format(kind): other.environ() for kind, other in others.items()}
        return measure(cmds, sim.environ(), reps, envs=envs, shuffle=True)


SERVED, CONFINED = "with service", "with service, confined ({})"
CONFINE_REPS_X = 5  # the confined block's rounds, times the launch blocks': a p95, not a median


def run(bench: Bench, topology: str, reps: int, confine: Sequence[str] = ()) -> dict:
    sim = bench.sim(topology)
    out = {"devices": sim.devices, "without service": _block(sim, reps)}
    with serving(sim):
        out[SERVED] = _block(sim, reps)
        out["ledger"] = ledger_accuracy(sim, LEDGER_RUNS, LEDGER_HOLD_S)
    if confine:
        out["confined"] = confined_block(bench, sim, confine, reps * CONFINE_REPS_X)
        out["favordynmods"] = cgroup.favors_dynmods()
    return out


CONFINED_P95_MS = 1.0  # confinement adds at most this to a served launch, at p95


def show(topology: str, result: dict) -> None:
    print(f"\n{topology} ({result['devices']} devices)")
    for block in [k for k in result if k.startswith(("without service", "with service")) or k == "confined"]:
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


PARTS = ("launch", "burst", "waiters")

# The targets, as the service's issues set them (bench/README.md, "Through the service").
SERVED_X_I = 1.0  # a served launch over `python -I -c pass` of the shim's interpreter
SERVED_X_IS = 1.25  # over `python -IS -c pass`, as the shim starts
LEDGER_MS = 10.0  # a lease in the ledger beyond the interval its run logged itself
HANDOVER_P95_MS = 2.0  # a release's exit to the next run's exec
MAKESPAN_X = 1.02  # the burst's makespan over ceil(N / devices) x hold
SERVICE_CPU_PCT = 5.0  # the service, % of one core, while the turnover runs with W waiting
WAITERS_CPU_PCT = 0.5  # all W waiters together, likewise

BURSTS = {"root": "as root, runs waiting in the waiter", "root, no waiter": "as root, the waiter moved aside",
          "nobody": "`nobody`, an ordinary account"}


def _judged(results: dict) -> list:
    """(what, measured, target, met) for every target the run measured."""
    rows: list = []
    for topology, r in results.get("launch", {}).items():
        served = r["with service"][WRAPPED]
        failed = f" ({served['failures']}/{served['n']} failed)" if served["failures"] else ""
        rows += [(f"served launch of `true`, {topology}: × `python -I -c pass`", f"{fmt(served['x_bare_python'], 2)}{failed}",
                  f"≤ {SERVED_X_I}", at_most(served["x_bare_python"], SERVED_X_I) and not served["failures"]),
                 (f"served launch of `true`, {topology}: × `python -IS -c pass`", f"{fmt(served['x_bare_python_S'], 2)}{failed}",
                  f"≤ {SERVED_X_IS}", at_most(served["x_bare_python_S"], SERVED_X_IS) and not served["failures"])]
        block = r.get("confined", {})
        for name in [k for k in block if k != SERVED and k.startswith(SERVED)]:
            kind = name.rsplit("(", 1)[1].rstrip(")")
            added = block[name]["p95_ms"] - block[SERVED]["p95_ms"]
            dyn = "favordynmods" if r.get("favordynmods") else "no favordynmods"
            rows.append((f"confined launch ({kind}, {dyn}), {topology}: added to the served launch at p95, ms",
                         f"{added:.2f}", f"≤ {CONFINED_P95_MS:g}", at_most(added, CONFINED_P95_MS)
                         and not block[name]["failures"]))
        led = r.get("ledger", {})
        if "error" in led:
            rows.append((f"ledger, {topology}", f"not measured: {led['error']}", "every run, each lease within "
                         f"{LEDGER_MS:g} ms", False))
        elif led:
            rows.append((f"ledger, {topology}: runs counted, lease beyond the run's own interval (max ms)",
                         f"{led['counted']}/{led['runs']}, {led['excess_max_ms']:.1f}",
                         f"all, ≤ {LEDGER_MS:g}", led["counted"] == led["runs"] and led["inside"]
                         and at_most(led["excess_max_ms"], LEDGER_MS) is True))
    for name, r in results.get("service", {}).get("burst", {}).items():
        what = f"burst ({BURSTS.get(name, name)})"
        if "error" in r:
            rows.append((what, f"not measured: {r['error']}", "measured", False))
            continue
        p95 = r["grant_to_exec"].get("p95_ms")
        ratio = r["makespan_s"] / r["ideal_makespan_s"] if r.get("makespan_s") is not None else None
        rows += [(f"{what}: ran / failures / overlaps / granted by the service / in the ledger",
                  f"{r['ok']}/{r['n']}, {r['failures']}, {r['overlap_pairs']}, {r['granted_by_service']}, "
                  f"{r['ledger']['counted']}/{r['ledger']['runs']}", "all, 0, 0, all, all",
                  r["ok"] == r["n"] and r["overlap_pairs"] == 0 and r["granted_by_service"] == r["ok"]
                  and r["ledger"]["counted"] == r["ledger"]["runs"]),
                 (f"{what}: hand-over p95, ms (n={r['grant_to_exec'].get('n')})", p95, f"≤ {HANDOVER_P95_MS:g}",
                  at_most(p95, HANDOVER_P95_MS)),
                 (f"{what}: makespan × ideal", None if ratio is None else fmt(ratio, 3), f"≤ {MAKESPAN_X:g}",
                  at_most(ratio, MAKESPAN_X))]
    w = results.get("service", {}).get("waiters")
    if w and "error" in w:
        rows.append(("waiters", f"not measured: {w['error']}", "measured", False))
    elif w:
        cpu = w["cpu_turnover"]
        rows += [(f"{w['waiters']} waiters while {w['turnover_jobs']} runs turn over: the service, % of one core",
                  fmt(cpu["service"]["pct_of_one_core"], 3), f"< {SERVICE_CPU_PCT:g}",
                  below(cpu["service"]["pct_of_one_core"], SERVICE_CPU_PCT)),
                 (f"the {w['waiters']} waiters together, % of one core", fmt(cpu["waiters"]["pct_of_one_core"], 3),
                  f"< {WAITERS_CPU_PCT:g}", below(cpu["waiters"]["pct_of_one_core"], WAITERS_CPU_PCT)),
                 ("then every run served: ran / failures / overlaps",
                  f"{w['turnover_ok'] + w['waiters_ok']}/{w['turnover_jobs'] + w['waiters']}, "
                  f"{w['turnover_failures'] + w['waiter_failures']}, {w['overlap_pairs']}", "all, 0, 0",
                  w["turnover_failures"] + w["waiter_failures"] == 0 and w["overlap_pairs"] == 0)]
    return rows


def _figures(results: dict) -> list:
    """(what, figure) beside the targets: where the time goes, and what waiting costs."""
    def lat(s: dict) -> str:
        return f"{s['median_ms']} / {s['p95_ms']} / {s['max_ms']}" if s and s.get("n") else "not measured"

    rows: list = []
    for name, r in results.get("service", {}).get("burst", {}).items():
        if "error" in r:
            continue
        what = f"burst ({BURSTS.get(name, name)}), {r['n']} × {r['hold_s']:g} s on {r['devices']} devices"
        rows += [(f"{what}: hand-over p50 / p95 / max, ms (clock: {r['exec_clock']})", lat(r["grant_to_exec"])),
                 ("— of which the exit to the grant's record (the service's decision)", lat(r["grant_service_part"])),
                 ("— and that record to the exec (the send, the run's lock and exec)", lat(r["grant_run_part"])),
                 ("— to the program's first line", lat(r["grant_to_line"]))]
    w = results.get("service", {}).get("waiters")
    if w and "error" not in w:
        mem = w["memory"]
        capped = f" (asked {mem['asked']}: capped by the memory free)" if mem["capped_by_memory"] else ""
        rows += [(f"{w['waiters']} waiters{capped}: RSS / PSS of one, MiB, waiting "
                  + ("in the waiter" if w.get("waiter") else "in the shim (no waiter built)"),
                  f"{w['waiter_rss_median_mib']} / {w['waiter_pss_median_mib']}")]
        shim = results["service"].get("waiters_in_shim")
        if shim and "error" not in shim:
            rows.append((f"{shim['waiters']} waiting in the shim's interpreter instead: RSS / PSS of one, MiB",
                         f"{shim['waiter_rss_median_mib']} / {shim['waiter_pss_median_mib']}"))
        for label, key in (("nothing moving", "cpu_quiet"), ("the turnover", "cpu_turnover")):
            c = w[key]
            rows.append((f"% of one core over {label} ({c['window_s']} s): service / its monitor loop / waiters",
                         " / ".join(f"{c[g]['pct_of_one_core']:.3f}" for g in ("service", "monitor", "waiters"))))
        rows += [("the turnover: hand-over p50 / p95 / max, ms", lat(w["grant_to_exec"])),
                 ("the turnover: makespan × ideal", str(w["turnover_makespan_ratio"])),
                 ("every waiter served in, s", str(w["drain_s"]))]
    return rows


def results_section(results: dict, run: Run, interp: dict) -> str:
    """service.py's section of RESULTS.md."""
    out = ["## Through the service (`bench/service.py`)", "", run.header(interp, results["mode"]), ""]
    if results["mode"] != "full":
        out += [f"**A {results['mode']} run: smaller than the sizes the targets are set for; "
                "`bench/service.py` without `--quick` replaces it.**", ""]
    rows = _judged(results)
    out += [targets_table(rows), "", tally(rows), ""]
    for topology, r in results.get("launch", {}).items():
        rows_l = [(f"`{name}`", f"{r['without service'][name]['median_ms']:.2f}",
                   f"{r['with service'][name]['median_ms']:.2f}", fmt(r['with service'][name]['x_bare_python'], 2),
                   fmt(r['with service'][name]['x_bare_python_S'], 2),
                   f"{r['without service'][name]['failures'] + r['with service'][name]['failures']}")
                  for name in r["with service"]]
        out += [f"Launch on {topology} ({r['devices']} devices), medians of "
                f"{r['with service'][WRAPPED]['n']} interleaved runs:", "",
                table(["", "without the service, ms", "with it, ms", "× `-I` (with)", "× `-IS` (with)", "failed"],
                      rows_l), ""]
        block = r.get("confined")
        if block:
            out += [f"The served launch of `true` plain and confined (`[confine] runs = true`), in the same "
                    f"{block[SERVED]['n']} rounds, each in its own order (an install and a service for each); cgroups "
                    + ("mounted with favordynmods: a move into a cgroup never waits for an RCU grace period"
                       if r.get("favordynmods") else "not mounted with favordynmods: on a kernel of 6.0 or newer a "
                       "lone move into a cgroup can wait for an RCU grace period (what a move costs here: the "
                       "cgroupmove section); the service makes the move at once where its moves are fast, else on its "
                       "worker while the run is decided on, and widens the rule to its GPUs before its grant goes out") + ":", "",
                    table(["", "median, ms", "p95, ms", "× `-I`", "failed"],
                          [(name, f"{row['median_ms']:.2f}", f"{row['p95_ms']:.2f}", fmt(row["x_bare_python"], 2),
                            str(row["failures"])) for name, row in block.items()]), ""]
    figures = _figures(results)
    if figures:
        out += [table(["figure", "value"], figures), ""]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of under a minute")
    parser.add_argument("--reps", type=int, help="launch rounds (default 40, 3 with --quick)")
    parser.add_argument("--topologies", nargs="+", help="for the launch (default a100-mig7 dgx-a100-mig56; "
                                                        "a100-mig7 with --quick)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)}")
    parser.add_argument("--waiters", type=int, help="waiting runs (default 1000, 40 with --quick)")
    parser.add_argument("--no-nobody", action="store_true", help="leave out the burst run by `nobody`")
    parser.add_argument("--confine", default="", help="also the service's block with [confine] runs = true, "
                                                      "for each of these cgroup mechanisms (v1,v2)")
    parser.add_argument("--work", type=Path, help="work directory (default: a new temporary one)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--results-md", type=Path, default=RESULTS, help="the file whose `service` section "
                        "this run replaces (default bench/RESULTS.md)")
    parser.add_argument("--no-write", action="store_true", help="print the figures only")
    args = parser.parse_args()
    started = Run(["bench/service.py"] + sys.argv[1:])
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if set(parts) - set(PARTS):
        parser.error(f"unknown part {sorted(set(parts) - set(PARTS))[0]}; choose from {', '.join(PARTS)}")
    reps = args.reps or (3 if args.quick else 40)
    topologies = args.topologies or (["a100-mig7"] if args.quick else ["a100-mig7", "dgx-a100-mig56"])
    work = args.work or Path(tempfile.mkdtemp(prefix="cudawrap-bench-service-"))
    bench = Bench(work, Peers(None, None, []))
    results: dict = {"date": started.date, "mode": "quick" if args.quick else "full", "checkout": started.checkout,
                     "machine": started.machine}
    if "launch" in parts:
        kinds = [k.strip() for k in args.confine.split(",") if k.strip()]
        results["launch"] = {t: run(bench, t, reps, kinds) for t in topologies}
    if "burst" in parts or "waiters" in parts:
        results["service"] = run_servicescale(bench.sim, results["mode"], args.waiters, not args.no_nobody,
                                              burst="burst" in parts, many="waiters" in parts)
    results["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"bench/service.py ({results['mode']}), {results['date']}, commit {results['checkout']['commit']}"
          + (f" (+{results['checkout']['cudawrap_uncommitted_files']} uncommitted files in cudawrap/)"
             if results["checkout"]["cudawrap_uncommitted_files"] else ""))
    print(f"Machine: {machine_line(results['machine'])}")
    for topology, result in results.get("launch", {}).items():
        show(topology, result)
    if "service" in results:
        show_servicescale(results["service"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if not args.no_write:
        write_section("service", results_section(results, started, bench.install.describe), args.results_md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
