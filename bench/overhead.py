"""Sections 1 and 4: what one launch costs, where the shim's time goes, and slow NVML init.

Launches are timed from just before ``posix_spawn`` to ``wait4`` returning, with the
program's output sent to /dev/null. ``wait4`` also gives the process's peak RSS; since
the shim execs the real program in the same process, the peak of a wrapped ``true`` is
the shim's own. Methods are interleaved round-robin so drift hits them all alike.
"""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from sim import BENCH, MONITORED, Bench, Sim
from stats import median, ms, summary_ms

PROBE = BENCH / "shimprobe.py"
BARE = "python -I -c pass"
BARE_S = "python -IS -c pass"


def time_launch(argv: List[str], env: Dict[str, str]) -> Tuple[float, int]:
    """(seconds, exit code) of one launch of ARGV, its output sent to /dev/null."""
    actions = [(os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
               (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)]
    start = time.perf_counter()
    pid = os.posix_spawn(argv[0], argv, env, file_actions=actions)
    _, status = os.waitpid(pid, 0)
    elapsed = time.perf_counter() - start
    return elapsed, os.waitstatus_to_exitcode(status)


def peak_rss_kib(maxrss: Path, argv: List[str], env: Dict[str, str]) -> Optional[int]:
    """Peak RSS of one launch, through the small C parent (bench/maxrss.c).

    The peak RSS the kernel reports includes pages inherited at fork, so it has to be
    read by a small parent, not by this Python process.
    """
    done = subprocess.run([str(maxrss)] + argv, env=env, capture_output=True, text=True, timeout=120)
    try:
        return int(done.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def methods(sim: Sim, tools: List[str]) -> Dict[str, List[str]]:
    out = {
        "direct": sim.argv("direct", "true", []),
        BARE: [sim.install.python, "-I", "-c", "pass"],
        BARE_S: [sim.install.python, "-IS", "-c", "pass"],
    }
    for tool in tools:
        if tool != MONITORED:
            out[tool] = sim.argv(tool, "true", [])
    return out


def measure(cmds: Dict[str, List[str]], env: Dict[str, str], reps: int, warmup: int = 2,
            maxrss: Optional[Path] = None, rss_reps: int = 3, envs: Optional[Dict[str, Dict[str, str]]] = None,
            shuffle: bool = False) -> Dict[str, dict]:
    """Each of CMDS REPS times (after WARMUP rounds), one of each per round; ENVS: a command's own
    environment instead of ENV. SHUFFLE: each round in its own order, so that no command always
    follows the same one (and meets the work that one left behind, a service's after a run)."""
    times: Dict[str, List[float]] = {name: [] for name in cmds}
    failures: Dict[str, int] = {name: 0 for name in cmds}
    order = random.Random(0)  # seeded: a rerun launches in the same orders
    for rep in range(warmup + reps):
        names = list(cmds)
        if shuffle:
            order.shuffle(names)
        for name in names:
            elapsed, rc = time_launch(cmds[name], (envs or {}).get(name, env))
            if rep < warmup:
                continue
            times[name].append(elapsed)
            if rc != 0:
                failures[name] += 1
    out = {}
    for name, argv in cmds.items():
        row = summary_ms(times[name])
        row["failures"] = failures[name]
        if maxrss is not None:
            rss = [r for r in (peak_rss_kib(maxrss, argv, env) for _ in range(rss_reps)) if r is not None]
            row["max_rss_mib"] = round(median(rss) / 1024.0, 1) if rss else None
        out[name] = row
    bare = out[BARE]["median_ms"]
    bare_s = out[BARE_S]["median_ms"] if BARE_S in out else None
    direct = out["direct"]["median_ms"]
    for row in out.values():
        row["x_bare_python"] = round(row["median_ms"] / bare, 2) if bare else None
        row["x_bare_python_S"] = round(row["median_ms"] / bare_s, 2) if bare_s else None
        row["x_direct"] = round(row["median_ms"] / direct, 1) if direct else None
        row["minus_direct_ms"] = round(row["median_ms"] - direct, 2) if direct is not None else None
    return out


# ---- where the shim's time goes ---------------------------------------------------

_IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( +)(\S+)\s*$")


def parse_importtime(text: str) -> Tuple[Dict[str, float], Dict[str, float]]:
    """(self time per top-level package, cumulative time of each first-level import), ms."""
    per_package: Dict[str, float] = {}
    first_level: Dict[str, float] = {}
    for line in text.splitlines():
        match = _IMPORT_LINE.match(line)
        if not match:
            continue
        own_us, cum_us, indent, name = int(match[1]), int(match[2]), len(match[3]), match[4]
        package = name.split(".")[0]
        if package == "cudawrap":
            package = name  # cudawrap's modules one by one
        per_package[package] = per_package.get(package, 0.0) + own_us / 1000.0
        if indent == 1:
            first_level[name] = first_level.get(name, 0.0) + cum_us / 1000.0
    return per_package, first_level


def _median_dicts(samples: List[Dict[str, float]], top: int) -> List[List]:
    keys = set().union(*samples) if samples else set()
    rows = [[k, round(median([s.get(k, 0.0) for s in samples]) or 0.0, 2)] for k in keys]
    rows.sort(key=lambda r: r[1], reverse=True)
    return rows[:top]


def breakdown(sim: Sim, reps: int) -> dict:
    """Phases (wall, no profiler), -X importtime and cProfile of the wrapped `true`."""
    env = sim.environ()
    link = str(sim.true_wrapped)
    phase_samples: List[Dict[str, float]] = []
    totals: List[float] = []
    modules = 0
    for _ in range(reps):
        done = subprocess.run([sim.install.python, "-IS", str(PROBE), "phases", link], env=env,
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            return {"error": done.stderr[-2000:]}
        record = json.loads(done.stdout)
        phase_samples.append({k: v * 1000.0 for k, v in record["phases_s"].items()})
        totals.append(record["total_s"])
        modules = record["modules"]
    per_package: List[Dict[str, float]] = []
    first_level: List[Dict[str, float]] = []
    for _ in range(reps):
        done = subprocess.run([sim.install.python, "-IS", "-X", "importtime", link], env=env,
                              capture_output=True, text=True, timeout=60)
        own, cum = parse_importtime(done.stderr)
        per_package.append(own)
        first_level.append(cum)
    whatif: Dict[str, List[float]] = {"ctypes": [], "nvmldirect": [], "pynvml": [], "pynvml-no-util": []}
    for _ in range(reps):
        for variant, samples in whatif.items():
            done = subprocess.run([sim.install.python, "-IS", str(PROBE), "import-cost", link, variant], env=env,
                                  capture_output=True, text=True, timeout=60)
            if done.returncode == 0:
                samples.append(json.loads(done.stdout)["seconds"])
    done = subprocess.run([sim.install.python, "-IS", str(PROBE), "cprofile", link], env=env,
                          capture_output=True, text=True, timeout=60)
    profile = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-2000:]}
    for key in ("by_own", "by_cumulative"):
        for row in profile.get(key, []):
            row["own_ms"] = ms(row.pop("own_s"))
            row["cum_ms"] = ms(row.pop("cum_s"))
    return {
        "python_code_ms": ms(median(totals)),
        "not_timed": record.get("not_timed", []),
        "modules_loaded": modules,
        "phases_ms": _median_dicts(phase_samples, 20),
        "importtime_self_by_package_ms": _median_dicts(per_package, 15),
        "import_whatif_ms": {k: ms(median(v)) for k, v in whatif.items()},
        "importtime_first_level_cumulative_ms": _median_dicts(first_level, 12),
        "cprofile_by_own": profile.get("by_own", [])[:15],
        "cprofile_by_cumulative": profile.get("by_cumulative", [])[:20],
        "cprofile_error": profile.get("error"),
    }


def run_launch(bench: Bench, topologies: List[str], reps: int, warmup: int, rss_reps: int,
               breakdown_reps: int, monitor_s: float = 10.0) -> dict:
    out: Dict[str, dict] = {}
    for topology in topologies:
        sim = bench.sim(topology)
        tools = bench.peers.available()
        cmds = methods(sim, tools)
        found = measure(cmds, sim.environ(), reps, warmup, maxrss=bench.maxrss, rss_reps=rss_reps)
        result = {"devices": sim.devices, "reps": reps, "methods": found,
                  "commands": {k: " ".join(v) for k, v in cmds.items()}}
        if "nvisel" in tools:
            result["nvisel_threshold"] = sim.nvisel_threshold()
        result["breakdown"] = breakdown(sim, breakdown_reps)
        if MONITORED in tools:
            # A second block with the monitor running; its ratios are to this block's bare start.
            with sim.monitor():
                block = measure({BARE: cmds[BARE], BARE_S: cmds[BARE_S], "direct": cmds["direct"],
                                 MONITORED: cmds["cudawrap"]},
                                sim.environ(), reps, warmup, maxrss=bench.maxrss, rss_reps=rss_reps)
                result["breakdown_with_monitor"] = breakdown(sim, breakdown_reps)
            found[MONITORED] = block[MONITORED]
            # Shown beside the monitored row: its ratios are to these, not to the first block's.
            result["monitor_block_bare_ms"] = {k: block[k]["median_ms"] for k in (BARE, BARE_S)}
            result["monitor_cpu"] = monitor_cpu(sim, monitor_s)
        out[topology] = result
    return out


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds PID has used (/proc/PID/stat, fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def monitor_cpu(sim: Sim, seconds: float) -> dict:
    """The monitor's own CPU while it runs SECONDS at its default period, nothing launching."""
    from cudawrap.devices.snapshot import PERIOD_S

    with sim.monitor():
        time.sleep(PERIOD_S)  # past its first cycle, which also loads pynvml
        pid = sim.monitor_pid
        cpu0, wall0 = _cpu_s(pid), time.monotonic()
        time.sleep(seconds)
        cpu1, wall1 = _cpu_s(pid), time.monotonic()
    cycles = (wall1 - wall0) / PERIOD_S
    return {"devices": sim.devices, "seconds": round(wall1 - wall0, 1), "period_s": PERIOD_S,
            "cpu_ms_per_cycle": round(1000.0 * (cpu1 - cpu0) / cycles, 1),
            "pct_of_one_core": round(100.0 * (cpu1 - cpu0) / (wall1 - wall0), 2)}


def run_nvml(bench: Bench, topology: str, delays_ms: List[int], reps: int) -> dict:
    """Launch time against the fake library's `slow_init` (nvmlInit sleeping so long)."""
    sim = bench.sim(topology)
    tools = bench.peers.available()
    rows: Dict[str, Dict[str, Optional[float]]] = {tool: {} for tool in tools}
    fails: Dict[str, Dict[str, int]] = {tool: {} for tool in tools}
    for delay in delays_ms:
        if delay:
            sim.set_fault("slow_init", str(delay))
        else:
            sim.clear_fault("slow_init")
        cmds = {tool: sim.argv(tool, "true", []) for tool in tools if tool != MONITORED}
        n = reps if delay < 1000 else max(1, reps // 2)
        warmup = 1 if delay < 500 else 0
        result = measure(dict(cmds, direct=sim.argv("direct", "true", []),
                              **{BARE: [sim.install.python, "-I", "-c", "pass"]}),
                         sim.environ(), n, warmup=warmup)
        if MONITORED in tools:
            with sim.monitor():
                result[MONITORED] = measure({MONITORED: sim.argv(MONITORED, "true", []),
                                             "direct": sim.argv("direct", "true", []),
                                             BARE: [sim.install.python, "-I", "-c", "pass"]},
                                            sim.environ(), n, warmup=warmup)[MONITORED]
        for tool in tools:
            rows[tool][str(delay)] = result[tool]["median_ms"]
            fails[tool][str(delay)] = result[tool]["failures"]
    sim.clear_fault("slow_init")
    analysis = {}
    for tool in tools:
        base = rows[tool].get("0")
        per_delay = {}
        for delay in delays_ms:
            value = rows[tool][str(delay)]
            if delay and base is not None and value is not None:
                per_delay[str(delay)] = {
                    "added_ms": round(value - base, 1),
                    "inits_per_launch": round((value - base) / delay, 2),
                    "slow_init_share_of_launch": round((value - base) / value, 2) if value else None,
                }
        analysis[tool] = per_delay
    return {"topology": topology, "devices": sim.devices, "slow_init_ms": delays_ms,
            "launch_median_ms": rows, "failures": fails, "analysis": analysis}
