"""Faults injected from outside, one system call at a time (strace): a command killed, or
refused a write, at each step in turn must leave everything as it was or as it will be.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest

from .admin import Admin

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


def strace_cli(admin: Admin, syscall: str, when: int, *args: str, fault: str = "signal=KILL",
               prog: str = "create-cudawrap") -> subprocess.CompletedProcess:
    """Run the CLI with FAULT injected at the WHEN-th call of SYSCALL (one fault per run)."""
    argv = ["strace", "-f", "-o", "/dev/null", "-e", "trace=link,linkat,symlink,rename,unlink",
            "-e", f"inject={syscall}:{fault}:when={when}", *admin.argv(*args, prog=prog)]
    return subprocess.run(argv, env=admin.environ(), capture_output=True, text=True, timeout=120)
