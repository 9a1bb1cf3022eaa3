"""Hand-overs and waiting through `cudawrap serve`: issue 30's grant and waiting-cost targets.

burst: N simultaneous wrapped C jobs (bench/hold.c) holding their device H s each on the 7
MIG instances, `cudawrap serve` running; once as root, again as root with the install's
waiter (shims/cudawrap-wait.c) moved aside, so that runs wait in the shim's interpreter
(where no C compiler was found at install: the A/B of the waiter), and once with the jobs
run by `nobody`, an ordinary account (the service is the install's one arbiter: no run takes a
lease but through it, root's included).
With bench/burst.py's machinery (bench/watch.py): the kernel's process events clock each
job's exit (its lease released) and each exec, with the kernel's own times. The grant is
clocked as the issue defines it, from that exit to the next job's exec of its program on
the device: p50/p95/max, and split where the service wrote the grant's record (its `seen` in
the ledger, written just before the descriptors are sent): its decision before, the send,
the run's lock and exec after. Also to the program's first line (hold.c writes it right
after its exec and its dynamic loading), which is what the run sees. Without root the
process events are refused: a pidfd stamps the exit and the start line stands for the exec
(the result says which clock it used). Makespan (first launch to last end) against
ceil(N/devices) x H; overlaps; failures (a run that did not run is a failure, never a
time); and how many runs the service's own log says it granted.

waiters: 7 wrapped hold jobs take every device; T jobs of H s queue behind them (the
turnover), then W runs (hold 0 s) queue behind those (the waiters), all as root (whom
`max_connections_per_uid` does not limit). Once the service says all are waiting: a quiet
window (nothing moves), then the holders are killed and the T jobs turn over on the 7
devices while the W wait. CPU (utime+stime from /proc/PID/stat, and schedstat) of the
service, of the monitor loop it forked, and of all waiters together, as % of one core,
over each window; the turnover window runs from the release to the start of the
second-to-last turnover job (until then no waiter can have been granted: FIFO). Then the
waiters are served: failures, and how long the queue took to drain. W is capped by the
memory free at the time (the first waiters' RSS gives the size of one); the result says so.

Run by bench/service.py: `sudo python3 bench/service.py --parts burst,waiters [--quick] [--waiters W]`.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Set, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from burst import _burst, exec_clock, wait_all  # noqa: E402
from scale import _cpu, _rss_kib  # noqa: E402
from sim import Sim, stop  # noqa: E402
from stats import Job, dispatch_latencies, median, overlaps, read_job_log, summary_ms  # noqa: E402
from watch import Clock  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
GRANTED = re.compile(r"granted \S+ to uid \d+ pid (\d+)")
# A grant decided at a release on the last decision's look carried on (service/loop.py _hand_over).
HANDED = re.compile(r"granted \S+ to uid \d+ pid (\d+) \(.*\), handed over as pid \d+ let go")
# Memory left to everything else on the machine when W is capped by what is free.
RESERVE_MIB = 3072


class Service:
    """`cudawrap serve` running on a simulated machine, its output written to LOG from
    offset SINCE (a file, not a pipe: nothing in the benchmark wakes at each of its lines,
    such as the "granted" line it prints while a run execs, to take the CPU from the run)."""

    def __init__(self, proc: subprocess.Popen, log: Path, since: int) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.log = log
        self.since = since

    def monitor_pid(self) -> Optional[int]:
        """The child the service forked for the monitor's loop."""
        try:
            children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def granted_pids(self, pattern: "re.Pattern[str]" = GRANTED) -> Set[int]:
        """The pids the service said it granted ("granted ... pid N" lines; PATTERN: those of
        them it names as handed over at a release, HANDED)."""
        with open(self.log, "rb") as f:
            f.seek(self.since)
            text = f.read().decode(errors="replace")
        return {int(found.group(1)) for found in pattern.finditer(text)}

    def waiting(self, root: Path) -> Optional[Set[int]]:
        """The pids the service has in line now (its status answer), None if it does not answer."""
        from cudawrap.launch import client
        from cudawrap import wire

        try:
            reply = client.question(str(root), wire.STATUS, {})
        except client.ServiceError:
            return None
        if reply is None:
            return None
        return {int(p.split(":")[0]) for p in reply.get("service_pids", "").split(",") if p}


