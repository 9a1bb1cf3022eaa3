"""An installed cudawrap on a simulated machine: the fixture the core tests build on.

The install root is laid out by the product's own ``installation.prepare`` and
``sync.sync`` under ``tmp_path``; programs are wrapped by hand here (a renamed copy and
a symlink to the shim), so these tests need nothing of the admin commands.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import pytest

from cudawrap.install.installation import prepare
from cudawrap.paths import Layout
from .machine import FAKECUDA, FakeMachine


class Installed:
    def __init__(self, layout: Layout, machine: FakeMachine, bindir: Path) -> None:
        self.layout = layout
        self.machine = machine
        self.bindir = bindir
        self.log = bindir.parent / "jobs.log"

    def environ(self, **extra: Optional[str]) -> Dict[str, str]:
        env = self.machine.environ(CUDAWRAP_ROOT=str(self.layout.root), **extra)
        env["PATH"] = f"{self.bindir}:{env.get('PATH', '/usr/bin:/bin')}"
        env.pop("CUDA_VISIBLE_DEVICES", None) if "CUDA_VISIBLE_DEVICES" not in extra else None
        for key in ("CUDAWRAP_LEASE", "CUDAWRAP_WAIT", "CUDAWRAP_VERBOSE", "SLURM_JOB_ID"):
            if key not in extra:
                env.pop(key, None)
        return env

    def wrap(self, name: str = "recon", program: Path = FAKECUDA) -> Path:
        real = self.bindir / f"CUDAWRAP_{name}"
        shutil.copy2(program, real)
        text = real.read_bytes()
        if text.startswith(b"#!/usr/bin/env python3\n"):
            # `env python3` may be pyenv's shim, which edits PATH: bake the interpreter in
            # so the program sees exactly what cudawrap handed it (and starts faster).
            real.write_bytes(f"#!{sys.executable} -IS\n".encode() + text.split(b"\n", 1)[1])
        real.chmod(0o755)
        link = self.bindir / name
        link.symlink_to(self.layout.shim)
        return link

    def write_config(self, text: str) -> None:
        self.layout.config_file.write_text(text)

    def sync(self) -> None:
        from cudawrap.ops.sync import sync

        sync(self.layout)

    def run(self, *argv: str, timeout: float = 60, **extra: Optional[str]) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.environ(**extra), capture_output=True,
                              timeout=timeout, cwd=self.bindir)

    def start(self, *argv: str, **extra: Optional[str]) -> subprocess.Popen:
        return subprocess.Popen(list(argv), env=self.environ(**extra), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=self.bindir)

    def cli(self, *args: str, **extra: Optional[str]) -> subprocess.CompletedProcess:
        code = "from cudawrap.cli import main; main()"
        return self.run(sys.executable, "-c", code, *args, **extra)

    def jobs(self) -> List[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]


def ready_line(proc: subprocess.Popen) -> dict:
    """The stand-in's first stdout line: it holds its devices from now on."""
    line = proc.stdout.readline()
    assert line, f"no output; stderr: {proc.stderr.read().decode(errors='replace')}"
    return json.loads(line)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)


@pytest.fixture
def installed(machine: Callable[..., FakeMachine], tmp_path: Path,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Installed]]:
    """Factory: ``installed("a100-mig7")`` is cudawrap installed on that simulated machine."""
    made: List[subprocess.Popen] = []

    def make(topology: str = "four-gpus") -> Installed:
        fake = machine(topology)
        fake.activate(monkeypatch)
        layout = Layout(tmp_path / "root")
        prepare(layout, sys.executable)
        bindir = tmp_path / "bin"
        bindir.mkdir(exist_ok=True)
        inst = Installed(layout, fake, bindir)
        inst.sync()
        return inst

    yield make
    for proc in made:
        proc.kill()
