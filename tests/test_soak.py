"""Load: launches and kills at random on the simulated 56-device DGX, then nothing is left behind.

Small allow-lists and narrowed CUDA_VISIBLE_DEVICES force contention; jobs are killed with
SIGKILL or SIGTERM while they wait or while they run. About 20 s by default;
CUDAWRAP_SOAK_SECONDS=600 soaks longer, CUDAWRAP_SOAK_SEED replays a run.

Afterwards: every lease is free (each lease file can be locked), no stand-in process is
left, the queue holds no live entry, every exit status is one cudawrap documents, and no
device was ever held by two jobs at once (from the stand-in's start/end log; a job killed
with SIGKILL ends, at the latest, when the signal was sent).
"""
from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from cudawrap.sched.queue import WaitQueue

SOAK_S = float(os.environ.get("CUDAWRAP_SOAK_SECONDS", "20"))
MAX_LIVE = 8
# What a run may end with: done, no device in time (75), killed (-9), SIGTERM while running
# (-15, the stand-in dies of it) or while waiting (143, the shim's 128 + SIGTERM).
EXPECTED = {0, 75, -signal.SIGKILL, -signal.SIGTERM, 128 + signal.SIGTERM}


@dataclass
class Job:
    proc: subprocess.Popen
    err: Path
    killed: Optional[Tuple[int, float]] = None  # (signal, when it was sent)
    code: Optional[int] = None


@dataclass
class Soak:
    jobs: List[Job] = field(default_factory=list)
    kills: Dict[str, int] = field(default_factory=lambda: defaultdict(int))


def _started(log: Path) -> set:
    try:
        return {json.loads(line)["pid"] for line in log.read_text().splitlines() if '"start"' in line}
    except (OSError, ValueError):
        return set()


def _overlaps(log: Path, jobs: List[Job]) -> List[str]:
    killed = {j.proc.pid: j.killed for j in jobs if j.killed and j.killed[0] == signal.SIGKILL}
    begun: Dict[int, dict] = {}
    spans: Dict[str, List[Tuple[float, float, int]]] = defaultdict(list)
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "start":
            begun[record["pid"]] = record
        else:
            start = begun.pop(record["pid"], None)
            if start is None:
                continue  # SIGTERM after the stand-in set its handler, before it logged its start
            for device in start["devices"]:
                spans[device].append((start["time"], record["time"], record["pid"]))
    for pid, start in begun.items():  # no end record: it must have been killed with SIGKILL
        assert pid in killed, f"job {pid} started and never ended, yet was not killed"
        for device in start["devices"]:
            spans[device].append((start["time"], killed[pid][1], pid))
    found = []
    for device, runs in spans.items():
        runs.sort()
        for (s1, e1, p1), (s2, e2, p2) in zip(runs, runs[1:]):
            if s2 < e1:
                found.append(f"{device}: job {p2} started at {s2:.3f} while job {p1} held it until {e1:.3f}")
    return found


@pytest.mark.slow
def test_random_launches_and_kills_leave_nothing_behind(installed, tmp_path: Path) -> None:
    seed = int(os.environ.get("CUDAWRAP_SOAK_SEED") or time.time_ns() % 2**32)
    rng = random.Random(seed)
    inst = installed("dgx-a100-mig56")
    inst.wrap("recon")
    migs = inst.machine.leaf_uuids()
    pool = migs[:3] + migs[7:9]  # five devices on two GPUs: contention on purpose
    inst.allow(*pool)
    monitor: Optional[subprocess.Popen] = None
    soak = Soak()
    errs = tmp_path / "stderr"
    errs.mkdir()
    started_at = time.monotonic()
    deadline = started_at + SOAK_S
    try:
        while time.monotonic() < deadline:
            if monitor is None and time.monotonic() > started_at + SOAK_S / 2:
                # Second half: launches read the monitor's snapshot instead of NVML.
                monitor = subprocess.Popen([sys.executable, "-c", "from cudawrap.cli import main; main()",
                                            "monitor", "--period", "0.2"], env=inst.environ(),
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for job in soak.jobs:
                if job.code is None:
                    job.code = job.proc.poll()
            live = [j for j in soak.jobs if j.code is None]
            if len(live) < MAX_LIVE:
                env = {"CUDAWRAP_WAIT": rng.choice(["forever", "forever", "0", "0.3", "1", "3"])}
                if rng.random() < 0.3:
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(rng.sample(pool, rng.randint(1, 2)))
                hold = f"{rng.uniform(0.02, 0.6):.3f}"
                err = errs / f"{len(soak.jobs)}"
                with open(err, "wb") as stream:
                    proc = subprocess.Popen(["recon", "--hold", hold, "--log", str(inst.log)],
                                            env=inst.environ(**env), stdout=subprocess.DEVNULL, stderr=stream,
                                            cwd=inst.bindir)
                soak.jobs.append(Job(proc, err))
            if live and rng.random() < 0.15:
                victim = rng.choice(live)
                sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
                running = victim.proc.pid in _started(inst.log)
                try:
                    victim.killed = (sig, time.time())
                    victim.proc.send_signal(sig)
                    soak.kills[f"{sig.name} {'running' if running else 'waiting'}"] += 1
                except ProcessLookupError:
                    victim.killed = None
            time.sleep(rng.uniform(0.01, 0.05))
        for job in soak.jobs:  # no new launches: everyone gets through (or gives up) in bounded time
            try:
                job.code = job.proc.wait(timeout=60) if job.code is None else job.code
            except subprocess.TimeoutExpired:
                job.proc.kill()
                raise AssertionError(f"job {job.proc.pid} still running 60 s after the soak; "
                                     f"seed {seed}: {job.err.read_text()}") from None
    finally:
        if monitor is not None:
            monitor.terminate()
            monitor.wait(timeout=10)
        for job in soak.jobs:
            if job.proc.poll() is None:
                job.proc.kill()
                job.proc.wait()

    where = f"seed {seed}, {len(soak.jobs)} launches, kills {dict(soak.kills)}"
    odd = [(j.proc.pid, j.code, j.err.read_text()[-300:]) for j in soak.jobs if j.code not in EXPECTED]
    assert not odd, (where, odd)
    assert not [j for j in soak.jobs if "Traceback" in j.err.read_text()], where
    assert sum(j.code == 0 for j in soak.jobs) >= len(soak.jobs) // 4, where
    assert soak.kills["SIGKILL running"] + soak.kills["SIGTERM running"] > 0, where
    assert soak.kills["SIGKILL waiting"] + soak.kills["SIGTERM waiting"] > 0, where
    # Every lease is free: the kernel dropped each holder's lock when it died.
    for lease in inst.layout.lease_dir.iterdir():
        fd = os.open(lease, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    # No stand-in (or shim) is left anywhere.
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(inst.bindir).encode() in cmdline:
            left.append((pid, cmdline))
    assert not left, (where, left)
    # No live entry in the queue; the dead ones of killed waiters are removed by anyone's next look.
    queue = WaitQueue(str(inst.layout.queue_dir))
    assert queue.scan().waiters == [], where
    assert [n for n in os.listdir(inst.layout.queue_dir) if n.endswith(".wait")] == [], where
    # And never one device held by two jobs at once.
    assert _overlaps(inst.log, soak.jobs) == [], where
