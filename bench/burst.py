"""Section 2: N simultaneous launches of jobs holding a device for a fixed time.

Each tool gets a fresh machine. Every job is the stand-in (``fakecuda --require 1 --hold
H --log FILE``), launched through the tool; a job that gets no device exits 100 without
logging, which is counted as a failure. Each job logs to its own file, so jobs are told
apart even where a peer runs the program as a child with another pid (gpuselect).
"""
from __future__ import annotations

import math
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from sim import MONITORED, Bench, Sim
from stats import (Job, crowding, dispatch_latencies, dispatch_pairs, intervals, kendall_distance, median, ms, overlaps,
                   rank_displacement, read_job_log, released, summary_ms)
from watch import Clock


def wait_all(procs: List[subprocess.Popen], deadline: float) -> int:
    """Wait for every process until DEADLINE (monotonic); kill the rest. Returns how many were killed.

    The waits block (no timeout): Popen.wait with one polls, waking this process up to 20
    times a second for the whole burst, on the cores whose hand-overs it measures. A timer
    thread kills what is left at the deadline."""
    killed: List[subprocess.Popen] = []

    def kill_the_rest() -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                killed.append(proc)

    timer = threading.Timer(max(deadline - time.monotonic(), 0.1), kill_the_rest)
    timer.daemon = True
    timer.start()
    try:
        for proc in procs:
            proc.wait()
    finally:
        timer.cancel()
    return len(killed)


def _by_logged_start(jobs: List[Job]) -> List[int]:
    """Job indices in the order of the start times the jobs logged themselves.

    Sorted on the time alone, from reverse launch order: should two jobs log the same
    instant, the later-launched one comes first, so a tie can only count against FIFO.
    """
    return [j.index for j in sorted(sorted(jobs, key=lambda j: j.index, reverse=True), key=lambda j: j.start)]


def order_metrics(jobs: List[Job], first_free: Optional[float]) -> dict:
    """First-come-first-served error among the jobs that had to wait for a device.

    Launch order is the order the benchmark spawned them in (its own clock, just before
    each spawn); start order is the order of the start times the jobs logged (the
    stand-in's own time.time() once it holds its device). A job waited if it started
    after the first device was freed. 0 is perfect FIFO; start-up jitter of the stand-in
    (tens of ms on 2 cores) counts as error: nothing is corrected for.
    """
    if first_free is None:
        waited: List[Job] = []
    else:
        waited = [j for j in jobs if j.start is not None and j.start > first_free]
    launch = [j.index for j in sorted(waited, key=lambda j: j.spawned)]
    start = _by_logged_start(waited)
    mean_disp, max_disp = rank_displacement(launch, start)
    out = {"waited": len(waited), "kendall_distance": _round(kendall_distance(launch, start), 4),
           "mean_rank_error": _round(mean_disp, 2), "max_rank_error": max_disp}
    # Against cudawrap's own record of arrival (its queue entries' keys, read by the
    # watcher), still with the logged start times: the error cudawrap's queue adds
    # beyond the launches' own race to enqueue.
    queued = [j for j in jobs if j.queue_key is not None and j.start is not None]
    if queued:
        arrival = [j.index for j in sorted(queued, key=lambda j: j.queue_key)]
        started = _by_logged_start(queued)
        q_mean, q_max = rank_displacement(arrival, started)
        out.update({"queued": len(queued), "queue_kendall_distance": _round(kendall_distance(arrival, started), 4),
                    "queue_mean_rank_error": _round(q_mean, 2), "queue_max_rank_error": q_max})
    return out


def _round(value: Optional[float], digits: int) -> Optional[float]:
    return None if value is None else round(value, digits)


