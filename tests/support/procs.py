"""What every test that starts a process shares: waiting for an event, reaping, programs.

* ``wait_for`` polls a condition until it holds (an event: a line written, a lock taken, a
  state reached), never sleeps a fixed time;
* ``Spawned`` (the ``spawned`` fixture, and each install's own) kills and waits for every
  process it started when the test ends, passed or failed, so none outlives its test;
* ``cli_code`` runs the CLI from this checkout; ``sh_program``, ``write_program`` and
  ``one_line`` are the small programs tests wrap and the one-line refusal every bad input
  must get.
"""
from __future__ import annotations

import os
import select
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Sequence

import pytest

import cudawrap

# The checkout that holds the package under test: subprocesses get it on sys.path (an
# editable install made before cudawrap/__init__.py existed resolves `cudawrap` as a
# namespace package from any other working directory).
REPO = str(Path(cudawrap.__file__).resolve().parent.parent)

# Tests that act as other users (real accounts, setuid) run only as root; CI runs as root.
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (acts as other users)")

_CLI_CODE = ("import sys; sys.path[:0] = {path!r}; sys.argv[0] = {prog!r}; "
            "from cudawrap.cli import {entry}; {entry}()")

# The first look comes at once; then the pause doubles up to this, so a condition that
# holds soon costs a few ms and one that takes seconds costs little CPU.
_LONGEST_PAUSE = 0.05


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition",
             details: Callable[[], str] = lambda: "") -> None:
    """Until PREDICATE() is true; after TIMEOUT seconds an AssertionError naming WHAT, with DETAILS()."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while not predicate():
        if time.monotonic() > deadline:
            more = details()
            raise AssertionError(f"{what} not reached in {timeout:g} s" + (f"\n{more}" if more else ""))
        time.sleep(pause)
        pause = min(pause * 2, _LONGEST_PAUSE)


def first_line(proc: subprocess.Popen, timeout: float = 30.0) -> str:
    """PROC's first line of output, read a byte at a time from its pipe (what follows stays for
    ``communicate``); an AssertionError after TIMEOUT seconds or at its end without one."""
    fd, line = proc.stdout.fileno(), b""  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        byte = os.read(fd, 1) if ready else b""
        if not byte:
            raise AssertionError(f"no first line from pid {proc.pid} in {timeout:g} s (so far {line!r})")
        line += byte
    return line.decode().rstrip("\n")


def open_files(pid: int) -> List[str]:
    """What PID's descriptors name now. One closed between the listing and its link is left
    out: a running program opens and closes files meanwhile (CI once met /proc/PID/fd/5 gone)."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return links


def reap(proc: subprocess.Popen) -> None:
    """Kill PROC if it still runs, wait for it and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


class Spawned:
    """The processes a test started; ``close`` reaps them all (a fixture's teardown calls it)."""

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []

    def __call__(self, argv: Any, **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen(ARGV, **KWARGS)``, reaped at the end of the test."""
        return self.add(subprocess.Popen(argv, **kwargs))

    def add(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        while self.procs:
            reap(self.procs.pop())


@pytest.fixture
def spawned() -> Iterator[Spawned]:
    """``spawned(argv, **popen_args)`` starts a process that is reaped when the test ends."""
    procs = Spawned()
    try:
        yield procs
    finally:
        procs.close()


def cli_code(path: Sequence[str] = (REPO,), prog: str = "cudawrap") -> str:
    """Python code running PROG (cudawrap or create-cudawrap) with PATH in front of sys.path."""
    entry = "create_main" if prog == "create-cudawrap" else "main"
    return _CLI_CODE.format(path=list(path), prog=prog, entry=entry)


def write_program(path: Path, text: str, mode: int = 0o755) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def sh_program(path: Path, body: str) -> Path:
    """An executable /bin/sh script at PATH running BODY (dedented)."""
    return write_program(path, "#!/bin/sh\n" + textwrap.dedent(body))


def one_line(result: subprocess.CompletedProcess, hint: bool = False) -> str:
    """The single stderr line of a refused command, asserting there is exactly one (HINT:
    or that line and a second one starting with ``hint: ``), and no traceback."""
    stderr = result.stderr.decode() if isinstance(result.stderr, bytes) else result.stderr
    lines = stderr.splitlines()
    hinted = hint and len(lines) == 2 and "hint: " in lines[1]
    assert len(lines) == 1 or hinted, f"expected one line on stderr, got: {stderr!r}"
    assert "Traceback" not in stderr
    return lines[0]

