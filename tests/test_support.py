"""The suite's own support (tests/support): what a test starts ends with it, failed or not."""
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

from support.machine import pid_alive

TESTS = str(Path(__file__).resolve().parent)

# Two tests that start a long process each, note its pid, then fail.
FAILING = '''
import sys
from pathlib import Path

sys.path.insert(0, {tests!r})
from support.installed import installed, ready_line  # noqa: E402,F401
from support.machine import fakenvml_lib, machine  # noqa: E402,F401
from support.procs import spawned  # noqa: E402,F401

PIDS = Path({pids!r})


def note(pid):
    with PIDS.open("a") as f:
        f.write(f"{{pid}}\\n")


def test_started_through_an_install(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    proc = inst.start("recon", "--hold", "600")
    ready_line(proc)
    note(proc.pid)
    assert False, "fails while its run holds a device"


def test_started_through_spawned(spawned):
    note(spawned(["sleep", "600"]).pid)
    assert False, "fails while its process runs"
'''


def _noted(path: Path) -> List[int]:
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def test_processes_of_failed_tests_are_reaped(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    (tmp_path / "test_failing.py").write_text(FAILING.format(tests=TESTS, pids=str(pids)))
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_failing.py"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")})
        assert "2 failed" in done.stdout, done.stdout + done.stderr
        assert len(_noted(pids)) == 2, done.stdout
        assert [pid for pid in _noted(pids) if pid_alive(pid)] == []
    finally:
        for pid in _noted(pids):  # whatever the fixtures left, this test does not leave
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


# A test that lays out an install (with the waiter, built once a session).
LAYS_OUT = '''
import os
import sys

sys.path.insert(0, {tests!r})
from support.installed import installed  # noqa: E402,F401
from support.machine import fakenvml_lib, machine  # noqa: E402,F401


def test_an_install_has_the_waiter(installed):
    assert os.access(installed("four-gpus").layout.waiter, os.X_OK)
'''


def test_a_session_leaves_no_waiter_build_behind(tmp_path: Path) -> None:
    """Issue 51 item 12: each session left a /tmp/cudawrap-waiter-* (the waiter it built once)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    (tmp_path / "test_lays_out.py").write_text(LAYS_OUT.format(tests=TESTS))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "--basetemp", str(tmp_path / "base"), "test_lays_out.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=dict(env, TMPDIR=str(scratch)))
    assert "1 passed" in done.stdout, done.stdout + done.stderr
    assert os.listdir(scratch) == []


def test_a_sessions_topology_has_uuids_of_its_own() -> None:
    """Issue 51 item 12: the walk-throughs claim their GPUs machine-wide, so each session's UUIDs
    are its own, with the file's prefixes (GPU-5e7f stays ambiguous in four-gpus) and order."""
    import re

    from support.machine import SESSION, TOPOLOGIES, session_topology

    for name in ("four-gpus", "a100-mig7"):
        theirs = re.findall(r"uuid=(\S+)", (TOPOLOGIES / f"{name}.topo").read_text())
        ours = re.findall(r"uuid=(\S+)", session_topology(name))
        assert len(ours) == len(set(ours)) == len(theirs) and not set(ours) & set(theirs)
        assert [u[:-12] for u in ours] == [u[:-12] for u in theirs] and all(SESSION in u for u in ours)
