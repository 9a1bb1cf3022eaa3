"""Section 3: many devices, many waiters.

For each number of waiters W, on a fresh machine:

1. decision time: the shim's own code (``shimprobe phases``) with no device busy and
   with all but one busy (the one free device is the last one looked at); and the time
   a launch told not to wait takes to refuse when all is busy, with no waiter queued
   and (after step 3) with W queued: it scans the queue first;
2. the benchmark itself takes every device's lease (flock, as a running job would), so
   the launches that follow all queue;
3. W wrapped stand-ins are launched, a few ms apart; once all W are in the queue, their
   CPU use is read from /proc over the next SETTLE seconds (the arrivals' tail: those
   queued earlier still look at the newcomers) and then over a window, the waiting
   itself (utime+stime, and schedstat where present);
4. the leases are released one by one, spread over a short interval, and every waiter
   runs its job (holding its device HOLD seconds); dispatch latency, FIFO order against
   the queue's own arrival order, overlaps and makespan are read from the logs.
"""
from __future__ import annotations

import fcntl
import heapq
import json
import os
import statistics
import subprocess
import time
from typing import Dict, List, Optional, Tuple

from burst import order_metrics, wait_all
from overhead import PROBE, time_launch
from sim import MONITORED, Bench, Sim
from stats import Job, dispatch_latencies, intervals, median, ms, overlaps, read_job_log, summary_ms
from watch import Clock

CLK_TCK = os.sysconf("SC_CLK_TCK")


