"""The results as Markdown tables: printed after a run and kept in bench/RESULTS.md."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from about import commit_text

TARGET_LAUNCH_X = 2.0
TARGET_LAUNCH_MONITOR_X = 1.2
TARGET_DISPATCH_P95_MS = 100.0
TARGET_WAITERS_CPU_PCT = 5.0
TARGET_GRANT_P95_MS = 10.0  # a freed device reaches the next waiter's grant
TARGET_MAKESPAN_X = 1.05  # 50 one-second runs on 7 MIG instances


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(header: Sequence[str], rows: List[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(c) if not isinstance(c, str) else c for c in row) + " |")
    return "\n".join(lines)


def _pair(summary: Dict[str, Any]) -> str:
    if not summary or summary.get("median_ms") is None:
        return "–"
    return f"{fmt(summary['median_ms'])} / {fmt(summary['p95_ms'])}"


# Rows whose tool is replaced by a stand-in, and what the real one costs.
STANDIN_TOOLS = ("getgpu",)
STANDIN_NOTE = ("† getgpu calls a stand-in `nvidia-smi` (a Python script over pynvml, ~90 ms a call "
                "here, 2–3 calls a launch); a real `nvidia-smi` takes ~30–100 ms a call with persistence "
                "mode on and seconds without, so real getgpu launches cost about as much or more.")


def _with_failures(value: Optional[float], failed: Optional[int], n: Optional[int] = None) -> str:
    """A time with its failures beside it: a failed run is never shown as a time alone."""
    if value is None:
        return "–"
    if not failed:
        return fmt(value)
    return f"{fmt(value)} ({failed}{'/' + str(n) if n else ''} failed)"


def interp_line(interp: Dict[str, Any]) -> str:
    return (f"`{interp['python']}` (→ {interp['resolves_to']}), Python {interp['version']}; found from "
            f"{interp['how_found']}")


def verdict_text(ok: Optional[bool]) -> str:
    return "–" if ok is None else ("**met**" if ok else "**MISSED**")


def machine_line(machine: Dict[str, Any]) -> str:
    line = (f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB RAM; "
            f"Python {machine['python']} ({machine['implementation']}); Linux {machine['kernel']}")
    start, end = machine.get("load_average_at_start"), machine.get("load_average_at_end")
    if start and end:
        line += f"; load average (1/5/15 min) {start} at start, {end} at end"
    return line


def render(results: Dict[str, Any]) -> str:
    out: List[str] = []
    sections = ", ".join(f"{k} {v:.0f} s" for k, v in results.get("section_s", {}).items())
    out.append(f"Run: `{results['command']}` ({results['mode']} mode), {results['date']}, "
               f"{results['elapsed_s']:.0f} s ({sections})")
    out.append(f"Machine: {machine_line(results['machine'])}")
    foreign = results.get("foreign_cpu_pct") or {}
    if foreign:
        out.append("CPU used by other work on the machine during each section, % of all cores: "
                   + ", ".join(f"{k} {v}" for k, v in foreign.items())
                   + " (near 0: the benchmark had the machine to itself)")
    co = results.get("checkout") or {}
    if co.get("commit"):
        out.append(f"Checkout: {co['commit']}"
                   + (f" with {co['cudawrap_uncommitted_files']} uncommitted file(s) in cudawrap/ or shims/"
                      if co.get("cudawrap_uncommitted_files") else ""))
    interp = results.get("interpreter")
    if interp:
        out.append(f"Interpreter: {interp_line(interp)}")
    peers = results.get("peers", {})
    out.append(f"Tools: {', '.join(peers.get('available', []))}"
               + (f" ({'; '.join(peers['notes'])})" if peers.get("notes") else ""))
    out.append("")
    out.extend(_targets(results))
    if "launch" in results:
        out.extend(_launch(results["launch"]))
    if "burst" in results:
        out.extend(_burst(results["burst"]))
    if "scale" in results:
        out.extend(_scale(results["scale"]))
    if "nvml" in results:
        out.extend(_nvml(results["nvml"]))
    if "foreign" in results:
        from foreign import render as foreign_text  # (bench/foreign.py, the section's own script)

        out.extend(["## 5. A launch after an unwrapped CUDA program", "", "```", foreign_text(results["foreign"]),
                    "```", ""])
    return "\n".join(out) + "\n"


def targets(results: Dict[str, Any]) -> Dict[str, Optional[bool]]:
    """Each target of the issue: True met, False missed, None not measured."""
    verdict: Dict[str, Optional[bool]] = {}
    launch = results.get("launch")
    if launch:
        for tool, key, limit in (("cudawrap", "launch_within_2x_bare_python", TARGET_LAUNCH_X),
                                 ("cudawrap+monitor", "launch_within_1_2x_bare_python_with_monitor",
                                  TARGET_LAUNCH_MONITOR_X)):
            xs = [t["methods"][tool]["x_bare_python"] for t in launch.values() if tool in t["methods"]]
            if xs:
                verdict[key] = all(x is not None and x <= limit for x in xs)
    burst = results.get("burst")
    if burst:
        runs = [r for t in burst.values() for tool, r in t["tools"].items() if tool.startswith("cudawrap")]
        verdict["burst_no_overlap"] = all(r["overlap_pairs"] == 0 and r["failures"] == 0 for r in runs)
        for tool, key in (("cudawrap", "burst_dispatch_p95_under_100ms"),
                          ("cudawrap+monitor", "burst_dispatch_p95_under_100ms_with_monitor")):
            p95 = [t["tools"][tool]["dispatch"]["p95_ms"] for t in burst.values()
                   if tool in t["tools"] and t["tools"][tool]["dispatch"]["p95_ms"] is not None]
            if p95:
                verdict[key] = max(p95) < TARGET_DISPATCH_P95_MS
        steady = [r["after_startup_storm"]["dispatch"]["p95_ms"] for r in runs
                  if (r.get("after_startup_storm") or {}).get("dispatch", {}).get("p95_ms") is not None]
        if steady:
            verdict["burst_steady_dispatch_p95_under_100ms"] = max(steady) < TARGET_DISPATCH_P95_MS
        grants = [r["grant"]["p95_ms"] for r in runs if r.get("grant", {}).get("p95_ms") is not None]
        if grants:
            verdict["burst_grant_p95_under_100ms"] = max(grants) < TARGET_DISPATCH_P95_MS
        spans = [r for t in burst.values() for r in (t.get("makespan") or {}).values()]
        if spans:
            verdict["makespan_within_1_05x"] = all(r["makespan_ratio"] is not None and r["failures"] == 0
                                                   and r["makespan_ratio"] <= TARGET_MAKESPAN_X for r in spans)
            verdict["grant_p95_within_10ms"] = all(r["grant"]["p95_ms"] is not None
                                                   and r["grant"]["p95_ms"] <= TARGET_GRANT_P95_MS for r in spans)
        if grants:
            verdict["burst_grant_p95_within_10ms_python"] = max(grants) <= TARGET_GRANT_P95_MS
    scale = results.get("scale")
    if scale:
        runs = list(scale["runs"].values())
        cpu = [r["cpu_while_waiting"]["all_waiters_pct_of_one_core"] for r in runs]
        verdict["waiters_cpu_under_5pct"] = max(cpu) < TARGET_WAITERS_CPU_PCT
        verdict["scale_no_overlap"] = all(r["overlap_pairs"] == 0 and r["failures"] == 0 for r in runs)
        p95 = [r["dispatch"]["p95_ms"] for r in runs if r["dispatch"]["p95_ms"] is not None]
        verdict["scale_dispatch_p95_under_100ms"] = bool(p95) and max(p95) < TARGET_DISPATCH_P95_MS
        grants = [r["grant"]["p95_ms"] for r in runs if r.get("grant", {}).get("p95_ms") is not None]
        if grants:
            verdict["scale_grant_p95_under_100ms"] = max(grants) < TARGET_DISPATCH_P95_MS
    if results.get("foreign"):
        verdict["foreign_exit_launch_within_250ms"] = results["foreign"]["met"]
    return verdict


def _targets(results: Dict[str, Any]) -> List[str]:
    names = {
        "launch_within_2x_bare_python": "wrapped launch ≤ 2× `python -I -c pass` of the shim's interpreter "
                                        "(every topology), no monitor",
        "launch_within_1_2x_bare_python_with_monitor": "the same ≤ 1.2× with `cudawrap monitor` running",
        "burst_no_overlap": "burst: cudawrap 0 overlaps, 0 failures (with and without monitor)",
        "burst_dispatch_p95_under_100ms": "burst: cudawrap dispatch p95 < 100 ms, no monitor",
        "burst_dispatch_p95_under_100ms_with_monitor": "burst: the same with the monitor",
        "burst_steady_dispatch_p95_under_100ms": "burst: cudawrap dispatch p95 < 100 ms once the start-up storm is over",
        "burst_grant_p95_under_100ms": "burst: cudawrap's own hand-over (grant) p95 < 100 ms, with and without monitor",
        "makespan_within_1_05x": "burst: 50 one-second runs (a C program) on 7 MIG, makespan ≤ 1.05× the ideal, "
                                 "with and without monitor",
        "grant_p95_within_10ms": "burst: released lease → next waiter's grant p95 ≤ 10 ms, in those bursts, "
                                 "with and without monitor",
        "burst_grant_p95_within_10ms_python": "the same in the bursts of Python stand-ins (each round's "
                                              "start-ups compete for the 2 cores)",
        "scale_grant_p95_under_100ms": "scale: grant p95 < 100 ms",
        "scale_no_overlap": "scale: 0 overlaps, 0 failures",
        "scale_dispatch_p95_under_100ms": "scale: dispatch p95 < 100 ms",
        "waiters_cpu_under_5pct": "scale: all waiters together < 5 % of one core while they wait (after the arrivals' tail)",
        "foreign_exit_launch_within_250ms": "a wrapped launch right after an unwrapped CUDA run ended "
                                            "(monitor running) ≤ 0.25 s, the slowest of the rounds",
    }
    verdict = targets(results)
    if not verdict:
        return []
    rows = [[names[k], verdict_text(v)] for k, v in verdict.items()]
    return ["## Targets", "", table(["target", "result"], rows), ""]


def _launch(launch: Dict[str, Any]) -> List[str]:
    out = ["## 1. Launch overhead", "",
           "A trivial C program (`true`) launched directly, wrapped, and through each peer; "
           "medians of interleaved runs. `× -I` and `× -IS` are ratios to a bare `python -I -c pass` "
           "and `python -IS -c pass` of the interpreter the installed shim runs; "
           "peak RSS is the launched process's (for cudawrap the shim's: exec keeps the process). "
           + STANDIN_NOTE, ""]
    for topology, data in launch.items():
        rows = []
        for name, m in data["methods"].items():
            rows.append([f"`{name}`" + (" †" if name in STANDIN_TOOLS else ""), m["median_ms"], m["p90_ms"],
                         fmt(m["x_bare_python"], 2), fmt(m.get("x_bare_python_S"), 2),
                         m["minus_direct_ms"], m.get("max_rss_mib"), f"{m['failures']}/{m['n']}"])
        out.append(f"### {topology} ({data['devices']} devices, {data['reps']} runs each)")
        out.append("")
        out.append(table(["method", "median ms", "p90 ms", "× -I", "× -IS", "− direct ms", "peak RSS MiB",
                          "failed"], rows))
        out.append("")
        cpu = data.get("monitor_cpu")
        if cpu:
            out.append(f"`cudawrap monitor` itself, idle machine, {cpu['seconds']} s: {cpu['cpu_ms_per_cycle']} ms "
                       f"of CPU per {cpu['period_s']} s cycle, {cpu['pct_of_one_core']} % of one core.")
            out.append("")
        nv = data.get("nvisel_threshold")
        if nv:
            out.append(f"nvisel `-f {nv['min_free_mib']}MiB`: idle devices have ≥ {nv['idle_free_mib_min']} MiB free, "
                       f"a device running one job ≤ {nv['busy_free_mib_max']} MiB: "
                       f"{'separates them' if nv['separates'] else 'DOES NOT separate them'} at the default "
                       f"`--tolerance 0`; a tolerance of {nv['tolerance_that_breaks_it_pct']} % or more would "
                       f"pass busy devices.")
            out.append("")
        bdm = data.get("breakdown_with_monitor", {})
        if bdm.get("phases_ms"):
            out.append(f"With `cudawrap monitor` running, the same launch's Python code takes "
                       f"{bdm['python_code_ms']} ms ({bdm['modules_loaded']} modules); largest phases: "
                       + ", ".join(f"{k} {v}" for k, v in bdm["phases_ms"][:4]) + " (ms).")
            out.append("")
        bd = data.get("breakdown", {})
        if bd.get("phases_ms"):
            out.append(f"Without the monitor, where the wrapped launch's Python time goes ({bd['python_code_ms']} ms after interpreter "
                       f"start-up, {bd['modules_loaded']} modules loaded; medians):")
            out.append("")
            out.append(table(["phase", "ms"], [[k, v] for k, v in bd["phases_ms"] if v >= 0.05]))
            out.append("")
            out.append("`-X importtime`, self time summed per top-level package (ms): "
                       + ", ".join(f"{k} {v}" for k, v in bd["importtime_self_by_package_ms"][:10]))
            out.append("")
            out.append("`-X importtime`, first-level imports, cumulative (ms): "
                       + ", ".join(f"{k} {v}" for k, v in bd["importtime_first_level_cumulative_ms"][:8]))
            out.append("")
            whatif = bd.get("import_whatif_ms") or {}
            if whatif:
                out.append(f"What-if, fresh interpreter each: `import ctypes` alone {whatif.get('ctypes')} ms; "
                           f"`import pynvml` as the shim does {whatif.get('pynvml')} ms; with `ctypes.util` "
                           f"stubbed out first (pynvml imports `find_library` but never calls it on Linux) "
                           f"{whatif.get('pynvml-no-util')} ms.")
                out.append("")
            if bd.get("cprofile_by_own"):
                out.append("cProfile, top functions by own time (ms, profiler overhead included): "
                           + "; ".join(f"`{r['function']}` {r['own_ms']} ({r['calls']}×)"
                                       for r in bd["cprofile_by_own"][:8]))
                out.append("")
    return out


def _burst(burst: Dict[str, Any]) -> List[str]:
    out = ["## 2. Burst correctness", ""]
    for topology, data in burst.items():
        tools = data["tools"]
        any_run = next(iter(tools.values()))
        out.append(f"### {topology}: {any_run['n']} simultaneous launches, {any_run['devices']} devices, "
                   f"hold {any_run['hold_s']:g} s (ideal makespan {any_run['ideal_makespan_s']:g} s)")
        out.append("")
        rows = []
        for tool, r in tools.items():
            order = r["order"]
            fifo = (f"{fmt(order['kendall_distance'], 3)} / {fmt(order['mean_rank_error'], 1)}"
                    if order.get("kendall_distance") is not None else "–")
            queue = (f"{fmt(order['queue_kendall_distance'], 3)} / {fmt(order['queue_mean_rank_error'], 1)}"
                     if order.get("queue_kendall_distance") is not None else "–")
            rows.append([tool, r["ok"], r["failures"], f"{r['overlap_pairs']} / {r['jobs_in_overlaps']}",
                         r["devices_used"], r["makespan_s"], fmt(r["makespan_ratio"], 2),
                         _pair(r["dispatch"]) if tool.startswith("cudawrap") else "n/a (no queue)",
                         _pair(r.get("grant", {})), fifo, queue])
        out.append(table(["tool", "ran", "failed", "overlaps (pairs / jobs)", "devices used", "makespan s",
                          "× ideal", "dispatch p50 / p95 ms", "grant p50 / p95 ms",
                          "FIFO error vs launch (Kendall / mean rank)", "vs queue arrival"], rows))
        standin = data.get("standin") or {}
        storm = [(tool, r["after_startup_storm"]) for tool, r in tools.items() if r.get("after_startup_storm")]
        if storm:
            out.append("")
            out.append("Hand-overs once every launch had queued or started (the start-up storm over): "
                       + "; ".join(f"{tool} (after {st['settled_after_s']} s): dispatch {_pair(st['dispatch'])} ms, "
                                   f"grant {_pair(st['grant'])} ms" for tool, st in storm) + ".")
        out.append("")
        out.append(f"Dispatch = a job's end line -> the next job's start line on that device, for jobs "
                   f"that were waiting. It includes the stand-in's own start-up "
                   f"({standin.get('startup_ms')} ms from spawn to its start line when run alone) and "
                   f"its exit after its end line ({standin.get('end_to_exit_ms')} ms), and on 2 cores the "
                   f"start-ups of a round compete for CPU. Grant = the job's process exited (its lease "
                   f"released; the kernel's process event, with the kernel's time; as root) -> the waiter's "
                   f"queue entry removed (cudawrap has handed it the device; inotify, stamped by a "
                   f"SCHED_FIFO thread).")
        out.append("")
        spans = data.get("makespan") or {}
        if spans:
            first = next(iter(spans.values()))
            rows = [[tool, f"{r['ok']}/{r['n']}", r["overlap_pairs"], r["makespan_s"], fmt(r["makespan_ratio"], 3),
                     _pair(r["grant"]), fmt(r["grant"]["max_ms"]), _pair(r["dispatch"])] for tool, r in spans.items()]
            out.append(f"{first['n']} runs of a C program holding its device {first['hold_s']:g} s (`bench/hold.c`: "
                       f"no interpreter, so what is left is cudawrap's hand-overs), launched at once on "
                       f"{first['devices']} devices; ideal makespan {first['ideal_makespan_s']:g} s:")
            out.append("")
            out.append(table(["tool", "ran", "overlaps", "makespan s", "× ideal", "grant p50 / p95 ms",
                              "grant max ms", "dispatch p50 / p95 ms"], rows))
            out.append("")
        release = data.get("simultaneous_release") or {}
        if release:
            rows = []
            for lead, r in release.items():
                monitor = "yes" if r.get("monitor") else "no"
                lead = lead.split("+")[0]
                if "error" in r:
                    rows.append([lead, monitor, r["error"], "", "", "", ""])
                    continue
                rows.append([lead, monitor, f"{r['ok']}/{r['waiters']}", r["overlap_pairs"], _pair(r["grant"]),
                             fmt(r["grant"]["max_ms"]), _pair(r["dispatch"])])
            out.append(f"All {next(iter(release.values())).get('devices')} devices freed at once (SIGTERM to "
                       f"every holder), one cudawrap waiter per device launched LEAD s earlier; "
                       f"grant = holder's exit -> waiter out of the queue:")
            out.append("")
            out.append(table(["lead s", "monitor", "ran", "overlaps", "grant p50 / p95 ms", "grant max ms",
                              "dispatch p50 / p95 ms"], rows))
            out.append("")
    return out


def _scale(scale: Dict[str, Any]) -> List[str]:
    out = [f"## 3. Scale ({scale['topology']})", ""]
    rows = []
    for count, r in scale["runs"].items():
        cpu = r["cpu_while_waiting"]
        dec = r["decision"]
        none = (dec.get("none_busy") or {}).get("decision_ms")
        most = (dec.get("all_but_one_busy") or {}).get("decision_ms")
        with_monitor = (dec.get("all_but_one_busy_with_monitor") or {}).get("decision_ms")
        order = r["order"]
        tail = cpu.get("arrival_tail") or {}
        rows.append([count, r["all_queued_after_s"],
                     f"{fmt(tail.get('all_waiters_pct_of_one_core'), 2)} ({fmt(tail.get('window_s'), 1)} s)",
                     cpu["all_waiters_pct_of_one_core"],
                     cpu.get("schedstat_all_waiters_pct_of_one_core"), cpu.get("schedstat_busiest_waiter_pct"),
                     cpu["rss_median_mib"], f"{fmt(none, 2)} / {fmt(most, 2)} / {fmt(with_monitor, 2)}",
                     f"{fmt(r['refusal_all_busy_ms'].get('no_waiters'))} / "
                     f"{fmt(r['refusal_all_busy_ms'].get('with_waiters'))}",
                     _pair(r["dispatch_first_release"]), _pair(r["dispatch"]), _pair(r.get("grant", {})),
                     f"{r['overlap_pairs']} / {r['failures']}",
                     fmt(order.get("queue_kendall_distance"), 3), fmt(r["makespan_ratio"], 2)])
    out.append(table(["waiters", "all queued after s", "arrivals' tail: CPU % of a core (window)",
                      "waiters' CPU % of a core (stat)", "(schedstat)",
                      "busiest waiter %", "RSS per waiter MiB", "decision ms (0 / all-but-1 busy / same with monitor)",
                      "refusal at wait=0 ms (0 / W queued)",
                      "first-release dispatch p50 / p95 ms", "all dispatch p50 / p95 ms", "grant p50 / p95 ms",
                      "overlaps / failures", "FIFO error vs queue (Kendall)", "makespan × ideal"], rows))
    out.append("")
    locks = scale.get("lock_table_read_ms")
    if locks:
        out += [f"One read of `/proc/locks`, which every decision makes (who holds which lease): "
                f"{locks['cold']} ms cold (after 0.2 s without one), {locks['warm']} ms read again at once. "
                "A hand-over that must first look pays the cold figure.", ""]
    return out


def _nvml(nvml: Dict[str, Any]) -> List[str]:
    delays = nvml["slow_init_ms"]
    out = [f"## 4. NVML cost ({nvml['topology']}, fault `slow_init`)", "",
           "Median launch time of `true` (ms) against the time nvmlInit takes; "
           "`inits` = added time / slow_init (how many times a launch pays it).", ""]
    rows = []
    fails = nvml.get("failures", {})
    for tool, per in nvml["launch_median_ms"].items():
        analysis = nvml["analysis"].get(tool, {})
        last = analysis.get(str(delays[-1]), {})
        rows.append([tool + (" †" if tool in STANDIN_TOOLS else "")]
                    + [_with_failures(per.get(str(d)), fails.get(tool, {}).get(str(d))) for d in delays]
                    + [last.get("inits_per_launch"), last.get("slow_init_share_of_launch")])
    out.append(table(["tool"] + [f"{d} ms" for d in delays]
                     + [f"inits at {delays[-1]}", f"share of launch at {delays[-1]}"], rows))
    out.append("")
    return out


# ---- the summary block -------------------------------------------------------------------

START = "<!-- bench:start -->"
END = "<!-- bench:end -->"

_LABELS = {
    "direct": "the program run directly",
    "python -I -c pass": "`python -I -c pass` (the shim's interpreter)",
    "python -IS -c pass": "`python -IS -c pass` (the same, as the shim starts it)",
    "cudawrap+monitor": "cudawrap, `cudawrap monitor` running",
    "cudawrap": "cudawrap, no monitor",
    "gpuselect": "`gpuselect -- CMD` (its CLI)",
    "gpuselect-in-script": "`gpuselect()` at the top of a Python script",
    "nvisel": "`CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=$(nvisel -c 1 -C 1 -f …) CMD`",
    "getgpu": "`CUDA_VISIBLE_DEVICES=$(getgpu) CMD`, a script over `nvidia-smi` †",
}


def _short(topology: str, data: Dict[str, Any]) -> str:
    return f"{data['devices']} {'MIG' if 'mig' in topology else 'GPUs'}"


def summary(results: Dict[str, Any]) -> str:
    """The summary block at the top of RESULTS.md (the docs' benchmark pages include it as it is)."""
    co = results.get("checkout") or {}
    machine = results["machine"]
    provisional = [] if results["mode"] == "full" else [
        f"**Provisional: figures from a {results['mode']} run, not the published ones; "
        "`python3 bench/run.py` replaces them.**", ""]
    out = [START] + provisional + [
           f"Measured in one run of `{results['command']}` ({results['mode']} mode) on the simulated "
           f"machine, {results['date']}, checkout {commit_text(co)}; "
           + f"{machine['cpu']}, {machine['cores']} cores. Interpreter: {interp_line(results['interpreter'])}."
           if results.get("interpreter") else f"Measured in one run of `{results['command']}`.",
           "How it is measured: `bench/README.md`.", ""]
    launch = results.get("launch") or {}
    if launch:
        tops = list(launch.items())
        header = ["launch of a trivial C program"]
        for topology, data in tops:
            header += [f"{_short(topology, data)}: median ms", "× `-I`", "× `-IS`"]
        rows = []
        names = [n for n in _LABELS if any(n in d["methods"] for _, d in tops)]
        for name in names:
            row = [_LABELS[name]]
            for _, data in tops:
                m = data["methods"].get(name)
                if m is None:
                    row += ["–", "–", "–"]
                    continue
                row += [_with_failures(m["median_ms"], m["failures"], m["n"]), fmt(m["x_bare_python"], 2),
                        fmt(m.get("x_bare_python_S"), 2)]
            rows.append(row)
        if any(d.get("monitor_cpu") for _, d in tops):
            row = ["`cudawrap monitor` itself: CPU ms per 0.5 s cycle / % of one core"]
            for _, data in tops:
                cpu = data.get("monitor_cpu")
                row += [f"{cpu['cpu_ms_per_cycle']} ms / {cpu['pct_of_one_core']} %" if cpu else "–", "", ""]
            rows.append(row)
        out += [table(header, rows), ""]
        verdict = targets(results)
        goals = [("launch_within_2x_bare_python", "without the monitor ≤ 2× `-I`"),
                 ("launch_within_1_2x_bare_python_with_monitor", "with the monitor ≤ 1.2× `-I`")]
        met = [f"{text}: {verdict_text(verdict[key])}" for key, text in goals if key in verdict]
        if met:
            out += ["Targets for a wrapped launch, on every topology: " + "; ".join(met) + ".", ""]
        bares = [(f"{_short(t, d)}", d["monitor_block_bare_ms"]) for t, d in tops if d.get("monitor_block_bare_ms")]
        monitor_note = ["* the monitor's rows come from a second block of rounds, with the monitor running, "
                        "and their ratios are to that block's own bare starts: "
                        + "; ".join(f"{name}: `-I` {b.get('python -I -c pass')} ms, `-IS` {b.get('python -IS -c pass')} ms"
                                    for name, b in bares) + "."] if bares else []
        out += ["* *median ms*: median wall time from spawn to exit of interleaved runs; "
                "*(k/n failed)*: k of the n runs exited non-zero (no device for the program).",
                "* *× `-I`*: that median over the median of `python -I -c pass` (site on, no user "
                "environment) of the interpreter the installed shim runs, measured in the same rounds.",
                "* *× `-IS`*: the same over `python -IS -c pass` (site off, as the shim starts).",
               ] + monitor_note + [
                "* the peers' rows run Python from their own venv (the same base interpreter); "
                "`gpuselect()` at the top of a script is that script's whole launch.",
                "* " + STANDIN_NOTE, ""]
    burst = results.get("burst") or {}
    if burst:
        tops = list(burst.items())
        header = ["burst of simultaneous launches"]
        for topology, data in tops:
            any_run = next(iter(data["tools"].values()))
            label = f"{any_run['n']} on {_short(topology, any_run)}"
            header += [f"{label}: ran / failed", "jobs sharing a device (pairs)", "FIFO error (Kendall)",
                       "makespan × ideal"]
        rows = []
        tools = [t for t in (list(_LABELS) + [t for _, d in tops for t in d["tools"]]) if any(
            t in d["tools"] for _, d in tops)]
        for tool in dict.fromkeys(tools):
            row = [tool + (" †" if tool in STANDIN_TOOLS else "")]
            for _, data in tops:
                r = data["tools"].get(tool)
                if r is None:
                    row += ["–"] * 4
                    continue
                row += [f"{r['ok']} / {r['failures']}", str(r["overlap_pairs"]),
                        fmt(r["order"].get("kendall_distance"), 3), fmt(r["makespan_ratio"], 2)]
            rows.append(row)
        out += [table(header, rows), ""]
        out += ["* *ran / failed*: jobs that got a device and ran / that exited without one.",
                "* *jobs sharing a device*: pairs of jobs whose logged run times overlapped on one device.",
                "* *FIFO error*: Kendall distance between launch order and the order of the start times "
                "the jobs logged themselves, among jobs that had to wait (0 = first come first served, "
                "1 = reversed); no tie-break in anyone's favour.",
                "* *makespan × ideal*: first launch to last end over `ceil(N / devices) × hold`.", ""]
    scale = results.get("scale") or {}
    if scale:
        parts = []
        for count, r in scale["runs"].items():
            tail = r["cpu_while_waiting"].get("arrival_tail") or {}
            parts.append(f"{count} waiters: {r['cpu_while_waiting']['all_waiters_pct_of_one_core']} % of one core "
                         f"altogether while waiting ({fmt(tail.get('all_waiters_pct_of_one_core'), 2)} % in the "
                         f"{fmt(tail.get('window_s'), 1)} s after the last one queued), grant p95 {fmt(r.get('grant', {}).get('p95_ms'))} ms, "
                         f"{r['overlap_pairs']} overlaps, {r['failures']} failed")
        out += [f"**Scale** ({scale['topology']}): " + "; ".join(parts) + ".", ""]
    nvml = results.get("nvml") or {}
    if nvml:
        slow = nvml["slow_init_ms"][-1]
        parts = []
        for tool, per in nvml["launch_median_ms"].items():
            failed = nvml.get("failures", {}).get(tool, {}).get(str(slow))
            parts.append(f"{tool} {_with_failures(per.get(str(slow)), failed)} ms")
        out += [f"**Slow NVML init** ({slow} ms per nvmlInit, as on GPUs without persistence mode), median "
                "launch: " + ", ".join(parts) + ".", ""]
    out.append(END)
    return "\n".join(out) + "\n"


def block_of(text: str) -> str:
    """The START..END block of TEXT, markers included."""
    start, end = text.index(START), text.index(END) + len(END)
    return text[start:end]
