"""What queue entries a user plants cost everyone else's launch (SECURITY.md, "The queue
directory can be filled").

    sudo python3 bench/planted.py [--entries 20000] [--runs 15]

On the simulated four-GPU machine, with cudawrap installed under a temporary root, an
ordinary account (`nobody`) plants ENTRIES well-formed queue entries and holds a flock on
each, as an attacker would (several processes, each under its descriptor limit). Only the
first 1000 of them count in any decision (waitqueue.MAX_ENTRIES_PER_USER), but every
launch of another user still lists them all and reads every lock in /proc/locks. Printed,
for an empty queue, one planted entry and ENTRIES planted: the wall time of a wrapped
`true` launched with CUDAWRAP_WAIT=0 (median and p90), of one read of /proc/locks and of
one queue scan as a launch makes it. Figures, not a test: nothing here passes or fails.
"""
from __future__ import annotations

import argparse
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

from fakemachine import FakeMachine, build_fakenvml, preload  # noqa: E402

from cudawrap.installation import prepare  # noqa: E402
from cudawrap.leases import lock_table  # noqa: E402
from cudawrap.paths import Layout  # noqa: E402
from cudawrap.sync import sync  # noqa: E402
from cudawrap.waitqueue import WaitQueue  # noqa: E402

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


def ms(values: List[float]) -> str:
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
    return f"{1000 * statistics.median(values):7.1f} ms (p90 {1000 * p90:6.1f})"


def plant(queue: str, n: int, python: str) -> List[subprocess.Popen]:
    procs = []
    while n > 0:
        k = min(n, PER_PROCESS)
        proc = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                                 python, "-I", "-c", PLANTER, queue, str(k)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline() == b"held\n", "a planter failed"
        procs.append(proc)
        n -= k
    return procs


def release(procs: List[subprocess.Popen]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("cc") is None:
        sys.exit("run as root, with setpriv and cc: the entries are planted by another account (nobody)")
    python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    base = Path(tempfile.mkdtemp(prefix="cudawrap-planted-", dir="/tmp"))
    try:
        base.chmod(0o755)
        lib = build_fakenvml(base / "fakenvml")
        machine = FakeMachine(base / "machine", lib)
        machine.load("four-gpus")
        os.environ.update(machine.env)
        preload(lib)
        layout = Layout(base / "root")
        prepare(layout, sys.executable)
        sync(layout)
        bindir = base / "bin"
        bindir.mkdir()
        subprocess.run(["cc", "-O2", "-o", str(bindir / "CUDAWRAP_true"), str(REPO / "bench" / "true.c")], check=True)
        (bindir / "true").symlink_to(layout.shim)
        env: Dict[str, str] = machine.environ(CUDAWRAP_ROOT=str(layout.root), CUDAWRAP_WAIT="0")
        queue_dir = str(layout.queue_dir)

        def launch() -> None:
            done = subprocess.run([str(bindir / "true")], env=env, capture_output=True)
            assert done.returncode == 0, done.stderr

        def scan() -> None:
            WaitQueue(queue_dir).scan(clean=False)

        print(f"{args.entries} planted entries, {args.runs} runs each, on {os.uname().release}; "
              f"queue on {queue_dir} (a prefix install: not tmpfs unless /tmp is)")
        print(f"{'planted':>8}  {'launch (CUDAWRAP_WAIT=0)':>28}  {'read /proc/locks':>26}  {'queue scan':>26}")
        for n in (0, 1, args.entries):
            planters = plant(queue_dir, n, python) if n else []
            try:
                launch()  # warm the page cache and the policy cache
                row = [ms(timed(launch, args.runs)), ms(timed(lock_table, args.runs)), ms(timed(scan, args.runs))]
                counted = len(WaitQueue(queue_dir).scan(clean=False).waiters)
                print(f"{n:>8}  {row[0]:>28}  {row[1]:>26}  {row[2]:>26}   ({counted} counted)")
            finally:
                release(planters)
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