def standin_costs(sim: Sim, reps: int) -> dict:
    """The stand-in's own share of a hand-over: exec -> its start line, its end line -> exit.

    Both are inside every dispatch latency measured from the log, whatever the tool.
    """
    env = sim.environ()
    env["CUDA_VISIBLE_DEVICES"] = sim.leaf_uuids[0]
    startup: List[float] = []
    teardown: List[float] = []
    for i in range(reps):
        job = Job(i, 0.0)
        log = sim.work / f"standin-{i}.log"
        job.spawned = time.time()
        proc = subprocess.Popen(sim.argv("direct", "job", sim.job_args(0, log)), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc.wait()
        exited = time.time()
        read_job_log(job, log)
        if job.start is not None and job.end is not None:
            startup.append(job.start - job.spawned)
            teardown.append(exited - job.end)
    return {"startup_ms": ms(median(startup)), "end_to_exit_ms": ms(median(teardown))}


def burst_once(sim: Sim, tool: str, n: int, hold: float, program: str = "job") -> dict:
    """N simultaneous launches of PROGRAM: "job" (the Python stand-in) or "hold" (C, no
    interpreter: what is left is cudawrap's hand-overs, for the makespan target)."""
    with sim.monitor(tool == MONITORED):
        return _burst(sim, tool, n, hold, program)


def _burst(sim: Sim, tool: str, n: int, hold: float, program: str, prefix: Sequence[str] = (),
           name: str = "", granted_at: Optional[Callable[[], Dict[int, float]]] = None) -> dict:
    """PREFIX goes before each command line (e.g. setpriv, to run the jobs as another account:
    their log directory is then writable by all). GRANTED_AT: read once the runs are done,
    pid -> when it was granted, where a service says so (its runs never enter the queue
    directory the watcher clocks)."""
    logdir = sim.work / f"burst-{name or tool}-{program}"
    logdir.mkdir(parents=True, exist_ok=True)
    if prefix:
        logdir.chmod(0o1777)
    env = sim.environ()
    # The queue directory's departures clock a run deciding for itself; a service's runs
    # never enter it (GRANTED_AT says when it granted them).
    watcher = Clock(sim.layout.queue_dir if tool.startswith("cudawrap") and granted_at is None else None)
    jobs = [Job(i, 0.0) for i in range(n)]
    procs: List[subprocess.Popen] = []
    with open(logdir / "stderr.txt", "ab") as err:
        t0 = time.time()
        for job in jobs:
            log = logdir / f"{job.index}.log"
            argv = sim.argv(tool, program, sim.job_args(hold, log) if program == "job" else [f"{hold:g}", str(log)])
            job.spawned = time.time()
            procs.append(subprocess.Popen(list(prefix) + argv, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                          cwd=logdir))
            watcher.add(procs[-1].pid, job.spawned)
        ideal = math.ceil(n / sim.devices) * hold
        killed = wait_all(procs, time.monotonic() + 3 * ideal + 60)
    watcher.stop()
    granted = granted_at() if granted_at is not None else None
    for job, proc in zip(jobs, procs):
        job.rc = proc.returncode
        read_job_log(job, logdir / f"{job.index}.log")
        job.exited = watcher.exited.get(proc.pid)
        job.execed = watcher.exec_before(proc.pid, job.start)
        job.queue_key = watcher.keys.get(proc.pid)
        job.granted = watcher.granted(proc.pid) if granted is None else granted.get(proc.pid)
    ran = [j for j in jobs if j.ran]
    pairs, involved = overlaps(ran)
    ends = [j.end for j in ran if j.end is not None]
    makespan = (max(ends) - t0) if ends else None
    devices_used = sorted({d for j in ran for d in j.devices})
    lat = dispatch_latencies(ran)
    to_exec = dispatch_pairs(ran, at="exec")  # (release, latency) of each hand-over, to the exec
    grant = dispatch_latencies(ran, at="granted")
    steady: dict = {}
    if tool.startswith("cudawrap"):
        # Once every launch has either queued or started, the burst's start-up storm (N
        # interpreters importing at once on few cores) is over: hand-overs after that.
        arrived = [watcher.first_seen.get(p.pid, j.start) for j, p in zip(jobs, procs) if j.start is not None]
        settled = max(arrived) if arrived else None
        if settled is not None:
            late = [j for j in ran if j.start is not None]
            steady = {"settled_after_s": round(settled - t0, 2),
                      "dispatch": summary_ms(_after(late, settled, "start")),
                      "grant": summary_ms(_after(late, settled, "granted"))}
    errors = (logdir / "stderr.txt").read_text(errors="replace").splitlines()
    return {
        "n": n, "hold_s": hold, "devices": sim.devices,
        "ok": len(ran), "failures": n - len(ran), "killed": killed,
        "overlap_pairs": pairs, "jobs_in_overlaps": involved,
        "devices_used": len(devices_used),
        "makespan_s": _round(makespan, 3), "ideal_makespan_s": ideal,
        "makespan_ratio": _round(makespan / ideal, 2) if makespan else None,
        "dispatch": summary_ms(lat),
        "grant": summary_ms(grant),
        "grant_to_exec": summary_ms([x for _release, x in to_exec]) if program == "hold" else None,
        "grant_to_line": summary_ms(dispatch_latencies(ran, at="line")) if program == "hold" else None,
        "grant_to_exec_crowding": _crowding(ran, to_exec) if program == "hold" else None,
        "exec_clock": exec_clock(watcher, ran),
        "after_startup_storm": steady,
        "order": order_metrics(ran, min(ends) if ends else None),
        "stderr_sample": errors[-3:],
        "t0": t0,
        "jobs": [j.to_dict() for j in jobs],
    }


CROWD_S = 0.005  # another release this close: two hand-overs' work on the same few cores at once


def _crowding(jobs: List[Job], to_exec: List[Tuple[float, float]]) -> dict:
    """JOBS' hand-overs TO_EXEC (dispatch_pairs) apart: alone, and with another release within CROWD_S."""
    releases = [r for r in (released(j, "exec") for j in jobs) if r is not None]
    alone, crowded = crowding(to_exec, releases, CROWD_S)
    return {"window_ms": CROWD_S * 1e3, "alone": summary_ms(alone), "crowded": summary_ms(crowded)}


def exec_clock(clock: Clock, jobs: List[Job]) -> str:
    """What clocked JOBS' execs: the kernel's process events, or their start lines."""
    if not clock.kernel:
        return "start lines (the kernel's process events need root: each exec is its start line, after its loading)"
    missing = sum(1 for j in jobs if j.execed is None)
    return "the kernel's process events" + (f" ({missing} of {len(jobs)} runs without an exec stamp: "
                                            "their start lines)" if missing else "")


def _after(jobs: List[Job], settled: float, at: str) -> List[float]:
    """Hand-over latencies (as dispatch_latencies) for devices freed after SETTLED."""
    out: List[float] = []
    for spans in intervals(jobs).values():
        for prev, job in zip(spans, spans[1:]):
            end = released(prev, at)
            if end is None or end <= settled or not job.spawned < end <= job.start:
                continue
            if at == "start":
                out.append(job.start - end)
            elif job.granted is not None:
                out.append(max(job.granted - end, 0.0))
    return out


def _wait_for_starts(logs: List[Path], deadline: float) -> bool:
    while time.monotonic() < deadline:
        if all(log.exists() and log.stat().st_size > 0 for log in logs):
            return True
        time.sleep(0.02)
    return False


def simultaneous_release(sim: Sim, lead: float, hold: float, monitored: bool = False) -> dict:
    with sim.monitor(monitored):
        result = _release(sim, lead, hold)
    result["monitor"] = monitored
    return result


def _release(sim: Sim, lead: float, hold: float) -> dict:
    """Every device freed at once, with one cudawrap waiter per device queued LEAD s before.

    Holders (wrapped stand-ins) take every device and stay. One waiter per device is
    launched; once all are in the queue, LEAD seconds pass, then every holder gets
    SIGTERM at once. Each waiter took its NVML inventory when it started, so it saw the
    holders' processes on the devices. Measures how long each freed device then stays
    idle before its waiter gets it.
    """
    logdir = sim.work / f"release-{lead:g}"
    logdir.mkdir(parents=True, exist_ok=True)
    env = sim.environ()
    k = sim.devices
    watcher = Clock(sim.layout.queue_dir)
    holders = [subprocess.Popen(sim.argv("cudawrap", "job", sim.job_args(3600, logdir / f"h{i}.log")), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(k)]
    for proc in holders:
        watcher.add(proc.pid)
    if not _wait_for_starts([logdir / f"h{i}.log" for i in range(k)], time.monotonic() + 60):
        for proc in holders:
            proc.kill()
        watcher.stop()
        return {"error": "holders did not start"}
    jobs = [Job(i, 0.0) for i in range(k)]
    procs: List[subprocess.Popen] = []
    with open(logdir / "stderr.txt", "ab") as err:
        for job in jobs:
            job.spawned = time.time()
            procs.append(subprocess.Popen(sim.argv("cudawrap", "job", sim.job_args(hold, logdir / f"{job.index}.log")),
                                          env=env, stdout=subprocess.DEVNULL, stderr=err))
            watcher.add(procs[-1].pid, job.spawned)
        deadline = time.monotonic() + 60
        while len([p for p in procs if p.pid in watcher.keys]) < k and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(lead)
        for proc in holders:
            proc.terminate()
        wait_all(holders + procs, time.monotonic() + 60 + 3 * hold)
    watcher.stop()
    freed: Dict[str, float] = {}  # end lines (for dispatch)
    released_at: Dict[str, float] = {}  # exits: the leases released (for grants)
    for i, proc in enumerate(holders):
        holder = Job(-1 - i, 0.0)
        read_job_log(holder, logdir / f"h{i}.log")
        holder.exited = watcher.exited.get(proc.pid)
        for device in holder.devices:
            if holder.end is not None:
                freed[device] = holder.end
                released_at[device] = released(holder, "granted")
    for job, proc in zip(jobs, procs):
        job.rc = proc.returncode
        job.exited = watcher.exited.get(proc.pid)
        job.queue_key = watcher.keys.get(proc.pid)
        job.granted = watcher.granted(proc.pid)
        read_job_log(job, logdir / f"{job.index}.log")
    ran = [j for j in jobs if j.ran]
    idle = dispatch_latencies(ran, released_at, at="granted")
    last_free = max(released_at.values()) if released_at else None
    by_arrival = sorted((j for j in ran if j.granted is not None), key=lambda j: j.queue_key or 0)
    return {"grant_after_last_free_ms_by_arrival": [ms(j.granted - last_free) for j in by_arrival] if last_free else [],
            "lead_s": lead, "devices": k, "waiters": k, "ok": len(ran), "failures": k - len(ran),
            "overlap_pairs": overlaps(ran)[0], "grant": summary_ms(idle),
            "dispatch": summary_ms(dispatch_latencies(ran, freed)), "order": order_metrics(ran, last_free)}


def run_burst(bench: Bench, topologies: List[str], n: int, hold: float, standin_reps: int,
              release_leads: List[float], makespan: Optional[dict] = None) -> dict:
    out: Dict[str, dict] = {}
    for topology in topologies:
        per_tool: Dict[str, dict] = {}
        standin = None
        for tool in bench.peers.available():
            sim = bench.sim(topology)
            if standin is None:
                standin = standin_costs(sim, standin_reps)
            per_tool[tool] = burst_once(sim, tool, n, hold)
        release = {}
        for lead in release_leads:
            release[f"{lead:g}"] = simultaneous_release(bench.sim(topology), lead, hold)
            if MONITORED in bench.peers.available():
                release[f"{lead:g}+monitor"] = simultaneous_release(bench.sim(topology), lead, hold, monitored=True)
        out[topology] = {"standin": standin, "tools": per_tool, "simultaneous_release": release}
        if makespan and topology == topologies[0]:
            # Issue 11's burst: N one-second runs of a C program, cudawrap only (the peers
            # share devices, so their makespans say nothing).
            out[topology]["makespan"] = {
                tool: burst_once(bench.sim(topology), tool, makespan["n"], makespan["hold"], "hold")
                for tool in bench.peers.available() if tool.startswith("cudawrap")}
    return out
