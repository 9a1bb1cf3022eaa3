"""Real unprivileged users against each other, for the multi-user tests (run as root).

Two throwaway accounts (``cwtest1``, ``cwtest2``, no home, no shell) are created for the
session and removed at its end. Everything they must reach lives under a world-traversable
base directory in /tmp (pytest's own tmp_path is private to root): the install root, the
wrapped programs, the simulated machine's library, topology and state. Commands run as a
user through ``setpriv`` with a clean environment, so nothing of root's leaks in.

The test interpreter may live where users cannot enter (/root/.pyenv); the shim and the
CLI then run on the system's python3, with the checkout and the directory holding pynvml,
plumbum and filelock on sys.path. Without such an interpreter the tests skip.
"""
from __future__ import annotations

import fcntl
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import pytest

import cudawrap
from cudawrap.install.installation import prepare
from cudawrap.paths import Layout
from .admin import Snapshot, diff, snapshot  # noqa: F401 - one tree snapshot for all tests
from .machine import FAKECUDA, FakeMachine, build_fakenvml, preload, shutdown_nvml

USER_NAMES = ("cwtest1", "cwtest2", "cwtest3")
GECOS = "cudawrap test user (removed by the test suite)"
# Sessions running side by side share the accounts: each holds this lock shared while it
# runs, and the last one out (the one that can take it exclusively) removes them.
USERS_LOCK = "/tmp/.cudawrap-test-users.lock"

REPO = str(Path(cudawrap.__file__).resolve().parent.parent)

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (creates users and acts as them)")

CLI_CODE = ("import sys; sys.path[:0] = {path!r}; sys.argv[0] = {prog!r}; "
            "from cudawrap.cli import {entry}; {entry}()")


def import_path() -> List[str]:
    """Directories that make cudawrap, pynvml, plumbum and filelock importable."""
    import filelock
    import plumbum
    import pynvml

    dirs = [REPO]
    for module in (pynvml, plumbum, filelock):
        path = Path(module.__file__).resolve()
        where = str(path.parent if path.name != "__init__.py" else path.parent.parent)
        if where not in dirs:
            dirs.append(where)
    return dirs


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int

    def argv(self, argv: Sequence[str]) -> List[str]:
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--", *argv]


def _ensure_users() -> Dict[str, User]:
    users = {}
    for name in USER_NAMES:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "-M", "-U", "-d", "/nonexistent", "-s", "/usr/sbin/nologin",
                            "-c", GECOS, name], check=True, capture_output=True)
            pw = pwd.getpwnam(name)
        users[name] = User(name, pw.pw_uid, pw.pw_gid)
    return users


def _remove_users() -> None:
    for name in USER_NAMES:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        if pw.pw_gecos == GECOS:  # only accounts this suite made
            subprocess.run(["userdel", name], check=False, capture_output=True)


class MuMachine(FakeMachine):
    """A simulated machine whose files every user can read."""

    def write(self, text: str) -> None:
        super().write(text)
        self.topology.chmod(0o644)  # mkstemp makes it 0600


@dataclass
class World:
    """What one session sets up once: the users, the base directory, the library, python."""

    users: Dict[str, User]
    base: Path
    lib_dir: Path
    python: str
    path: List[str]

    @property
    def alice(self) -> User:
        return self.users[USER_NAMES[0]]

    @property
    def bob(self) -> User:
        return self.users[USER_NAMES[1]]

    @property
    def carol(self) -> User:
        return self.users[USER_NAMES[2]]


def _reachable(path: str) -> bool:
    """Whether every directory on the way to PATH (and to its symlink targets) is searchable by all."""
    real = Path(os.path.realpath(path))
    for directory in [*Path(path).parents, *real.parents]:
        try:
            if not os.stat(directory).st_mode & 0o001:
                return False
        except OSError:
            return False
    return os.access(real, os.X_OK) and bool(os.stat(real).st_mode & 0o001)


