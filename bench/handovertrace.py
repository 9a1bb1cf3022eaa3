"""Where a hand-over's time goes: bursts through the service with the kernel's scheduler traced.

bench/service.py clocks each hand-over whole (a run's exit to the next run's exec) and cuts
it once, where the service wrote the grant's record. This runs the same burst (50 x 1 s
hold.c on 7 MIG instances, runs as root, waiting in the waiter) with ftrace recording every
wake-up, context switch, exec and exit on the machine, and cuts each hand-over where the
service woke the waiting run (its send):

  before the send: the service on a CPU | runnable, waiting for one | asleep (not yet woken
                   by the exit or the lease's close, or blocked: on the ledger's lock, say)
  after the send:  the run on a CPU     | runnable, waiting for one (of which another CPU
                   sat idle)            | blocked (in its exec: page faults, I/O)

and counts, among the slowest, two causes no code of ours can take out of the hand-over: a
virtual CPU that came back late (a wake-up the kernel started and finished >= LATE_MS apart:
the hypervisor did not run that vCPU meanwhile), and a service woken before its send by
its monitor child (which lets go of the ledger's lock then: it holds it for its writes).

ftrace costs each event ~1 us, so these hand-overs are a little slower than bench/service.py's;
the parts, not the totals, are the point. Root only (tracefs); the tracer's settings are put
back after.

Usage: sudo python3 bench/handovertrace.py [--runs 3] [--json FILE] [--work DIR]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
import tempfile
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

from about import checkout, machine_info  # noqa: E402
from report import machine_line  # noqa: E402
from sim import Bench, Peers  # noqa: E402
from stats import percentile  # noqa: E402

TRACEFS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
EVENTS = ("sched/sched_waking", "sched/sched_wakeup", "sched/sched_switch", "sched/sched_process_exec",
          "sched/sched_process_exit")
LATE_MS = 1.0
PARTS = ("total", "service_cpu", "service_runnable", "service_asleep", "run_cpu", "run_runnable",
         "run_runnable_cpu_idle", "run_blocked")
HEADS = ("total", "svc cpu", "svc runq", "svc asleep", "run cpu", "run runq", "(cpu idle)", "run blocked")
_LINE = re.compile(r"^\s*(.+?)-(\d+)\s+\[(\d+)\]\s+\S+\s+([\d.]+):\s+(\w+):\s+(.*)$")
_PID = re.compile(r" pid=(\d+)")
_SWITCH = re.compile(r"prev_pid=(\d+) prev_prio=(\d+) prev_state=(\S+) ==> .*next_pid=(\d+)")
MONITOR_PRIO = 125  # the kernel's prio of nice 5: the service's monitor child (install/units.py MONITOR_NICE)

Event = Tuple[float, int, int, str, str, str]  # time, cpu, pid, comm, name, the rest


@contextlib.contextmanager
def tracing(buffer_kib: int = 65536) -> Iterator[Path]:
    """ftrace on for EVENTS (monotonic clock), every setting it changes put back after."""
    base = next((p for p in TRACEFS if (p / "trace").exists()), None)
    if base is None:
        raise RuntimeError("no tracefs (mount -t tracefs nodev /sys/kernel/tracing), or not root")
    saved = {name: (base / name).read_text().strip() for name in ("tracing_on", "buffer_size_kb")}
    clock = re.search(r"\[(\w+)\]", (base / "trace_clock").read_text())
    enabled = {e: (base / "events" / e / "enable").read_text().strip() for e in EVENTS}
    try:
        (base / "tracing_on").write_text("0")
        (base / "buffer_size_kb").write_text(str(buffer_kib))
        (base / "trace_clock").write_text("mono")
        (base / "trace").write_text("")
        for e in EVENTS:
            (base / "events" / e / "enable").write_text("1")
        (base / "tracing_on").write_text("1")
        yield base
    finally:
        (base / "tracing_on").write_text(saved["tracing_on"])
        for e, value in enabled.items():
            (base / "events" / e / "enable").write_text(value)
        (base / "trace_clock").write_text(clock.group(1) if clock else "local")
        (base / "buffer_size_kb").write_text(saved["buffer_size_kb"])


def parse(text: str) -> List[Event]:
    out: List[Event] = []
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            comm, pid, cpu, ts, name, rest = m.groups()
            out.append((float(ts), int(cpu), int(pid), comm, name, rest))
    return out


class Timeline:
    """Who ran where and when, from the events: on-CPU spans, runnable spans, idle spans."""

    def __init__(self, events: Sequence[Event]) -> None:
        self.exits: Dict[int, float] = {}
        self.execs: Dict[int, List[float]] = defaultdict(list)
        self.oncpu: Dict[int, List[Tuple[float, float]]] = defaultdict(list)
        self.runnable: Dict[int, List[Tuple[float, float]]] = defaultdict(list)
        self.idle: Dict[int, List[Tuple[float, float]]] = defaultdict(list)
        self.wakings: Dict[int, List[Tuple[float, int, str]]] = defaultdict(list)  # pid -> (when, waker, its comm)
        self.late: List[Tuple[float, float]] = []  # (wake-up started, ms until it was done), where late
        self.monitor: set = set()  # cudawrap processes seen running at the monitor's nice
        since: Dict[int, float] = {}
        ready: Dict[int, float] = {}
        started: Dict[int, float] = {}
        for t, cpu, pid, comm, name, rest in events:
            if name == "sched_process_exit":
                self.exits[int(_PID.search(rest).group(1))] = t  # type: ignore[union-attr]
            elif name == "sched_process_exec":
                self.execs[pid].append(t)
            elif name == "sched_waking":
                woken = int(_PID.search(rest).group(1))  # type: ignore[union-attr]
                self.wakings[woken].append((t, pid, comm))
                started[woken] = t
            elif name == "sched_wakeup":
                woken = int(_PID.search(rest).group(1))  # type: ignore[union-attr]
                ready.setdefault(woken, t)
                begun = started.pop(woken, None)
                if begun is not None and (t - begun) * 1000 >= LATE_MS:
                    self.late.append((begun, (t - begun) * 1000))
            elif name == "sched_switch":
                m = _SWITCH.search(rest)
                if m is None:
                    continue
                prev, prio, state, nxt = int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4))
                if comm == "cudawrap" and prio == MONITOR_PRIO:
                    self.monitor.add(prev)
                if cpu in since:
                    (self.idle[cpu] if prev == 0 else self.oncpu[prev]).append((since[cpu], t))
                since[cpu] = t
                if prev != 0 and state.startswith("R"):
                    ready[prev] = t  # preempted: runnable from now
                if nxt != 0 and nxt in ready:
                    self.runnable[nxt].append((ready.pop(nxt), t))

    @staticmethod
    def within(spans: Sequence[Tuple[float, float]], a: float, b: float) -> float:
        return sum(max(0.0, min(e, b) - max(s, a)) for s, e in spans)

    def idle_during(self, spans: Sequence[Tuple[float, float]], a: float, b: float) -> float:
        """Time any CPU sat idle while in SPANS (clipped to [A, B])."""
        total = 0.0
        for s, e in spans:
            s, e = max(s, a), min(e, b)
            if e > s:
                total += sum(self.within(idle, s, e) for idle in self.idle.values())
        return total


def hand_overs(jobs: Sequence[dict]) -> List[Tuple[int, int]]:
    """(the run that let go, the run that got its device) for each device's turnover."""
    by_device: Dict[str, List[dict]] = defaultdict(list)
    for job in jobs:
        if job.get("start") is not None and job.get("devices") and job.get("pid"):
            by_device[job["devices"][0]].append(job)
    pairs = []
    for runs in by_device.values():
        runs.sort(key=lambda j: j["start"])
        pairs += [(a["pid"], b["pid"]) for a, b in zip(runs, runs[1:])]
    return pairs


