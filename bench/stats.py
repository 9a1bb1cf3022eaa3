"""Small statistics on timings and on job logs (who ran on which device, when)."""
from __future__ import annotations

import bisect
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The Q-th percentile (0..100), linearly interpolated; None for no values."""
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Sequence[float]) -> Optional[float]:
    return percentile(values, 50)


def ms(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(value * 1000.0, 2)


def summary_ms(values: Sequence[float]) -> Dict[str, Optional[float]]:
    """n, median, p90, p95, min and max of durations in seconds, as milliseconds."""
    return {"n": len(values), "median_ms": ms(median(values)), "p90_ms": ms(percentile(values, 90)),
            "p95_ms": ms(percentile(values, 95)), "min_ms": ms(min(values) if values else None),
            "max_ms": ms(max(values) if values else None)}


def kendall_distance(order_a: Sequence[int], order_b: Sequence[int]) -> Optional[float]:
    """Fraction of pairs the two orderings of the same items disagree on (0 = same order)."""
    pos = {item: i for i, item in enumerate(order_b)}
    items = [x for x in order_a if x in pos]
    n = len(items)
    if n < 2:
        return None
    ranks = [pos[x] for x in items]
    discordant = sum(1 for i in range(n) for j in range(i + 1, n) if ranks[i] > ranks[j])
    return discordant / (n * (n - 1) / 2)


def rank_displacement(order_a: Sequence[int], order_b: Sequence[int]) -> Tuple[Optional[float], Optional[int]]:
    """Mean and max of |rank in A - rank in B| over the items both orders share."""
    in_a = set(order_a)
    pos_b = {item: i for i, item in enumerate(x for x in order_b if x in in_a)}
    shared = [x for x in order_a if x in pos_b]
    if not shared:
        return None, None
    diffs = [abs(i - pos_b[x]) for i, x in enumerate(shared)]
    return sum(diffs) / len(diffs), max(diffs)


class Job:
    """One launched job: when it was launched, and what the stand-in logged."""

    def __init__(self, index: int, spawned: float) -> None:
        self.index = index
        self.spawned = spawned  # time.time() just before the launch
        self.pid: Optional[int] = None  # the stand-in's pid (as logged)
        self.start: Optional[float] = None
        self.end: Optional[float] = None
        self.devices: List[str] = []
        self.rc: Optional[int] = None
        self.queue_key: Optional[int] = None  # cudawrap's queue key, if it queued
        self.granted: Optional[float] = None  # when it left cudawrap's queue (~ got its device)
        self.exited: Optional[float] = None  # when its process exited (its lease released)
        self.execed: Optional[float] = None  # when it exec'd the program that wrote its start line (kernel's word)

    @property
    def ran(self) -> bool:
        return self.start is not None

    def to_dict(self) -> dict:
        return {"i": self.index, "spawned": self.spawned, "pid": self.pid, "start": self.start,
                "end": self.end, "devices": self.devices, "rc": self.rc, "queue_key": self.queue_key, "granted": self.granted,
                "exited": self.exited, "execed": self.execed}


def read_job_log(job: Job, path: Path) -> None:
    """Fill JOB from the stand-in's --log file (a start and an end line)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        if not line.strip():
            continue
        record = json.loads(line)
        job.pid = record["pid"]
        if record["event"] == "start":
            job.start = record["time"]
            job.devices = list(record["devices"])
        elif record["event"] == "end":
            job.end = record["time"]


def intervals(jobs: Iterable[Job]) -> Dict[str, List[Job]]:
    """device -> jobs that ran on it, by start time."""
    per: Dict[str, List[Job]] = defaultdict(list)
    for job in jobs:
        if job.start is None:
            continue
        for device in job.devices:
            per[device].append(job)
    for spans in per.values():
        spans.sort(key=lambda j: j.start)
    return dict(per)


def _end(job: Job, horizon: float) -> float:
    return job.end if job.end is not None else horizon


def overlaps(jobs: Sequence[Job]) -> Tuple[int, int]:
    """(pairs of jobs that used one device at the same time, jobs involved in any)."""
    horizon = max((_end(j, j.start or 0.0) for j in jobs if j.start is not None), default=0.0)
    pairs = 0
    involved = set()
    for spans in intervals(jobs).values():
        for i, a in enumerate(spans):
            for b in spans[i + 1:]:
                if b.start >= _end(a, horizon):
                    break
                pairs += 1
                involved.update((a.index, b.index))
    return pairs, len(involved)


def released(job: Job, at: str) -> Optional[float]:
    """When JOB's device was freed, as seen from AT: for a dispatch (to the next start line)
    its end line; for a grant, its exit where that was clocked (the lease goes with the
    process, after the stand-in's own teardown), else its end line; for "exec" and "line" as
    for a grant."""
    if at in ("granted", "exec", "line") and job.exited is not None:
        return job.exited
    return job.end


def dispatch_latencies(jobs: Sequence[Job], freed: Optional[Dict[str, float]] = None,
                       at: str = "start") -> List[float]:
    """Device freed -> next job started on it, for each hand-over to a job already waiting.

    A hand-over counts when the next job was launched before the device was freed (it was
    waiting for it) and started after. FREED adds initial release times per device (for
    devices first held by someone else, as in the scale run). AT="granted" measures to
    the moment the job left cudawrap's queue instead of its start line (jobs that never
    queued are left out), from the moment the lease was released (see `released`).
    AT="exec": from that release to the next job's exec of its program (the kernel's process
    events: Job.execed), or where that was not clocked, to its start line; AT="line": from
    that release to the start line, which a C job (bench/hold.c) writes right after its exec
    and its dynamic loading: the grant as the run sees it, whatever decided it.
    """
    return [latency for _release, latency in dispatch_pairs(jobs, freed, at)]


def dispatch_pairs(jobs: Sequence[Job], freed: Optional[Dict[str, float]] = None,
                   at: str = "start") -> List[Tuple[float, float]]:
    """dispatch_latencies' hand-overs as (the release, its latency)."""
    out: List[Tuple[float, float]] = []
    for device, spans in intervals(jobs).items():
        previous_end = freed.get(device) if freed else None
        for job in spans:
            if previous_end is not None and job.spawned < previous_end <= job.start:
                if at in ("start", "line"):
                    out.append((previous_end, job.start - previous_end))
                elif at == "exec":
                    out.append((previous_end, (job.execed if job.execed is not None else job.start) - previous_end))
                elif job.granted is not None:
                    out.append((previous_end, max(job.granted - previous_end, 0.0)))
            end = released(job, at)
            if end is not None:
                previous_end = end if previous_end is None else max(previous_end, end)
    return out


def crowding(pairs: Sequence[Tuple[float, float]], releases: Sequence[float],
             window: float) -> Tuple[List[float], List[float]]:
    """PAIRS' latencies split in two: hand-overs with no other of RELEASES within WINDOW
    seconds of their own (before or after: each hand-over is work for the same few cores),
    and those with one."""
    ordered = sorted(releases)
    alone: List[float] = []
    crowded: List[float] = []
    for release, latency in pairs:
        near = bisect.bisect_right(ordered, release + window) - bisect.bisect_left(ordered, release - window)
        (crowded if near > 1 else alone).append(latency)  # itself among them
    return alone, crowded
