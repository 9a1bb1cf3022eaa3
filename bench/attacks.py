"""What an ordinary account can make other users' runs pay, measured (SECURITY.md).

    sudo python3 bench/attacks.py planted [--entries 20000] [--runs 15]
    sudo python3 bench/attacks.py storm [--waiters 48] [--seconds 8]

On the simulated four-GPU machine, with cudawrap installed under a temporary root; the
attacker is the `nobody` account. Figures, not a test: nothing here passes or fails.

planted: `nobody` plants ENTRIES well-formed queue entries and holds a flock on each
(several processes, each under its descriptor limit). Only the first 1000 count in any
decision (waitqueue.MAX_ENTRIES_PER_USER), but every launch of another user still lists
them all and reads every lock in /proc/locks. Printed for an empty queue, one planted
entry and ENTRIES planted: the wall time of a wrapped `true` launched with
CUDAWRAP_WAIT=0 (median and p90), of one read of /proc/locks and of one queue scan.

storm: every device is held (by this script); WAITERS wrapped runs of root wait for one.
For each of: no storm, `nobody` opening and closing one held lease file 1000 times a
second, `nobody` opening every queue entry in a loop (pokes): the CPU the waiters use
together over SECONDS (a share of one core, from /proc/PID/stat), then the hand-overs: the
devices are let go one at a time and each run that starts is killed in turn, and the time
from a release (or the kill) to the next run's start is read from what the started runs
log (a shell script: `date` adds ~1 ms).
"""
from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.machine import FakeMachine, build_fakenvml, preload  # noqa: E402

from cudawrap.install.installation import prepare  # noqa: E402
from cudawrap.lease.files import lock_table  # noqa: E402
from cudawrap.paths import Layout  # noqa: E402
from cudawrap.ops.sync import sync  # noqa: E402
from cudawrap.sched.queue import WaitQueue  # noqa: E402

PER_PROCESS = 5000  # entries one planter holds (a descriptor each)
PLANTER = r"""
import fcntl, os, resource, sys, time
queue, n = sys.argv[1], int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, max(n + 64, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
fds = []
for i in range(n):
    name = "%020d.%d.1sa.300.wait" % (time.time_ns(), os.getpid())
    fd = os.open(os.path.join(queue, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    fds.append(fd)
print("held", flush=True)
sys.stdin.read()
"""


def timed(fn: Callable[[], object], runs: int) -> List[float]:
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def ms(values: List[float], tail: int = 90) -> str:
    values = sorted(values)
    high = values[min(len(values) - 1, int(tail / 100 * len(values)))]
    return f"{1000 * statistics.median(values):7.1f} ms (p{tail} {1000 * high:6.1f})"


def plant(inst: Install, n: int) -> List[subprocess.Popen]:
    procs = []
    while n > 0:
        k = min(n, PER_PROCESS)
        proc = inst.as_nobody(PLANTER, inst.queue, str(k))
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n", "a planter failed"
        procs.append(proc)
        n -= k
    return procs


