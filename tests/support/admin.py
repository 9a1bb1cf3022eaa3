"""Fixtures for the admin side: an install root in tmp_path, programs to wrap, the CLI as
a subprocess (or as another user, in a forked child), and a snapshot of a file tree to
prove that a refused command changed nothing.
"""
from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import pytest

from cudawrap.paths import Layout
from .procs import REPO, cli_code, write_program


def install(layout: Layout) -> None:
    """Lay out an install root with a working shim, and the waiter (a compiler was found)."""
    import shutil

    from cudawrap.install.installation import prepare
    from .installed import built_waiter

    prepare(layout)
    shutil.copy2(built_waiter(), layout.waiter)


def make_program(directory: Path, name: str, text: Optional[str] = None, mode: int = 0o755) -> Path:
    """DIRECTORY/NAME running TEXT; by default a script that echoes its name and arguments."""
    directory.mkdir(parents=True, exist_ok=True)
    return write_program(directory / name, f'#!/bin/sh\necho "{name} $*"\n' if text is None else text, mode)


Snapshot = Dict[str, Tuple]


def snapshot(*roots: Path, skip: Sequence[Path] = ()) -> Snapshot:
    """Every name under ROOTS: type, mode, owner, inode, and sha256 or link target."""
    out: Snapshot = {}
    skipped = {os.fspath(p) for p in skip}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if os.path.join(dirpath, d) not in skipped]
            for name in [""] + sorted(dirnames + filenames):
                path = os.path.join(dirpath, name) if name else dirpath
                if path in skipped:
                    continue
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode):
                    what = ("link", os.readlink(path))
                elif stat.S_ISREG(st.st_mode):
                    what = ("file", hashlib.sha256(Path(path).read_bytes()).hexdigest(), st.st_ino)
                else:  # a directory, FIFO, socket or device: its type is what matters
                    what = ("other", stat.S_IFMT(st.st_mode))
                out[path] = what + (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
    return out


def diff(before: Snapshot, after: Snapshot) -> List[str]:
    """Human-readable differences, for assertion messages."""
    lines = []
    for path in sorted(set(before) | set(after)):
        if before.get(path) != after.get(path):
            lines.append(f"{path}: {before.get(path)} -> {after.get(path)}")
    return lines


class Admin:
    """An install root plus a directory of programs, and ways to run the CLI on them.

    The CLI runs in the test's environment less anything that points cudawrap, dpkg, sudo or
    the simulated machine elsewhere (a test adds what it needs per run or in ``env_extra``),
    writing no bytecode, so every run makes the same system calls (the strace tests)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.layout = Layout(tmp / "root")
        self.bindir = tmp / "app" / "bin"
        self.bindir.mkdir(parents=True)
        self.env_extra: Dict[str, str] = {}
        install(self.layout)

    def program(self, name: str = "recon", text: Optional[str] = None, mode: int = 0o755) -> Path:
        return make_program(self.bindir, name, text, mode)

    def environ(self, **extra: str) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CUDAWRAP_", "DPKG_", "SUDO_", "FAKENVML_")) and k != "LD_LIBRARY_PATH"}
        env["CUDAWRAP_ROOT"] = str(self.layout.root)
        env["PYTHONPATH"] = REPO
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env.update(self.env_extra)
        env.update(extra)
        return env

    def argv(self, *args: str, prog: str = "cudawrap") -> List[str]:
        """The command line running PROG (cudawrap or create-cudawrap) with ARGS."""
        return [sys.executable, "-c", cli_code(prog=prog), *args]

    def cli(self, *args: str, prog: str = "cudawrap", **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args, prog=prog), env=self.environ(**extra), capture_output=True,
                              text=True, timeout=120, cwd=self.tmp)

    def create(self, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return self.cli(*args, prog="create-cudawrap", **extra)

    def run(self, program: Path, *args: str) -> subprocess.CompletedProcess:
        """PROGRAM (wrapped or not) with ARGS, in the CLI's environment."""
        return subprocess.run([str(program), *args], env=self.environ(), capture_output=True, text=True,
                              timeout=60, cwd=self.tmp)

    def snapshot(self) -> Snapshot:
        # The launch cache is derived state in tmpfs that any sync rewrites; leave it out.
        return snapshot(self.tmp, skip=[self.layout.runtime_dir / "launch.cache"])


@pytest.fixture
def admin(tmp_path: Path) -> Admin:
    return Admin(tmp_path)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A temporary directory other users can reach (pytest's own is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="cudawrap-test-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False)


def run_as(uid: int, gid: int, argv: Sequence[str], environ: Dict[str, str]) -> Tuple[int, str, str]:
    """Run the CLI in a forked child as UID:GID; returns (exit code, stdout, stderr).

    A fork rather than a new interpreter: the test's Python lives under /root, which other
    users cannot enter, so everything the CLI needs is imported here first.
    """
    import logging

    import filelock  # noqa: F401
    import plumbum.cli  # noqa: F401

    import cudawrap.cli
    import cudawrap.cli.admin
    import cudawrap.admin.doctor
    import cudawrap.base.privilege
    import cudawrap.admin.wrap  # noqa: F401

    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 70
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", closefd=False)
            os.environ.clear()
            os.environ.update(environ)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            logging.getLogger().handlers.clear()
            if argv[0] == "create-cudawrap":
                code = cudawrap.cli._run(cudawrap.cli.admin.CreateCudawrap, "create-cudawrap", list(argv))
            else:
                code = cudawrap.cli._run(cudawrap.cli.Cudawrap, "cudawrap", list(argv))
        except BaseException as exc:
            print(f"child failed: {exc!r}", file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    out.seek(0)
    err.seek(0)
    return os.waitstatus_to_exitcode(status), out.read().decode(), err.read().decode()