def split(tl: Timeline, before: int, after: int) -> Optional[dict]:
    """One hand-over's parts (ms), or None where its ends or the send are not in the trace."""
    if before not in tl.exits or not tl.execs.get(after):
        return None
    t0, t1 = tl.exits[before], tl.execs[after][-1]
    sends = [(t, w) for t, w, comm in tl.wakings.get(after, []) if t0 <= t <= t1 and comm == "cudawrap"]
    if not sends:
        return None
    sent, service = sends[0]
    ms = 1000.0
    out = {"total": (t1 - t0) * ms,
           "service_cpu": tl.within(tl.oncpu[service], t0, sent) * ms,
           "service_runnable": tl.within(tl.runnable[service], t0, sent) * ms,
           "run_cpu": tl.within(tl.oncpu[after], sent, t1) * ms,
           "run_runnable": tl.within(tl.runnable[after], sent, t1) * ms,
           "run_runnable_cpu_idle": tl.idle_during(tl.runnable[after], sent, t1) * ms}
    out["service_asleep"] = max((sent - t0) * ms - out["service_cpu"] - out["service_runnable"], 0.0)
    out["run_blocked"] = max((t1 - sent) * ms - out["run_cpu"] - out["run_runnable"], 0.0)
    out["late_vcpu"] = any(t0 - 0.001 <= at <= t1 for at, _ms in tl.late)
    # Blocked before its send until the monitor child woke it (letting go of the ledger's lock).
    out["woken_by_monitor"] = any(t0 <= t <= sent and w in tl.monitor for t, w, _comm in tl.wakings.get(service, []))
    return out


