"""An installed cudawrap on a simulated machine: the fixture the core tests build on.

The install root is laid out by the product's own ``installation.prepare`` and
``sync.sync`` under ``tmp_path``; programs are wrapped by hand here (a renamed copy and
a symlink to the shim), so these tests need nothing of the admin commands.

``Installed`` runs everything as the test's own user, in the test's environment;
``users.MuInstall`` is the same install where other accounts can reach it, run as any of
them in a clean environment. Every process either starts is reaped when its test ends.
"""
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

from cudawrap.install.installation import install_program_shim, prepare
from cudawrap.install.waiter import build_waiter
from cudawrap.paths import Layout
from .machine import FAKECUDA, FakeMachine
from .procs import REPO, Spawned, cli_code

if TYPE_CHECKING:
    from .users import User

# What a run of the test's own environment must not inherit: it would choose for cudawrap.
_INHERITED_CHOICES = ("CUDA_VISIBLE_DEVICES", "CUDAWRAP_LEASE", "CUDAWRAP_WAIT", "CUDAWRAP_VERBOSE", "SLURM_JOB_ID")


class Installed:
    """An install root on MACHINE, programs in BINDIR, run by the test's own user."""

    # Flags for the interpreter that runs the CLI and Python snippets.
    python_flags: Tuple[str, ...] = ()

    def __init__(self, layout: Layout, machine: FakeMachine, bindir: Path, python: str = sys.executable,
                 path: Sequence[str] = (REPO,), cwd: Optional[Path] = None) -> None:
        self.layout = layout
        self.machine = machine
        self.bindir = bindir
        self.python = python
        self.path = list(path)
        self.cwd = bindir if cwd is None else cwd
        self.log = bindir.parent / "jobs.log"
        self.spawned = Spawned()

    # --- setting up ------------------------------------------------------------------
    def wrap(self, name: str = "recon", program: Path = FAKECUDA) -> Path:
        real = self.bindir / f"CUDAWRAP_{name}"
        text = program.read_bytes()
        if text.startswith(b"#!/usr/bin/env python3\n"):
            # `env python3` may be pyenv's shim, which edits PATH: bake the interpreter in
            # so the program sees exactly what cudawrap handed it (and starts faster).
            text = f"#!{self.python} -IS\n".encode() + text.split(b"\n", 1)[1]
        real.write_bytes(text)
        real.chmod(0o755)
        link = self.bindir / name
        # Its own shim, the link baked in, as create-cudawrap makes it (the shim's fast path
        # asks the service only from one; the shared shim of older installs goes the general way).
        install_program_shim(self.layout, str(link))
        link.symlink_to(self.layout.program_shim(str(link)))
        return link

    def write_config(self, text: str) -> None:
        self.layout.config_file.write_text(text)
        self.layout.config_file.chmod(0o644)

    def allow(self, *uuids: str, extra: str = "") -> None:
        """Let cudawrap hand out only UUIDS (an allow-list), EXTRA configured too; no sync."""
        self.write_config(allow_list(uuids) + extra)

    def configure(self, text: str, *allow: str) -> None:
        """TEXT as the configuration (and an allow-list of ALLOW, if any); then sync, as root
        does after an edit (it makes the slot files, for one)."""
        self.write_config(text + ("\n" + allow_list(allow) if allow else ""))
        self.sync()

    def sync(self) -> None:
        from cudawrap.ops.sync import sync

        sync(self.layout)

    # --- running things ----------------------------------------------------------------
    def environ(self, **extra: Optional[str]) -> Dict[str, str]:
        """The test's own environment less what would choose for cudawrap, this machine's
        variables and the root, EXTRA (None removes a key); the programs first on PATH."""
        base = {k: v for k, v in os.environ.items() if k not in _INHERITED_CHOICES}
        env = self.machine.environ(base, CUDAWRAP_ROOT=str(self.layout.root), **extra)
        env["PATH"] = f"{self.bindir}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def _argv(self, user: "Optional[User]", argv: Sequence[str]) -> List[str]:
        return user.argv(argv) if user is not None else list(argv)

    def _run(self, user: "Optional[User]", argv: Sequence[str], timeout: float = 60,
             input: Optional[bytes] = None, **extra: Optional[str]) -> subprocess.CompletedProcess:
        return subprocess.run(self._argv(user, argv), env=self.environ(**extra), capture_output=True,
                              timeout=timeout, cwd=self.cwd, input=input)

    def _start(self, user: "Optional[User]", argv: Sequence[str], **extra: Optional[str]) -> subprocess.Popen:
        return self.spawned(self._argv(user, argv), env=self.environ(**extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=self.cwd)

    def _cli_argv(self, args: Sequence[str], prog: str) -> List[str]:
        return [self.python, *self.python_flags, "-c", cli_code(self.path, prog), *args]

    def _py_argv(self, code: str, args: Sequence[str]) -> List[str]:
        return [self.python, *self.python_flags, "-c", code, *args]

    def run(self, *argv: str, timeout: float = 60, input: Optional[bytes] = None,
            **extra: Optional[str]) -> subprocess.CompletedProcess:
        return self._run(None, argv, timeout, input, **extra)

    def start(self, *argv: str, **extra: Optional[str]) -> subprocess.Popen:
        """ARGV started with pipes for its output; killed and reaped when the test ends."""
        return self._start(None, argv, **extra)

    def cli(self, *args: str, prog: str = "cudawrap", **extra: Optional[str]) -> subprocess.CompletedProcess:
        return self._run(None, self._cli_argv(args, prog), **extra)

    def hold(self, seconds: float = 30, **env: str) -> "Tuple[subprocess.Popen, dict]":
        """The wrapped ``recon`` holding its devices for SECONDS (logged); once it says so."""
        proc = self.start("recon", "--hold", str(seconds), "--log", str(self.log), **env)
        return proc, ready_line(proc)

    def jobs(self) -> List[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        """Kill and reap every process started through this install."""
        self.spawned.close()


def waiting_line(proc: subprocess.Popen) -> str:
    """A run's first stderr line, which says it waits (a queued run's)."""
    line = proc.stderr.readline().decode()
    assert "waiting" in line, line + proc.stderr.read().decode()
    return line


def intervals(jobs: List[dict]) -> Dict[str, List[Tuple[float, float, int]]]:
    """device -> [(start, end, pid)] from the stand-in's log."""
    start: Dict[int, dict] = {}
    per_device: Dict[str, List[Tuple[float, float, int]]] = defaultdict(list)
    for job in jobs:
        if job["event"] == "start":
            start[job["pid"]] = job
        else:
            begun = start.pop(job["pid"])
            for device in begun["devices"]:
                per_device[device].append((begun["time"], job["time"], job["pid"]))
    assert not start, f"jobs that never ended: {sorted(start)}"
    return per_device


def overlaps(jobs: List[dict]) -> List[tuple]:
    """(device, pid, pid) of every two runs in the stand-in's log that held one device at once."""
    found = []
    for device, spans in intervals(jobs).items():
        spans.sort()
        for (s1, e1, p1), (s2, e2, p2) in zip(spans, spans[1:]):
            if s2 < e1:
                found.append((device, p1, p2))
    return found


def allow_list(uuids: Sequence[str]) -> str:
    """The configuration's table allowing only UUIDS."""
    return "[devices]\nallow = [%s]\n" % ", ".join(f'"{u}"' for u in uuids)


def ready_line(proc: subprocess.Popen) -> dict:
    """The stand-in's first stdout line: it holds its devices from now on."""
    line = proc.stdout.readline()
    assert line, f"no output; stderr: {proc.stderr.read().decode(errors='replace')}"
    return json.loads(line)


_built_waiter: List[Path] = []


def built_waiter() -> Path:
    """The waiter (shims/cudawrap-wait.c), built by the installer's own step once per session,
    in a directory removed when the session ends (each session left one in /tmp before)."""
    if not _built_waiter:
        import atexit
        import shutil
        import tempfile

        scratch = Layout(Path(tempfile.mkdtemp(prefix="cudawrap-waiter-")))
        atexit.register(shutil.rmtree, scratch.root, ignore_errors=True)
        said: List[str] = []
        assert build_waiter(scratch, said.append), said
        _built_waiter.append(scratch.waiter)
    return _built_waiter[0]


def lay_out(directory: Path, python: str, mode: int = 0o755, waiter: bool = True) -> Tuple[Layout, Path]:
    """An install root (``root``) prepared for PYTHON and a program directory (``bin``) in
    DIRECTORY; with the waiter, as an install where a C compiler was found has it."""
    layout = Layout(directory / "root")
    prepare(layout, python)
    if waiter:
        import shutil

        shutil.copy2(built_waiter(), layout.waiter)
    bindir = directory / "bin"
    bindir.mkdir(mode=mode, exist_ok=True)
    return layout, bindir


@pytest.fixture
def installed(machine: Callable[..., FakeMachine], tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Installed]]:
    """Factory: ``installed("a100-mig7")`` is cudawrap installed on that simulated machine."""
    made: List[Installed] = []

    def make(topology: str = "four-gpus") -> Installed:
        fake = machine(topology)
        fake.activate(monkeypatch)
        layout, bindir = lay_out(tmp_path, sys.executable)
        inst = Installed(layout, fake, bindir)
        made.append(inst)
        inst.sync()
        return inst

    try:
        yield make
    finally:
        for inst in made:
            inst.close()
