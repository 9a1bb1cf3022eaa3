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
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import pytest

from .admin import Snapshot, snapshot
from .installed import Installed, lay_out
from .machine import FakeMachine, build_fakenvml, shutdown_nvml
from .procs import REPO

USER_NAMES = ("cwtest1", "cwtest2", "cwtest3")
GECOS = "cudawrap test user (removed by the test suite)"
# Sessions running side by side share the accounts: each holds this lock shared while it
# runs, and the last one out (the one that can take it exclusively) removes them.
USERS_LOCK = "/tmp/.cudawrap-test-users.lock"

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


def _existing_users() -> Optional[Dict[str, User]]:
    try:
        return {name: User(name, pw.pw_uid, pw.pw_gid) for name in USER_NAMES for pw in [pwd.getpwnam(name)]}
    except KeyError:
        return None


def _take_users(lock: int) -> Dict[str, User]:
    """The accounts, with LOCK held shared for as long as this session uses them.

    Shared at once where they exist: a session that waited for the exclusive lock first
    waited for every other session to end, so the two workers of `make test` (-n 2) ran one
    after the other from the moment both needed the accounts. Made under the exclusive lock,
    taken without waiting: a session holding it shared has them already."""
    while True:
        fcntl.flock(lock, fcntl.LOCK_SH)
        users = _existing_users()
        if users is not None:
            return users
        fcntl.flock(lock, fcntl.LOCK_UN)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            time.sleep(0.05)  # another session is making them, or removing them
            continue
        users = _ensure_users()
        fcntl.flock(lock, fcntl.LOCK_SH)  # converted: other sessions may use them now
        return users


def _remove_users() -> None:
    for name in USER_NAMES:
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        if pw.pw_gecos == GECOS:  # only accounts this suite made
            subprocess.run(["userdel", name], check=False, capture_output=True)


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
    base = Path(tempfile.mkdtemp(prefix="cudawrap-mu-", dir="/tmp"))
    try:
        users = _take_users(lock)
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


class MuInstall(Installed):
    """cudawrap installed under a world-reachable root on a simulated machine, for the users.

    The same install as ``Installed``, with each way to run taking the user first (None:
    root) and a clean environment, so nothing of root's leaks into a user's run."""

    python_flags = ("-I",)

    def __init__(self, world: World, directory: Path, topology: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.world = world
        self.dir = directory
        machine = FakeMachine(directory / "machine", world.lib_dir).without_costs()
        machine.root.chmod(0o755)
        machine.state_dir.chmod(0o755)
        machine.load(topology)
        layout, bindir = lay_out(directory, world.python)
        super().__init__(layout, machine, bindir, world.python, world.path, cwd=directory)
        self.log.touch()
        self.log.chmod(0o666)
        machine.activate(monkeypatch)
        self.sync()

    def environ(self, **extra: Optional[str]) -> Dict[str, str]:
        """A clean environment: the programs and the system's PATH, this machine's variables and
        the root, EXTRA (None removes a key; a PATH replaces the whole)."""
        base = {"PATH": f"{self.bindir}:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}
        return self.machine.environ(base, CUDAWRAP_ROOT=str(self.layout.root), **extra)

    def run(self, user: Optional[User], *argv: str, timeout: float = 60,  # type: ignore[override]
            input: Optional[bytes] = None, **extra: Optional[str]) -> subprocess.CompletedProcess:
        return self._run(user, argv, timeout, input, **extra)

    def start(self, user: Optional[User], *argv: str,  # type: ignore[override]
              **extra: Optional[str]) -> subprocess.Popen:
        return self._start(user, argv, **extra)

    def cli(self, user: Optional[User], *args: str, prog: str = "cudawrap",  # type: ignore[override]
            **extra: Optional[str]) -> subprocess.CompletedProcess:
        return self._run(user, self._cli_argv(args, prog), **extra)

    def py(self, user: Optional[User], code: str, *args: str, **extra: Optional[str]) -> subprocess.CompletedProcess:
        """Run CODE (a Python snippet) as USER; sys.argv[1:] are ARGS."""
        return self._run(user, self._py_argv(code, args), **extra)

    def py_json(self, user: Optional[User], code: str, *args: str) -> dict:
        done = self.py(user, code, *args)
        assert done.returncode == 0, done.stderr.decode()
        return json.loads(done.stdout)

    def py_start(self, user: Optional[User], code: str, *args: str) -> subprocess.Popen:
        return self._start(user, self._py_argv(code, args))

    def status(self, user: Optional[User]) -> dict:
        """``cudawrap status --json`` as USER, which must succeed."""
        done = self.cli(user, "status", "--json")
        assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
        return json.loads(done.stdout)

    def snapshot(self) -> Snapshot:
        return snapshot(self.layout.root, self.bindir)


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