def _find_python(user: User, path: List[str], cwd: Path) -> Optional[str]:
    """An interpreter USER can run that imports what the shim and the CLI need."""
    code = (f"import sys; sys.path[:0] = {path!r}; import cudawrap.cli, cudawrap.launch, "
            "cudawrap.policy.config, pynvml, plumbum.cli, filelock; cudawrap.policy.config._load_toml('')")
    for candidate in (sys.executable, os.path.realpath(sys.executable), shutil.which("python3") or "",
                      "/usr/bin/python3"):
        if not candidate or not os.path.isabs(candidate) or not _reachable(candidate):
            continue
        done = subprocess.run(user.argv([candidate, "-I", "-c", code]), capture_output=True,
                              cwd=cwd, env={"PATH": "/usr/bin:/bin"})
        if done.returncode == 0:
            return candidate
    return None


@pytest.fixture(scope="session")
def mu_world() -> Iterator[World]:
    if os.geteuid() != 0:
        pytest.skip("needs root (creates users and acts as them)")
    for tool in ("useradd", "userdel", "setpriv", "cc"):
        if shutil.which(tool) is None:
            pytest.skip(f"needs {tool}")
    lock = os.open(USERS_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    base = Path(tempfile.mkdtemp(prefix="cudawrap-mu-", dir="/tmp"))
    try:
        users = _ensure_users()
        fcntl.flock(lock, fcntl.LOCK_SH)  # converted: other sessions may use them now
        base.chmod(0o755)
        lib_dir = build_fakenvml(base / "fakenvml")
        lib_dir.chmod(0o755)
        path = import_path()
        python = _find_python(users[USER_NAMES[0]], path, base)
        if python is None:
            pytest.skip("no Python interpreter that an unprivileged user can run with cudawrap importable")
        yield World(users, base, lib_dir, python, path)
    finally:
        shutil.rmtree(base, ignore_errors=True)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # another session still uses the accounts: it removes them
        else:
            _remove_users()
        os.close(lock)


class MuInstall:
    """cudawrap installed under a world-reachable root on a simulated machine, run by root."""

    def __init__(self, world: World, directory: Path, topology: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.world = world
        self.dir = directory
        self.machine = MuMachine(directory / "machine", world.lib_dir).without_costs()
        self.machine.root.chmod(0o755)
        self.machine.state_dir.chmod(0o755)
        self.machine.load(topology)
        self.layout = Layout(directory / "root")
        prepare(self.layout, world.python)
        self.bindir = directory / "bin"
        self.bindir.mkdir(mode=0o755)
        self.log = directory / "jobs.log"
        self.log.touch()
        self.log.chmod(0o666)
        self.procs: List[subprocess.Popen] = []
        for key, value in self.machine.environ().items():
            if key in self.machine.env:
                monkeypatch.setenv(key, value)
        preload(world.lib_dir)
        self.sync()

    # --- setting up, as root ---------------------------------------------------------
    def sync(self) -> None:
        from cudawrap.ops.sync import sync

        sync(self.layout)

    def wrap(self, name: str = "recon", program: Path = FAKECUDA) -> Path:
        """Wrap by hand, as corefix does: a renamed copy run by the users' python, and the link."""
        real = self.bindir / f"CUDAWRAP_{name}"
        text = program.read_bytes()
        if text.startswith(b"#!/usr/bin/env python3\n"):
            text = f"#!{self.world.python} -IS\n".encode() + text.split(b"\n", 1)[1]
        real.write_bytes(text)
        real.chmod(0o755)
        link = self.bindir / name
        link.symlink_to(self.layout.shim)
        return link

    def allow(self, *uuids: str) -> None:
        self.layout.config_file.write_text("[devices]\nallow = [%s]\n" % ", ".join(f'"{u}"' for u in uuids))
        self.layout.config_file.chmod(0o644)

    # --- running things ----------------------------------------------------------------
    def environ(self, **extra: Optional[str]) -> Dict[str, str]:
        env = {"PATH": f"{self.bindir}:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent",
               "CUDAWRAP_ROOT": str(self.layout.root)}
        env.update(self.machine.env)
        for key, value in extra.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def _argv(self, user: Optional[User], argv: Sequence[str]) -> List[str]:
        return user.argv(argv) if user is not None else list(argv)

    def run(self, user: Optional[User], *argv: str, timeout: float = 60, input: Optional[bytes] = None,
            **extra: Optional[str]) -> subprocess.CompletedProcess:
        return subprocess.run(self._argv(user, argv), env=self.environ(**extra), capture_output=True,
                              timeout=timeout, cwd=self.dir, input=input)

    def start(self, user: Optional[User], *argv: str, **extra: Optional[str]) -> subprocess.Popen:
        proc = subprocess.Popen(self._argv(user, argv), env=self.environ(**extra), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=self.dir)
        self.procs.append(proc)
        return proc

    def cli(self, user: Optional[User], *args: str, prog: str = "cudawrap",
            **extra: Optional[str]) -> subprocess.CompletedProcess:
        entry = "create_main" if prog == "create-cudawrap" else "main"
        code = CLI_CODE.format(path=self.world.path, prog=prog, entry=entry)
        return self.run(user, self.world.python, "-I", "-c", code, *args, **extra)

    def py(self, user: Optional[User], code: str, *args: str, **extra: Optional[str]) -> subprocess.CompletedProcess:
        """Run CODE (a Python snippet) as USER; sys.argv[1:] are ARGS."""
        return self.run(user, self.world.python, "-I", "-c", code, *args, **extra)

    def py_json(self, user: Optional[User], code: str, *args: str) -> dict:
        done = self.py(user, code, *args)
        assert done.returncode == 0, done.stderr.decode()
        return json.loads(done.stdout)

    def py_start(self, user: Optional[User], code: str, *args: str) -> subprocess.Popen:
        return self.start(user, self.world.python, "-I", "-c", code, *args)

    def snapshot(self) -> Snapshot:
        return snapshot(self.layout.root, self.bindir)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


@pytest.fixture
def mu(mu_world: World, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., MuInstall]]:
    """Factory: ``mu("a100-mig7")`` is cudawrap installed where the test users can use it."""
    made: List[MuInstall] = []

    def make(topology: str = "four-gpus") -> MuInstall:
        directory = Path(tempfile.mkdtemp(prefix="inst-", dir=mu_world.base))
        directory.chmod(0o755)
        inst = MuInstall(mu_world, directory, topology, monkeypatch)
        made.append(inst)
        return inst

    yield make
    for inst in made:
        inst.close()
        shutil.rmtree(inst.dir, ignore_errors=True)
    shutdown_nvml()


# --- faults injected from outside, one system call at a time (strace) -------------------------

STRACE = shutil.which("strace")
needs_strace = pytest.mark.skipif(STRACE is None, reason="needs strace")

# The system calls through which a command changes (or reads) files. "?" in the trace
# expression lets strace skip the ones an architecture lacks (aarch64 has no rename(2)).
FS_CALLS = ("open", "openat", "creat", "write", "pwrite64", "fsync", "fdatasync", "rename", "renameat",
            "renameat2", "link", "linkat", "symlink", "symlinkat", "unlink", "unlinkat", "mkdir",
            "mkdirat", "rmdir", "fchmod", "fchmodat", "chmod", "ftruncate", "truncate")

_SYSCALL_LINE = re.compile(r"^([a-z0-9_]+)\(")


@dataclass(frozen=True)
class Call:
    """One system call of a traced run: the NTH call of SYSCALL (strace's ``when=``)."""

    syscall: str
    nth: int
    text: str  # as strace -y printed it

    def touches(self, *paths: object) -> bool:
        """Whether the call names (or works on a descriptor of) something under PATHS."""
        text = re.sub(r"AT_FDCWD<[^>]*>", "AT_FDCWD", self.text)
        return any(str(p) in text for p in paths)

    def is_read(self) -> bool:
        """An open for reading only: it changes nothing on disk."""
        return self.syscall in ("open", "openat") and "O_RDONLY" in self.text and "O_CREAT" not in self.text

    def args(self) -> str:
        """The call without its result, numbers blurred (pids and fds differ between runs)."""
        return re.sub(r"\d+", "N", self.text.rsplit(" = ", 1)[0])


def _strace(log: str, calls: Sequence[str], inject: Optional[str] = None) -> List[str]:
    assert STRACE is not None
    argv = [STRACE, "-qq", "-y", "-o", log, "-e", "trace=" + ",".join("?" + c for c in calls)]
    if inject is not None:
        argv += ["-e", f"inject={inject}"]
    return argv


def _calls(log: str) -> List[Call]:
    counts: Dict[str, int] = {}
    out = []
    for line in Path(log).read_text(encoding="utf-8", errors="replace").splitlines():
        match = _SYSCALL_LINE.match(line)
        if match:
            name = match.group(1)
            counts[name] = counts.get(name, 0) + 1
            out.append(Call(name, counts[name], line))
    return out


def traced(argv: Sequence[str], env: Dict[str, str], cwd: Path, calls: Sequence[str] = FS_CALLS,
           timeout: float = 120) -> "tuple[subprocess.CompletedProcess, List[Call]]":
    """Run ARGV (only the process itself is traced, not its children) and list its CALLS."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log")
        done = subprocess.run(_strace(log, calls) + list(argv), env=env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)
        return done, _calls(log)


def inject(argv: Sequence[str], call: Call, action: str, env: Dict[str, str], cwd: Path,
           timeout: float = 120) -> "tuple[subprocess.CompletedProcess, Optional[Call]]":
    """Run ARGV with ACTION (``signal=KILL``, ``error=ENOSPC``) injected at CALL.

    Returns the result and the call strace saw it hit, for the caller to check it is CALL.
    """
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log")
        spec = f"{call.syscall}:{action}:when={call.nth}"
        done = subprocess.run(_strace(log, [call.syscall], spec) + list(argv), env=env, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)
        seen = [c for c in _calls(log) if c.nth == call.nth]
        return done, (seen[0] if seen else None)


class AdminRoot:
    """An install root in a (private) temporary directory and programs to wrap, for root."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.layout = Layout(tmp / "root")
        prepare(self.layout)
        self.bindir = tmp / "app" / "bin"
        self.bindir.mkdir(parents=True)

    def program(self, name: str = "recon") -> Path:
        path = self.bindir / name
        path.write_text(f'#!/bin/sh\necho "{name} $*"\n')
        path.chmod(0o755)
        return path

    def environ(self) -> Dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CUDAWRAP_", "DPKG_", "SUDO_", "FAKENVML_")) and k != "LD_LIBRARY_PATH"}
        env["CUDAWRAP_ROOT"] = str(self.layout.root)
        env["PYTHONPATH"] = REPO
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # the same system calls on every run
        return env

    def argv(self, *args: str, prog: str = "cudawrap") -> List[str]:
        entry = "create_main" if prog == "create-cudawrap" else "main"
        return [sys.executable, "-c", CLI_CODE.format(path=[REPO], prog=prog, entry=entry), *args]

    def cli(self, *args: str, prog: str = "cudawrap") -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args, prog=prog), env=self.environ(), capture_output=True, text=True,
                              timeout=120, cwd=self.tmp)

    def run(self, program: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(program), *args], env=self.environ(), capture_output=True, text=True,
                              timeout=60, cwd=self.tmp)


@pytest.fixture
def admin_root(tmp_path: Path) -> AdminRoot:
    return AdminRoot(tmp_path)