def release(procs: List[subprocess.Popen]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()


STORMS = {
    "lease": r"""
import os, sys, time
path = sys.argv[1]
while True:
    os.close(os.open(path, os.O_RDONLY))
    time.sleep(0.001)
""",
    "pokes": r"""
import os, sys, time
queue = sys.argv[1]
while True:
    for name in os.listdir(queue):
        try:
            os.close(os.open(os.path.join(queue, name), os.O_RDONLY | os.O_NONBLOCK))
        except OSError:
            pass
    time.sleep(0.001)
""",
}
STAMP = """#!/bin/sh
echo "$$ $(date +%s.%N)" >> "$STAMP_LOG"
exec sleep 600
"""


class Install:
    """cudawrap under a temporary root on the simulated four-GPU machine, `nobody` may enter."""

    def __init__(self, base: Path) -> None:
        base.chmod(0o755)
        lib = build_fakenvml(base / "fakenvml")
        machine = FakeMachine(base / "machine", lib)
        machine.load("four-gpus")
        os.environ.update(machine.env)
        preload(lib)
        self.layout = Layout(base / "root")
        prepare(self.layout, sys.executable)
        sync(self.layout)
        self.bindir = base / "bin"
        self.bindir.mkdir()
        self.env: Dict[str, str] = machine.environ(CUDAWRAP_ROOT=str(self.layout.root))
        self.queue = str(self.layout.queue_dir)
        self.python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable

    def wrap(self, name: str, real: Path) -> Path:
        os.rename(real, self.bindir / f"CUDAWRAP_{name}")
        (self.bindir / name).symlink_to(self.layout.shim)
        return self.bindir / name

    def as_nobody(self, code: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                                 self.python, "-I", "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def planted(inst: Install, entries: int, runs: int) -> None:
    true = inst.bindir / "true.bin"
    subprocess.run(["cc", "-O2", "-o", str(true), str(REPO / "bench" / "true.c")], check=True)
    program = inst.wrap("true", true)
    env = dict(inst.env, CUDAWRAP_WAIT="0")

    def launch() -> None:
        done = subprocess.run([str(program)], env=env, capture_output=True)
        assert done.returncode == 0, done.stderr

    def scan() -> None:
        WaitQueue(inst.queue).scan(clean=False)

    print(f"{entries} planted entries, {runs} runs each, on {os.uname().release}; "
          f"queue on {inst.queue} (not tmpfs unless /tmp is)")
    print(f"{'planted':>8}  {'launch (CUDAWRAP_WAIT=0)':>28}  {'read /proc/locks':>26}  {'queue scan':>26}")
    for n in (0, 1, entries):
        planters = plant(inst, n) if n else []
        try:
            launch()  # warm the page cache and the policy cache
            row = [ms(timed(launch, runs)), ms(timed(lock_table, runs)), ms(timed(scan, runs))]
            counted = len(WaitQueue(inst.queue).scan(clean=False).waiters)
            print(f"{n:>8}  {row[0]:>28}  {row[1]:>26}  {row[2]:>26}   ({counted} counted)")
        finally:
            release(planters)


def cpu_s(pids: List[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def storm(inst: Install, waiters: int, seconds: float) -> None:
    script = inst.bindir / "stamp.sh"
    script.write_text(STAMP)
    script.chmod(0o755)
    program = inst.wrap("stamp", script)
    lease_files = sorted(str(p) for p in inst.layout.lease_dir.iterdir())
    print(f"{waiters} waiters, every device held; CPU over {seconds:g} s; hand-overs as the devices "
          f"free one at a time; on {os.uname().release}")
    print(f"{'storm':>8}  {'waiters CPU (one core)':>24}  {'hand-over':>30}  {'n':>4}")
    for kind in ("none", "lease", "pokes"):
        log = inst.bindir.parent / f"stamps-{kind}"
        log.touch()
        held = []
        for path in lease_files:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_EX)
            held.append(fd)
        env = dict(inst.env, STAMP_LOG=str(log), CUDAWRAP_WAIT="600")
        runs = [subprocess.Popen([str(program)], env=env, stderr=subprocess.DEVNULL) for _ in range(waiters)]
        deadline = time.monotonic() + 60
        while len([n for n in os.listdir(inst.queue) if n.endswith(".wait")]) < waiters:
            assert time.monotonic() < deadline, "the waiters did not all queue"
            time.sleep(0.05)
        time.sleep(2.0)  # the arrivals' looks are over
        attacker = None
        if kind != "none":
            attacker = inst.as_nobody(STORMS[kind], lease_files[0] if kind == "lease" else inst.queue)
        time.sleep(0.5)
        pids = [p.pid for p in runs]
        used = cpu_s(pids)
        time.sleep(seconds)
        share = (cpu_s(pids) - used) / seconds
        latencies = handovers(runs, held, log)
        if attacker is not None:
            attacker.kill()
            attacker.wait()
        for p in runs:
            p.kill()
            p.wait()
        print(f"{kind:>8}  {100 * share:>23.1f}%  {ms(latencies, 95):>30}  {len(latencies):>4}")


def handovers(runs: List[subprocess.Popen], held: List[int], log: Path) -> List[float]:
    """Free the devices one at a time, then kill each run that starts: the time from each
    release to the start that follows."""
    by_pid = {p.pid: p for p in runs}
    seen = 0
    out = []
    freed = []
    for fd in held:
        freed.append(time.time())
        os.close(fd)
        seen, started = next_start(log, seen)
        out.append(started[1] - freed[-1])
    for _ in range(len(runs) - len(held)):
        victim = by_pid[started[0]]
        killed = time.time()
        victim.kill()
        seen, started = next_start(log, seen)
        out.append(started[1] - killed)
    return out


def next_start(log: Path, seen: int) -> tuple:
    deadline = time.monotonic() + 30
    while True:
        lines = log.read_text().splitlines()
        if len(lines) > seen and lines[seen].count(" ") == 1:
            pid, at = lines[seen].split()
            return seen + 1, (int(pid), float(at))
        assert time.monotonic() < deadline, "no run started"
        time.sleep(0.002)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="section", required=True)
    one = sub.add_parser("planted")
    one.add_argument("--entries", type=int, default=20000)
    one.add_argument("--runs", type=int, default=15)
    two = sub.add_parser("storm")
    two.add_argument("--waiters", type=int, default=48)
    two.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("cc") is None:
        sys.exit("run as root, with setpriv and cc: the attacker is another account (nobody)")
    base = Path(tempfile.mkdtemp(prefix="cudawrap-attacks-", dir="/tmp"))
    try:
        inst = Install(base)
        if args.section == "planted":
            planted(inst, args.entries, args.runs)
        else:
            storm(inst, args.waiters, args.seconds)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def write_results(recorded: "resultsmd.Recorded") -> None:
    """Its own section of bench/RESULTS.md, one per attack (attacks-planted, attacks-storm, ...)."""
    from resultsmd import printed_section, write_section  # (bench/, this script's directory)

    attack = next(a for a in sys.argv[1:] if not a.startswith("-"))
    write_section(f"attacks-{attack}", printed_section(
        f"## What an ordinary account can cost others (`bench/attacks.py {attack}`)", recorded,
        "Figures, as the script printed them; it sets no target. The attacker is the `nobody` account; "
        "the runs decide for themselves (no service)."))


if __name__ == "__main__":
    from resultsmd import recording

    with recording(["bench/attacks.py"] + sys.argv[1:]) as recorded:
        main()
    write_results(recorded)
