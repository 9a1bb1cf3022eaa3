"""Fixtures for running install.sh: a wheelhouse built once per session, and a runner.

The wheelhouse holds cudawrap's dependencies and setuptools (for building cudawrap
itself from the source directory), so every install.sh in the suite runs with
``--wheelhouse`` and needs the package index only for the first download.
"""
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

import pytest

SOURCE = Path(__file__).resolve().parents[2]
INSTALL_SH = SOURCE / "install.sh"


def dependencies() -> List[str]:
    """cudawrap's requirements from pyproject.toml, plus what building it needs, and the docs
    extra's pinned tools, with which debian/rules builds the documentation site."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - 3.9/3.10
        import tomli as tomllib
    project = tomllib.loads((SOURCE / "pyproject.toml").read_text(encoding="utf-8"))
    deps = [d.split(";")[0].strip() for d in project["project"]["dependencies"]]
    build = project["build-system"]["requires"]
    docs = project["project"]["optional-dependencies"]["docs"]
    return deps + build + docs + ["tomli>=1.1"]  # tomli for a Python before 3.11, whichever runs install.sh


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Optional[Path]:
    """A directory of wheels install.sh can install from offline; None if pip cannot fetch them."""
    out = tmp_path_factory.mktemp("wheelhouse")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "-d", str(out), *dependencies()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    if done.returncode != 0:
        return None  # install.sh then installs from the index, as an admin would
    return out


def install_sh(*args: str, env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None,
               script: Path = INSTALL_SH, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run install.sh with ARGS; text output captured."""
    return subprocess.run(["bash", str(script), *args], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)


# The PATH `sudo` gives on a stock Debian/Ubuntu server (secure_path): python3 there is the
# system's /usr/bin/python3 itself, a case install.sh once failed on (issue 28).
STOCK_SUDO_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def clean_env(base: Optional[Dict[str, str]] = None, **extra: str) -> Dict[str, str]:
    """BASE (default os.environ) without anything that points cudawrap or Python elsewhere."""
    env = dict(os.environ if base is None else base)
    for key in ("CUDAWRAP_ROOT", "CUDAWRAP_WAIT", "CUDAWRAP_VERBOSE", "CUDAWRAP_LEASE", "CUDA_VISIBLE_DEVICES",
                "PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(key, None)
    env.update(extra)
    return env


def source_commit() -> Optional[str]:
    """The checkout's commit as install.sh and `make deb` record it; None outside a git checkout."""
    done = subprocess.run(["git", "-c", f"safe.directory={SOURCE}", "-C", str(SOURCE), "rev-parse", "--short=12",
                           "HEAD"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    return done.stdout.strip() if done.returncode == 0 and (SOURCE / ".git").exists() else None


def process_gone(pid: int) -> bool:
    """Whether PID has exited (a zombie nobody reaped yet counts: it runs no code)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wheel_args(wheelhouse: Optional[Path]) -> List[str]:
    return ["--wheelhouse", str(wheelhouse)] if wheelhouse else []


def snapshot(top: Path) -> Dict[str, str]:
    """Every path under TOP (relative) with its kind and, for files, its bytes' hash."""
    import hashlib

    out: Dict[str, str] = {}
    if not top.exists():
        return out
    for path in sorted(top.rglob("*")):
        rel = str(path.relative_to(top))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[rel] = f"dir:{path.stat().st_mode & 0o7777:o}"
        else:
            out[rel] = f"file:{path.stat().st_mode & 0o7777:o}:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return out
