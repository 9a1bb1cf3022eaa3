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

import cudawrap
from cudawrap.paths import Layout

# The checkout that holds the package under test. Subprocesses get it on PYTHONPATH: an
# editable install made before cudawrap/__init__.py existed resolves `cudawrap` as a
# namespace package from any other working directory.
REPO = str(Path(cudawrap.__file__).resolve().parent.parent)

PROGRAM = '#!/bin/sh\necho "{name} $*"\n'


def install(layout: Layout) -> None:
    """Lay out an install root with a working shim."""
    from cudawrap.install.installation import prepare

    prepare(layout)


def make_program(directory: Path, name: str, text: Optional[str] = None, mode: int = 0o755) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(PROGRAM.format(name=name) if text is None else text)
    path.chmod(mode)
    return path


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
    """An install root plus a directory of programs, and ways to run the CLI on them."""

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
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDAWRAP_", "DPKG_", "SUDO_"))}
        env["CUDAWRAP_ROOT"] = str(self.layout.root)
        env["PYTHONPATH"] = REPO
        env.update(self.env_extra)
        env.update(extra)
        return env

    def cli(self, *args: str, prog: str = "cudawrap", **extra: str) -> subprocess.CompletedProcess:
        entry = "create_main" if prog == "create-cudawrap" else "main"
        code = f"import sys; sys.argv[0] = {prog!r}; from cudawrap.cli import {entry}; {entry}()"
        return subprocess.run([sys.executable, "-c", code, *args], env=self.environ(**extra),
                              capture_output=True, text=True, timeout=120, cwd=self.tmp)

    def create(self, *args: str, **extra: str) -> subprocess.CompletedProcess:
        return self.cli(*args, prog="create-cudawrap", **extra)

    def snapshot(self) -> Snapshot:
        # The launch cache is derived state in tmpfs that any sync rewrites; leave it out.
        return snapshot(self.tmp, skip=[self.layout.runtime_dir / "launch.cache"])


def strace_cli(admin: Admin, syscall: str, when: int, *args: str, fault: str = "signal=KILL",
               prog: str = "create-cudawrap") -> subprocess.CompletedProcess:
    """Run the CLI with FAULT injected at the WHEN-th call of SYSCALL (one fault per run)."""
    entry = "create_main" if prog == "create-cudawrap" else "main"
    code = f"import sys; sys.argv[0] = {prog!r}; from cudawrap.cli import {entry}; {entry}()"
    argv = ["strace", "-f", "-o", "/dev/null", "-e", "trace=link,linkat,symlink,rename,unlink",
            "-e", f"inject={syscall}:{fault}:when={when}", sys.executable, "-c", code, *args]
    return subprocess.run(argv, env=admin.environ(), capture_output=True, text=True, timeout=120)


def one_line(result: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused command (asserting that there is exactly one)."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {result.stderr!r}"
    return lines[0]


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


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to act as other users)")


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