def hold_leases(sim: Sim, uuids: List[str]) -> Dict[str, int]:
    """Take the lease of each UUID in this process (descriptors are not inherited)."""
    held = {}
    for uuid in uuids:
        fd = os.open(str(sim.layout.lease_file(uuid)), os.O_RDONLY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held[uuid] = fd
    return held


def probe(sim: Sim, reps: int) -> Optional[dict]:
    totals: List[float] = []
    obtain: List[float] = []
    for _ in range(reps):
        done = subprocess.run([sim.install.python, "-IS", str(PROBE), "phases", str(sim.true_wrapped)],
                              env=sim.environ(), capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            return None
        record = json.loads(done.stdout)
        phases = record["phases_s"]
        totals.append(record["total_s"])
        obtain.append(sum(v for k, v in phases.items() if k.startswith(("nvmlInit", "NVML", "acquire", "rest of obtain"))))
    return {"python_code_ms": ms(median(totals)), "decision_ms": ms(median(obtain))}


def _cpu(pid: int) -> Tuple[Optional[int], Optional[int]]:
    """(utime+stime ticks, on-CPU ns from schedstat) of PID, None where unreadable."""
    ticks = ns = None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    except (OSError, IndexError, ValueError):
        pass
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            ns = int(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        pass
    return ticks, ns


def _rss_kib(pid: int) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def waiter_cpu(pids: List[int], window: float) -> dict:
    before = {pid: _cpu(pid) for pid in pids}
    start = time.monotonic()
    time.sleep(window)
    after = {pid: _cpu(pid) for pid in pids}
    elapsed = time.monotonic() - start
    ticks = [after[p][0] - before[p][0] for p in pids if before[p][0] is not None and after[p][0] is not None]
    nss = [after[p][1] - before[p][1] for p in pids if before[p][1] is not None and after[p][1] is not None]
    rss = [r for r in (_rss_kib(p) for p in pids) if r is not None]
    out = {
        "window_s": round(elapsed, 2), "waiters_measured": len(ticks),
        "all_waiters_pct_of_one_core": round(100.0 * sum(ticks) / CLK_TCK / elapsed, 3),
        "busiest_waiter_pct": round(100.0 * max(ticks, default=0) / CLK_TCK / elapsed, 3),
        "rss_median_mib": round((median(rss) or 0) / 1024.0, 1),
        "rss_total_mib": round(sum(rss) / 1024.0, 1),
    }
    if nss:
        out["schedstat_all_waiters_pct_of_one_core"] = round(100.0 * sum(nss) / 1e9 / elapsed, 3)
        out["schedstat_busiest_waiter_pct"] = round(100.0 * max(nss) / 1e9 / elapsed, 3)
    return out


def refusal_ms(sim: Sim, reps: int) -> Optional[float]:
    """Median time of a wrapped `true` told not to wait (CUDAWRAP_WAIT=0) while all is busy.

    It checks the queue under the queue's mutex before refusing (exit 75), so this is the
    cost a newcomer pays for the waiters already queued.
    """
    env = dict(sim.environ(), CUDAWRAP_WAIT="0")
    times = []
    for _ in range(reps):
        elapsed, rc = time_launch([str(sim.true_wrapped)], env)
        if rc == 75:
            times.append(elapsed)
    return ms(median(times))


def ideal_makespan(freed: List[float], waiters: int, hold: float) -> float:
    """Greedy FIFO schedule from the release times, with zero dispatch cost."""
    heap = list(freed)
    heapq.heapify(heap)
    last = freed[0] if freed else 0.0
    for _ in range(waiters):
        at = heapq.heappop(heap)
        last = max(last, at + hold)
        heapq.heappush(heap, at + hold)
    return last - min(freed)


def scale_once(sim: Sim, waiters: int, hold: float, window: float, settle: float, spread: float,
               stagger: float, decision_reps: int) -> dict:
    uuids = list(sim.leaf_uuids)
    decision = {"none_busy": probe(sim, decision_reps)}
    held = hold_leases(sim, uuids[:-1])
    decision["all_but_one_busy"] = probe(sim, decision_reps)
    if MONITORED in sim.peers.available():
        with sim.monitor():
            decision["all_but_one_busy_with_monitor"] = probe(sim, decision_reps)
    held.update(hold_leases(sim, uuids[-1:]))
    refusal = {"no_waiters": refusal_ms(sim, max(decision_reps, 3))}

    logdir = sim.work / "scale"
    logdir.mkdir(parents=True, exist_ok=True)
    env = sim.environ()
    jobs = [Job(i, 0.0) for i in range(waiters)]
    procs: List[subprocess.Popen] = []
    watcher = Clock(sim.layout.queue_dir)
    t_spawn = time.monotonic()
    with open(logdir / "stderr.txt", "ab") as err:
        for job in jobs:
            argv = sim.argv("cudawrap", "job", sim.job_args(hold, logdir / f"{job.index}.log"))
            job.spawned = time.time()
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=logdir))
            watcher.add(procs[-1].pid, job.spawned)
            if stagger:
                time.sleep(stagger)
        deadline = time.monotonic() + 60 + waiters * 0.5
        while watcher.snapshot() < waiters and time.monotonic() < deadline:
            time.sleep(0.05)
        queued_after = time.monotonic() - t_spawn
        in_queue = watcher.snapshot()
        # The arrivals' own work (the watchers look at each newcomer, the far waiters settle)
        # ends a moment after the last one queued: measured apart, then the waiting itself.
        tail = waiter_cpu([p.pid for p in procs], settle)
        cpu = waiter_cpu([p.pid for p in procs], window)
        cpu["arrival_tail"] = {k: tail[k] for k in ("window_s", "all_waiters_pct_of_one_core")}
        cpu["in_queue"] = in_queue
        refusal["with_waiters"] = refusal_ms(sim, max(decision_reps, 3))
        freed: Dict[str, float] = {}
        gap = spread / max(len(held), 1)
        for uuid, fd in held.items():
            freed[uuid] = time.time()
            os.close(fd)
            time.sleep(gap)
        rounds = -(-waiters // len(uuids))
        killed = wait_all(procs, time.monotonic() + 3 * rounds * hold + 120)
    watcher.stop()
    for job, proc in zip(jobs, procs):
        job.rc = proc.returncode
        job.queue_key = watcher.keys.get(proc.pid)
        job.granted = watcher.granted(proc.pid)
        job.exited = watcher.exited.get(proc.pid)
        read_job_log(job, logdir / f"{job.index}.log")
    ran = [j for j in jobs if j.ran]
    pairs, involved = overlaps(ran)
    lat = dispatch_latencies(ran, freed)
    grant = dispatch_latencies(ran, freed, at="granted")
    first_round = [spans[0].start - freed[d] for d, spans in intervals(ran).items() if d in freed]
    ends = [j.end for j in ran if j.end is not None]
    first_free = min(freed.values())
    makespan = max(ends) - first_free if ends else None
    ideal = ideal_makespan(sorted(freed.values()), waiters, hold)
    errors = (logdir / "stderr.txt").read_text(errors="replace").splitlines()
    return {
        "waiters": waiters, "devices": len(uuids), "hold_s": hold, "release_spread_s": spread,
        "spawn_stagger_ms": stagger * 1000, "all_queued_after_s": round(queued_after, 2),
        "decision": decision, "refusal_all_busy_ms": refusal, "cpu_while_waiting": cpu,
        "ok": len(ran), "failures": waiters - len(ran), "killed": killed,
        "overlap_pairs": pairs, "jobs_in_overlaps": involved,
        "dispatch": summary_ms(lat), "grant": summary_ms(grant), "dispatch_first_release": summary_ms(first_round),
        "makespan_s": round(makespan, 3) if makespan else None, "ideal_makespan_s": round(ideal, 3),
        "makespan_ratio": round(makespan / ideal, 3) if makespan and ideal else None,
        "order": order_metrics(ran, first_free),
        "stderr_lines": len(errors),
        "stderr_sample": [line for line in errors if "waiting" not in line and "got " not in line][-3:],
        "t0": first_free,
        "jobs": [j.to_dict() for j in jobs],
    }


def lock_table_read_ms(reps: int = 7) -> Dict[str, float]:
    """What one read of /proc/locks (every decision's look at who holds what) costs this kernel:
    cold, after 0.2 s without a read (the kernel first waits out an RCU grace period to freeze
    the lock lists), and warm, read again at once. Medians of REPS."""
    cold, warm = [], []
    for _ in range(reps):
        time.sleep(0.2)
        for samples in (cold, warm):
            start = time.perf_counter()
            with open("/proc/locks", "rb") as f:
                f.read()
            samples.append(1000.0 * (time.perf_counter() - start))
    return {"cold": round(statistics.median(cold), 2), "warm": round(statistics.median(warm), 2)}


def run_scale(bench: Bench, topology: str, waiters: List[int], hold: float, window: float,
              settle: float, spread: float, stagger: float, decision_reps: int) -> dict:
    runs = {}
    for count in waiters:
        sim = bench.sim(topology)
        runs[str(count)] = scale_once(sim, count, hold, window, settle, spread, stagger, decision_reps)
    return {"topology": topology, "runs": runs, "lock_table_read_ms": lock_table_read_ms()}
