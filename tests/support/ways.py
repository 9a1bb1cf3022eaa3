"""One test body, both ways a run is decided: by the run itself (daemonless) and by `cudawrap serve`.

The documentation promises one rule either way: what a run gets, or is told, does not depend on whether
the install runs the service. A test of that takes the fixture ``both``: it runs twice, once
on an install whose runs decide for themselves and once on the same install with its service
running (as root, as a root install runs it), and the body cannot tell which but by asking
(``way.served``), which it does only to say which way failed.

``both(topology, config)`` is the ``installed`` install (root's runs, the test's environment)
with ``recon`` wrapped; ``users=True`` makes it ``users.MuInstall`` (real accounts: alice, bob,
carol; each call takes the user first) where whose run it is matters. Through the service,
what NVML lists reaches the decisions through the snapshot the service's monitor child
rewrites every half second (devices/snapshot.py); ``way.listed()`` waits for that rewrite after
a process starts or stops on a GPU outside cudawrap, and returns at once without the service
(a run then asks NVML itself).
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, List, Optional

import pytest

from .installed import Installed, ready_line
from .procs import cli_code
from .users import User

DAEMONLESS, SERVED = "daemonless", "served"
# The monitor rewrites the snapshot every half second; a loaded CI machine may be late.
LISTED_WITHIN_S = 10.0


class Way:
    """An install (INST) whose runs decide for themselves, or through its service (SERVED)."""

    def __init__(self, name: str, inst: Installed) -> None:
        self.name = name
        self.inst = inst
        self.service: Optional[subprocess.Popen] = None
        self.failure: Optional[AssertionError] = None

    @property
    def served(self) -> bool:
        return self.name == SERVED

    def __repr__(self) -> str:
        return f"Way({self.name})"

    def start(self) -> None:
        """Start the service where this way has one, as root; it listens on return."""
        if not self.served:
            return
        inst = self.inst
        # Not among the install's own processes (inst.close() kills those first): its end is
        # checked. Its lines go to a file: a pipe nobody reads would stop it after ~400 grants.
        # Apart from the install, which its fixture removes before this one's end checks the log.
        self.log = Path(tempfile.mkdtemp(prefix="cudawrap-serve-")) / "serve.log"
        with open(self.log, "wb") as out:
            self.service = subprocess.Popen([inst.python, *inst.python_flags, "-c", cli_code(inst.path), "serve"],
                                            env=inst.environ(), cwd=inst.cwd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while "listening on" not in self.said():
            assert self.service.poll() is None and time.monotonic() < deadline, self.said()
            time.sleep(0.02)
        self.listed(writes=1)  # and its monitor child is up (before a test edits the config)

    def said(self) -> str:
        """What the service has said so far (its grants, its errors)."""
        return self.log.read_text(errors="replace")

    def check(self) -> None:
        """The service (if any) still runs and logged no traceback: a way that broke is a failure."""
        if self.service is not None:
            assert self.service.poll() is None, f"the service died during the test: {self.said()}"
            assert "Traceback" not in self.said(), self.said()

    def end(self) -> None:
        """Check the service (failure: what went wrong) and stop it."""
        if self.service is None:
            return
        try:
            self.check()
        except AssertionError as exc:
            self.failure = exc
        self.service.terminate()
        self.service.wait(timeout=10)
        self.service = None
        shutil.rmtree(self.log.parent, ignore_errors=True)

    def listed(self, writes: int = 2) -> None:
        """Once NVML lists a change of processes on a GPU (one started or stopped outside
        cudawrap), wait until decisions can see it: through the service, the monitor's next
        snapshot; without it, at once (each run reads NVML, or the snapshot, for itself)."""
        if not self.served:
            return
        from cudawrap.base import rootfile
        from cudawrap.devices.snapshot import VERSION

        root, path = str(self.inst.layout.root), str(self.inst.layout.usage_snapshot)
        since = time.monotonic()
        deadline = since + LISTED_WITHIN_S
        # The first snapshot written from now on may have been read from NVML before: the one after it.
        for _ in range(writes):
            while True:
                data = rootfile.read(root, path, VERSION)
                if data is not None and data.get("written", 0) > since:
                    since = data["written"]
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"the service's monitor wrote no snapshot within {LISTED_WITHIN_S:g} s")
                time.sleep(0.05)

    def by_hand(self, user: Optional[User], device: str, seconds: float = 60) -> subprocess.Popen:
        """USER's CUDA program run by hand (the real program, past its shim) on DEVICE: a
        process cudawrap did not start, listed by NVML; once decisions can see it."""
        real = self.inst.bindir / "CUDAWRAP_recon"
        proc = self.inst._start(user, [str(real), "--hold", str(seconds)], CUDA_VISIBLE_DEVICES=device)
        ready_line(proc)
        self.listed()
        return proc


@pytest.fixture(params=[DAEMONLESS, SERVED])
def both(request: pytest.FixtureRequest) -> Iterator[Callable[..., Way]]:
    """Factory: ``both("four-gpus", config)`` is an install with ``recon`` wrapped and CONFIG
    written (then synced), its runs deciding for themselves in one run of the test and through
    its service in the other; USERS: with real accounts (tests/support/users.py)."""
    made: List[Way] = []

    def make(topology: str = "four-gpus", config: str = "", users: bool = False) -> Way:
        factory: Any = request.getfixturevalue("mu" if users else "installed")
        inst = factory(topology)
        inst.wrap("recon")
        if config:
            inst.configure(config)
        way = Way(request.param, inst)
        made.append(way)
        way.start()
        close = inst.close
        inst.close = lambda: (way.end(), close())  # before its fixture removes the install under the service
        return way

    try:
        yield make
    finally:
        for way in made:
            way.end()
    for way in made:
        if way.failure is not None:
            raise way.failure