def _answers(path: Path) -> bool:
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


@contextlib.contextmanager
def serving(sim: Sim) -> Iterator[Service]:
    """`cudawrap serve` running (as root, as its unit runs it) until the block ends."""
    sock = sim.layout.runtime_dir / "cudawrap.sock"
    log = sim.work / "serve.log"
    with open(log, "ab") as out:
        since = out.tell()
        proc = subprocess.Popen([sim.install.cudawrap, "serve"], env=sim.machine.environ(),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not _answers(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cudawrap serve did not start: {log.read_text(errors='replace')[-1000:]}")
            time.sleep(0.05)
        yield Service(proc, log, since)
    finally:
        stop(proc, 30)


# ---- the burst ------------------------------------------------------------------------------

@contextlib.contextmanager
def _waiter_aside(sim: Sim, keep: bool) -> Iterator[bool]:
    """The install's waiter (shims/cudawrap-wait.c) as it is (KEEP), or moved aside meanwhile
    so that runs wait in the shim's interpreter; yields whether runs will wait in it."""
    waiter = sim.layout.waiter
    if keep or not waiter.exists():
        yield waiter.exists()
        return
    aside = waiter.with_name(waiter.name + ".aside")
    os.replace(waiter, aside)
    try:
        yield False
    finally:
        os.replace(aside, waiter)


def service_burst(sim: Sim, n: int, hold: float, nobody: bool, waiter: bool = True) -> dict:
    """N wrapped hold.c jobs at once through the service (by `nobody` with NOBODY); without
    WAITER, with the install's waiter moved aside (an A/B of the same code)."""
    with _waiter_aside(sim, waiter) as waits_in_it:
        out = _service_burst(sim, n, hold, nobody)
    out["waiter"] = waits_in_it
    return out


def _service_burst(sim: Sim, n: int, hold: float, nobody: bool) -> dict:
    if sim.hold_wrapped is None:
        return {"error": "no C compiler: bench/hold.c was not built"}
    if nobody and shutil.which("setpriv") is None:
        return {"error": "setpriv is missing: it runs the jobs as `nobody`"}
    closed = _open_to_all(sim) if nobody else None
    if closed:
        return {"error": closed}
    with serving(sim) as service:
        since = time.time()
        out = _burst(sim, "cudawrap", n, hold, "hold", NOBODY if nobody else (),
                     name="service-nobody" if nobody else "service",
                     granted_at=lambda: ledger_grants(sim, since))
        granted = service.granted_pids()
        handed = service.granted_pids(HANDED)
    jobs = out["jobs"]
    pids = {j["pid"] for j in jobs if j["pid"] is not None}
    # Every run in the ledger, each lease ended when its run did (its own end line, and its
    # exit a moment later): a hand-over must not leave the previous grant open.
    recorded = ledger_ends(sim, pids)
    out["ledger"] = {"runs": len(pids), "counted": len(recorded),
                     "end_after_own_end": summary_ms([recorded[j["pid"]] - j["end"] for j in jobs
                                                      if j["pid"] in recorded and j["end"] is not None])}
    starts = [j["start"] for j in jobs if j["start"] is not None]
    ends = [j["end"] for j in jobs if j["end"] is not None]
    out.pop("after_startup_storm", None)  # it needs the queue directory, which the service's runs never enter
    out.update({"as": "nobody" if nobody else "root",
                "granted_by_service": len(pids & granted),
                "handed_over": len(pids & handed),  # of those, decided on the last look at a release
                # The hand-over in two: a release to the grant's record (the service's decision:
                # 0 where it acted on the lease file's close, which comes before the exit the
                # clock sees), and that record to the run's exec (the send, the run's part: in the
                # waiter, or the shim where there is none).
                "grant_service_part": out.pop("grant"),
                "grant_run_part": summary_ms([(j["execed"] or j["start"]) - j["granted"] for j in _handed_over(jobs)
                                              if j["granted"] is not None])})
    if starts and ends:
        # Without the first round's launch (N shims starting at once on few cores).
        span = max(ends) - min(starts)
        out["makespan_from_first_start_s"] = round(span, 3)
        out["makespan_from_first_start_ratio"] = round(span / out["ideal_makespan_s"], 3)
    return out


def _handed_over(jobs: List[dict]) -> List[dict]:
    """The jobs that got their device from the job before them on it (not the first round,
    whose grants came amid N shims starting at once)."""
    by_device: Dict[str, List[dict]] = {}
    for job in jobs:
        if job["start"] is not None and job["devices"]:
            by_device.setdefault(job["devices"][0], []).append(job)
    return [j for runs in by_device.values() for j in sorted(runs, key=lambda j: j["start"])[1:]]


def ledger_records(sim: Sim, event: str, pids: Optional[Set[int]] = None, service: bool = True) -> List[dict]:
    """The ledger's records of EVENT ("grant" or "end"): the service's (or anyone's, unless
    SERVICE), of PIDS (None: every pid's)."""
    from cudawrap.ledger import files as ledgerfile

    return [r for r in ledgerfile.read([ledgerfile.ledger_path(sim.layout)], [])
            if r["event"] == event and (not service or r.get("seen_by") == "service")
            and (pids is None or r.get("pid") in pids)]


def ledger_grants(sim: Sim, since: float) -> Dict[int, float]:
    """pid -> when the service recorded its grant (the record's `seen`, time.time() just before
    the descriptors were sent), for the service's grants recorded since SINCE."""
    out: Dict[int, float] = {}
    for record in ledger_records(sim, "grant"):
        if isinstance(record.get("seen"), float) and record["seen"] >= since:
            out.setdefault(record["pid"], record["seen"])
    return out


def ledger_ends(sim: Sim, pids: Set[int]) -> Dict[int, float]:
    """pid -> the end the ledger recorded for the service's grant to PIDS (its `end`, to the
    millisecond)."""
    return {r["pid"]: r["end"] for r in ledger_records(sim, "end", pids)}


def _open_to_all(sim: Sim) -> Optional[str]:
    """Let `nobody` reach the install and run the wrapped programs: the benchmark's own
    directories traversable (a temporary work directory is 0700). Nothing above the work
    directory is changed: a closed one is reported instead."""
    top = sim.install.root.parent  # the benchmark's work directory
    closed = [str(d) for d in top.parents if not d.stat().st_mode & 0o001]
    if closed:
        return f"`nobody` cannot reach {top} ({closed[0]} is closed to others): give --work elsewhere"
    for path in (top, sim.install.root, sim.work, sim.bindir):
        path.chmod(path.stat().st_mode & 0o7777 | 0o055)
    return None


# ---- many waiters ---------------------------------------------------------------------------

def _mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def _pss_kib(pid: int) -> Optional[int]:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _cpu_of(pids: List[int]) -> Dict[int, Tuple[Optional[int], Optional[int]]]:
    return {pid: _cpu(pid) for pid in pids}


def _pct(before: Dict[int, Tuple[Optional[int], Optional[int]]],
         after: Dict[int, Tuple[Optional[int], Optional[int]]], elapsed: float) -> dict:
    """CPU between two readings, all PIDS together, as % of one core (ticks and schedstat)."""
    ticks = [after[p][0] - before[p][0] for p in before
             if p in after and before[p][0] is not None and after[p][0] is not None]
    nss = [after[p][1] - before[p][1] for p in before
           if p in after and before[p][1] is not None and after[p][1] is not None]
    out = {"measured": len(ticks), "pct_of_one_core": round(100.0 * sum(ticks) / CLK_TCK / elapsed, 3)}
    if nss:
        out["schedstat_pct_of_one_core"] = round(100.0 * sum(nss) / 1e9 / elapsed, 3)
        out["schedstat_busiest_pct"] = round(100.0 * max(nss) / 1e9 / elapsed, 3)
    return out


class Window:
    """CPU of the service, its monitor and the waiters between start() and stop()."""

    def __init__(self, service: Service, waiters: List[int]) -> None:
        self.groups = {"service": [service.pid], "monitor": [p for p in [service.monitor_pid()] if p],
                       "waiters": waiters}

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.before = {k: _cpu_of(v) for k, v in self.groups.items()}

    def stop(self) -> dict:
        after = {k: _cpu_of(v) for k, v in self.groups.items()}
        elapsed = time.monotonic() - self.t0
        out: dict = {"window_s": round(elapsed, 2)}
        for name, before in self.before.items():
            out[name] = _pct(before, after[name], elapsed)
        return out


def _spawn(sim: Sim, argv: List[str], err: object, clock: Optional[Clock] = None) -> subprocess.Popen:
    spawned = time.time()
    proc = subprocess.Popen(argv, env=sim.environ(), stdout=subprocess.DEVNULL, stderr=err, cwd=sim.work)
    if clock is not None:
        clock.add(proc.pid, spawned)
    return proc


def _until(what: str, ok: Callable[[], bool], timeout: float, step: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(step)


def _all_waiting(service: Service, sim: Sim, pids: List[int]) -> bool:
    line = service.waiting(sim.install.root)
    return line is not None and set(pids) <= line


def _started(logs: List[Path]) -> int:
    return sum(1 for log in logs if log.exists() and log.stat().st_size > 0)


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Launched:
    """What a many-waiters run launched, and when the devices were let go."""

    def __init__(self, logdir: Path, devices: int, turnover: int) -> None:
        self.clock = Clock()
        self.holder_logs = [logdir / f"h{i}.log" for i in range(devices)]
        self.turn_logs = [logdir / f"t{i}.log" for i in range(turnover)]
        self.wlog = logdir / "waiters.log"
        self.holders: List[subprocess.Popen] = []
        self.turn: List[Tuple[Job, subprocess.Popen]] = []
        self.wprocs: List[subprocess.Popen] = []
        self.released = 0.0

    def all(self) -> List[subprocess.Popen]:
        return self.holders + [p for _j, p in self.turn] + self.wprocs

    def waiter_started(self) -> bool:
        return self.wlog.exists() and self.wlog.stat().st_size > 0


def many_waiters(sim: Sim, waiters: int, turnover: int, hold: float, quiet: float, stagger: float) -> dict:
    """W runs waiting while TURNOVER jobs of HOLD s turn over on the devices: what waiting costs."""
    if sim.hold_wrapped is None:
        return {"error": "no C compiler: bench/hold.c was not built"}
    _raise_fd_limit()
    logdir = sim.work / "waiters"
    logdir.mkdir(parents=True, exist_ok=True)
    hold_w = str(sim.hold_wrapped)
    run = Launched(logdir, sim.devices, turnover)
    out: dict = {"devices": sim.devices, "hold_s": hold, "turnover_jobs": turnover}
    with serving(sim) as service, open(logdir / "stderr.txt", "ab") as err:
        since = time.time()
        try:
            run.holders = [_spawn(sim, [hold_w, "3600", str(log)], err, run.clock) for log in run.holder_logs]
            _until("the holders to start", lambda: _started(run.holder_logs) == sim.devices, 60)
            for log in run.turn_logs:
                job = Job(len(run.turn), time.time())
                run.turn.append((job, _spawn(sim, [hold_w, f"{hold:g}", str(log)], err, run.clock)))
            # The turnover must be ahead of every waiter in line.
            _until("the turnover jobs to queue",
                   lambda: _all_waiting(service, sim, [p.pid for _j, p in run.turn]), 60 + turnover * 0.2, 0.2)
            began = time.monotonic()
            run.wprocs, out["memory"] = _spawn_waiters(sim, service, waiters, stagger, hold_w, run.wlog, err)
            pids = [p.pid for p in run.wprocs]
            _until("the waiters to queue", lambda: _all_waiting(service, sim, pids), 120 + len(pids) * 0.1, 0.5)
            out.update(_memory(pids, time.monotonic() - began))
            window = Window(service, pids)
            window.start()
            time.sleep(quiet)
            out["cpu_quiet"] = window.stop()
            # The turnover: the holders go, the T jobs take the devices in turn, the W wait.
            window.start()
            run.released = time.time()
            for proc in run.holders:
                proc.send_signal(signal.SIGTERM)
            _until("the turnover", lambda: _started(run.turn_logs) >= turnover - 1 or run.waiter_started(),
                   60 + 3 * turnover * hold, 0.01)
            out["cpu_turnover"] = window.stop()
            out["cpu_turnover"]["waiter_started_inside"] = run.waiter_started()
            # The drain: every waiter served.
            drain = Window(service, [])
            drain.start()
            out["killed"] = wait_all([p for _j, p in run.turn] + run.wprocs,
                                     time.monotonic() + 120 + 3 * turnover * hold + len(pids) * 0.2)
            out["cpu_drain_service"] = drain.stop()
        finally:
            for proc in run.all():
                if proc.poll() is None:
                    proc.kill()
            wait_all(run.all(), time.monotonic() + 30)
            run.clock.stop()
        granted = ledger_grants(sim, since)
    out.update(_outcome(sim, run, hold, granted))
    return out


def _memory(pids: List[int], queued_after: float) -> dict:
    rss = [r for r in (_rss_kib(p) for p in pids) if r is not None]
    pss = [r for r in (_pss_kib(p) for p in pids[:50]) if r is not None]  # smaps_rollup is slow to read
    return {"waiters": len(pids), "waiters_queued_after_s": round(queued_after, 2),
            "waiter_rss_median_mib": round((median(rss) or 0) / 1024.0, 1),
            "waiter_pss_median_mib": round((median(pss) or 0) / 1024.0, 1),
            "waiters_rss_total_mib": round(sum(rss) / 1024.0, 1)}


def _spawn_waiters(sim: Sim, service: Service, want: int, stagger: float, hold_w: str, log: Path,
                   err: object) -> Tuple[List[subprocess.Popen], dict]:
    """Up to WANT waiting runs, as many as memory allows: the first few measure one's RSS."""
    first = min(want, 20)
    procs = [_spawn(sim, [hold_w, "0", str(log)], err) for _ in range(first)]
    _until("the first waiters to queue", lambda: _all_waiting(service, sim, [p.pid for p in procs]), 120, 0.2)
    rss = median([r for r in (_rss_kib(p.pid) for p in procs) if r is not None]) or 0
    available = _mem_available_mib()
    fits = first + int((available - RESERVE_MIB) * 1024 // rss) if rss else want
    count = max(first, min(want, fits))
    memory = {"asked": want, "launched": count, "rss_kib_each": rss, "mem_available_mib": available,
              "reserve_mib": RESERVE_MIB, "capped_by_memory": count < want}
    for _ in range(count - first):
        procs.append(_spawn(sim, [hold_w, "0", str(log)], err))
        if stagger:
            time.sleep(stagger)
    return procs, memory


def _outcome(sim: Sim, run: Launched, hold: float, granted: Dict[int, float]) -> dict:
    """From the logs and the exits clocked: who ran, the hand-overs, the turnover's makespan."""
    holders: List[Job] = []
    freed: Dict[str, float] = {}
    for i, proc in enumerate(run.holders):
        job = Job(-1 - i, 0.0)
        read_job_log(job, run.holder_logs[i])
        job.exited = run.clock.exited.get(proc.pid)
        job.end = job.exited  # killed: no end line; its lease went with its exit
        holders.append(job)
        for device in job.devices:
            if job.exited is not None:
                freed[device] = job.exited
    for (job, proc), log in zip(run.turn, run.turn_logs):
        job.rc = proc.returncode
        read_job_log(job, log)
        job.exited = run.clock.exited.get(proc.pid)
        job.execed = run.clock.exec_before(proc.pid, job.start)
        job.granted = granted.get(proc.pid)
    ran = [j for j, _p in run.turn if j.ran]
    served = _read_shared_log(run.wlog)
    waiters_ok = [served[p.pid] for p in run.wprocs if p.pid in served]
    pairs, involved = overlaps(holders + ran + waiters_ok)
    ends = [j.end for j in ran if j.end is not None]
    makespan = max(ends) - run.released if ends else None
    ideal = math.ceil(len(run.turn) / sim.devices) * hold
    w_starts = [j.start for j in waiters_ok if j.start is not None]
    return {
        "turnover_ok": len(ran), "turnover_failures": len(run.turn) - len(ran),
        "waiters_ok": len(waiters_ok), "waiter_failures": len(run.wprocs) - len(waiters_ok),
        "overlap_pairs": pairs, "jobs_in_overlaps": involved,
        "granted_by_service": len({j.pid for j in ran + waiters_ok} & set(granted)),
        "grant_to_exec": summary_ms(dispatch_latencies(ran, freed, at="exec")),
        "grant_to_line": summary_ms(dispatch_latencies(ran, freed, at="line")),
        "exec_clock": exec_clock(run.clock, ran),
        "grant_service_part": summary_ms(dispatch_latencies(ran, freed, at="granted")),
        "turnover_makespan_s": round(makespan, 3) if makespan else None, "turnover_ideal_s": ideal,
        "turnover_makespan_ratio": round(makespan / ideal, 3) if makespan else None,
        "drain_s": round(max(w_starts) - min(w_starts), 2) if w_starts else None,
    }


def _read_shared_log(path: Path) -> Dict[int, Job]:
    """pid -> Job from a log many hold.c runs appended to."""
    import json

    out: Dict[int, Job] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        if not line.strip():
            continue
        rec = json.loads(line)
        job = out.setdefault(rec["pid"], Job(rec["pid"], 0.0))
        job.pid = rec["pid"]
        if rec["event"] == "start":
            job.start, job.devices = rec["time"], list(rec["devices"])
        else:
            job.end = rec["time"]
    return out


# ---- sizes and output -------------------------------------------------------------------------

SIZES = {
    "full": {"burst": {"n": 50, "hold": 1.0}, "waiters": {"waiters": 1000, "turnover": 50, "hold": 1.0,
                                                          "quiet": 3.0, "stagger": 0.005}},
    "quick": {"burst": {"n": 14, "hold": 0.3}, "waiters": {"waiters": 40, "turnover": 21, "hold": 0.3,
                                                           "quiet": 1.0, "stagger": 0.005}},
}


# Waiting runs measured in the shim's interpreter, for the waiter's memory comparison.
SHIM_WAITERS = {"full": 100, "quick": 20}


def run_servicescale(sim_for: Callable[[str], Sim], mode: str, waiters: Optional[int] = None,
                     nobody: bool = True, burst: bool = True, many: bool = True) -> dict:
    """Both measurements, each on a fresh a100-mig7 machine (SIM_FOR(topology) makes one)."""
    sizes = SIZES[mode]
    out: dict = {}
    if burst:
        b = sizes["burst"]
        out["burst"] = {"root": service_burst(sim_for("a100-mig7"), b["n"], b["hold"], False)}
        if out["burst"]["root"].get("waiter"):
            # The same burst with runs waiting in the shim's interpreter, as where no compiler was found.
            out["burst"]["root, no waiter"] = service_burst(sim_for("a100-mig7"), b["n"], b["hold"], False,
                                                            waiter=False)
        if nobody:
            out["burst"]["nobody"] = service_burst(sim_for("a100-mig7"), b["n"], b["hold"], True)
    if many:
        w = dict(sizes["waiters"])
        if waiters is not None:
            w["waiters"] = waiters
        sim = sim_for("a100-mig7")
        in_waiter = sim.layout.waiter.exists()
        out["waiters"] = many_waiters(sim, w["waiters"], w["turnover"], w["hold"], w["quiet"], w["stagger"])
        out["waiters"]["waiter"] = in_waiter
        if in_waiter:
            # What a waiting run costs in the shim's interpreter instead (the waiter moved aside):
            # its memory, with fewer of them.
            shim_sim = sim_for("a100-mig7")
            with _waiter_aside(shim_sim, False):
                shim = many_waiters(shim_sim, SHIM_WAITERS[mode], w["turnover"], w["hold"], 1.0, w["stagger"])
            out["waiters_in_shim"] = {k: shim[k] for k in ("waiters", "waiter_rss_median_mib",
                                                            "waiter_pss_median_mib", "waiters_rss_total_mib")}
    return out


def _lat(s: dict) -> str:
    if not s or not s.get("n"):
        return "no hand-overs measured"
    return f"p50 {s['median_ms']:.2f} / p95 {s['p95_ms']:.2f} / max {s['max_ms']:.2f} ms (n={s['n']})"


def show(result: dict) -> None:
    for name, r in result.get("burst", {}).items():
        if "error" in r:
            print(f"  burst ({name}): {r['error']}")
            continue
        waits = ("the waiter (shims/cudawrap-wait.c)" if r.get("waiter")
                 else "the shim's interpreter (no waiter" + (": moved aside)" if "no waiter" in name else " built)"))
        print(f"  burst through the service (runs as {r['as']}): "
              f"{r['n']} x {r['hold_s']:g} s hold.c on {r['devices']} devices; runs wait in {waits}")
        print(f"    ran {r['ok']}/{r['n']}, failures {r['failures']}, overlaps {r['overlap_pairs']}, "
              f"granted by the service {r['granted_by_service']}/{r['ok']}"
              + (f", {r['handed_over']} of them at a release on the last look" if "handed_over" in r else ""))
        print(f"    grant (release's exit -> waiter's exec): {_lat(r['grant_to_exec'])}; clocked by {r['exec_clock']}")
        print(f"      of which exit -> the grant's record {_lat(r['grant_service_part'])}; "
              f"that record -> exec (the send, the run's lock and exec; hand-overs only) {_lat(r['grant_run_part'])}")
        crowd = r.get("grant_to_exec_crowding")
        if crowd:
            print(f"      alone (no other release within {crowd['window_ms']:g} ms) {_lat(crowd['alone'])}; "
                  f"with one (their work on the same cores at once) {_lat(crowd['crowded'])}")
        print(f"    to the program's first line (exec, then its own dynamic loading): {_lat(r['grant_to_line'])}")
        led = r["ledger"]["end_after_own_end"]
        print(f"    ledger: {r['ledger']['counted']} of {r['ledger']['runs']} runs counted; each lease's end after "
              f"the run's own end line p50 {led['median_ms']} / max {led['max_ms']} ms (recorded to the ms)")
        if r["makespan_s"] is not None:
            print(f"    makespan {r['makespan_s']:.3f} s vs ideal {r['ideal_makespan_s']:g} s: "
                  f"x{r['makespan_s'] / r['ideal_makespan_s']:.3f}; from the first start "
                  f"{r.get('makespan_from_first_start_s')} s: x{r.get('makespan_from_first_start_ratio')}")
    w = result.get("waiters", {})
    if "error" in w:
        print(f"  waiters: {w['error']}")
        return
    if not w:
        return
    shim = result.get("waiters_in_shim")
    mem = w["memory"]
    capped = f" (asked {mem['asked']}: capped by memory)" if mem["capped_by_memory"] else ""
    print(f"  {w['waiters']} waiters{capped} while {w['turnover_jobs']} x {w['hold_s']:g} s jobs turn over on "
          f"{w['devices']} devices; waiter RSS median {w['waiter_rss_median_mib']} MiB (PSS "
          f"{w['waiter_pss_median_mib']}), all {w['waiters_rss_total_mib']} MiB; queued in {w['waiters_queued_after_s']} s; "
          + ("they wait in the waiter (shims/cudawrap-wait.c)" if w.get("waiter") else "they wait in the shim (no waiter built)"))
    if shim and "error" not in shim:
        print(f"    the same waiting in the shim's interpreter (the waiter moved aside), {shim['waiters']} of them: "
              f"RSS median {shim['waiter_rss_median_mib']} MiB (PSS {shim['waiter_pss_median_mib']}), "
              f"all {shim['waiters_rss_total_mib']} MiB")
    for label, key in (("quiet", "cpu_quiet"), ("turnover", "cpu_turnover")):
        c = w[key]
        print(f"    {label} window {c['window_s']} s, % of one core (utime+stime / schedstat): "
              + ", ".join(f"{g} {c[g]['pct_of_one_core']:.3f} / {c[g].get('schedstat_pct_of_one_core', float('nan')):.3f}"
                          for g in ("service", "monitor", "waiters")))
    if w["cpu_turnover"].get("waiter_started_inside"):
        print("    NOTE: a waiter started inside the turnover window (a turnover job failed?)")
    print(f"    turnover: ran {w['turnover_ok']}/{w['turnover_jobs']}, failures {w['turnover_failures']}; "
          f"grant {_lat(w['grant_to_exec'])} (to the grant's record {_lat(w['grant_service_part'])}; to the "
          f"program's first line {_lat(w['grant_to_line'])}); makespan {w['turnover_makespan_s']} s vs {w['turnover_ideal_s']:g} s "
          f"(x{w['turnover_makespan_ratio']})")
    print(f"    then the waiters: ran {w['waiters_ok']}/{w['waiters']}, failures {w['waiter_failures']}, drained in "
          f"{w['drain_s']} s (service {w['cpu_drain_service']['service']['pct_of_one_core']:.1f} % of a core); "
          f"overlaps {w['overlap_pairs']}; granted by the service {w['granted_by_service']}/"
          f"{w['turnover_ok'] + w['waiters_ok']}")