def one_burst(bench: Bench, n: int, hold: float) -> Tuple[dict, List[dict]]:
    import servicescale

    sim = bench.sim("a100-mig7")
    with tracing() as base:
        out = servicescale.service_burst(sim, n, hold, False)
        (base / "tracing_on").write_text("0")
        events = parse((base / "trace").read_text())
    tl = Timeline(events)
    rows = [r for r in (split(tl, a, b) for a, b in hand_overs(out.get("jobs", []))) if r is not None]
    whole = {"failures": out.get("failures"), "hand_overs": len(rows), "events": len(events),
             "late_vcpu_wakeups": len(tl.late), "latest_vcpu_wakeup_ms": round(max((m for _t, m in tl.late), default=0.0), 2)}
    return whole, rows


def summarize(rows: List[dict]) -> dict:
    out: dict = {}
    for q in (0.5, 0.9, 0.95):
        out[f"p{int(q * 100)}"] = {p: round(percentile([r[p] for r in rows], q * 100) or 0.0, 3) for p in PARTS}
    worst = sorted(rows, key=lambda r: -r["total"])[:max(1, len(rows) // 10)]
    out["worst_10pct_mean"] = {p: round(sum(r[p] for r in worst) / len(worst), 3) for p in PARTS}
    out["worst_10pct"] = {"n": len(worst), "late_vcpu": sum(r["late_vcpu"] for r in worst),
                          "woken_by_monitor": sum(r["woken_by_monitor"] for r in worst)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="bursts (default 3)")
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--hold", type=float, default=1.0)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="cudawrap-bench-handovertrace-"))
    bench = Bench(work, Peers(None, None, []))
    result: dict = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "checkout": checkout(),
                    "machine": machine_info(), "bursts": []}
    rows: List[dict] = []
    try:
        for _ in range(args.runs):
            whole, got = one_burst(bench, args.n, args.hold)
            whole["summary"] = summarize(got) if got else None
            result["bursts"].append(whole)
            rows += got
    except RuntimeError as exc:
        print(f"bench/handovertrace.py: {exc}", file=sys.stderr)
        return 1
    result["all"] = summarize(rows) if rows else None
    print(f"bench/handovertrace.py, {result['date']}, commit {result['checkout']['commit']}")
    print(f"Machine: {machine_line(result['machine'])}")
    print(f"{args.runs} bursts of {args.n} x {args.hold:g} s hold.c on 7 MIG through the service (root, the waiter), "
          f"ftrace on; each hand-over cut at the service's send (ms)")
    for i, whole in enumerate(result["bursts"], 1):
        s = whole["summary"]
        print(f"  burst {i}: {whole['hand_overs']} hand-overs, failures {whole['failures']}, p50 / p95 "
              f"{s['p50']['total']:.2f} / {s['p95']['total']:.2f}; vCPU wake-ups >= {LATE_MS:g} ms late: "
              f"{whole['late_vcpu_wakeups']} (latest {whole['latest_vcpu_wakeup_ms']} ms)" if s else
              f"  burst {i}: no hand-over traced")
    if result["all"]:
        a = result["all"]
        print(f"  {'':18s}" + "".join(f"{h:>12s}" for h in HEADS))
        for key in ("p50", "p90", "p95", "worst_10pct_mean"):
            print(f"  {key:18s}" + "".join(f"{a[key][p]:12.3f}" for p in PARTS))
        w = a["worst_10pct"]
        print(f"  of the worst {w['n']}: {w['late_vcpu']} with a vCPU back late, {w['woken_by_monitor']} with the "
              f"service woken before its send by its monitor child (the ledger's lock let go)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
