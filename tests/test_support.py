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
