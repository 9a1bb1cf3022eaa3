"""What /proc says of one process, as `ps` would: its user, command line, start time, and the
program a person knows it by (a wrapped program by its wrapped name, a script by its name
rather than its interpreter's).

Status, the ledger, the estimates and the monitor's watches all name processes this way; it
reads /proc only, so every part of ops may use it.
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Iterable, Optional, Sequence

from ..locations import REAL_PREFIX
from .proc import real_uid
from .users import user_name


def printable(text: str, limit: int = 200) -> str:
    """TEXT cut to LIMIT with control characters replaced: command lines and queue entries are
    written by users, and must not send escape sequences to an admin's terminal."""
    from .text import printable as escape

    return escape(text, limit)


def _boot_time() -> float:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


# Programs that run another named on their command line: the program is that one.
INTERPRETERS = ("python", "perl", "ruby", "node", "bash", "sh", "dash", "zsh", "Rscript", "julia", "env")


def program_name(argv: Sequence[str]) -> str:
    """What a person calls the program of ARGV: the script an interpreter runs (train.py for
    `python3 -u train.py`), under its wrapped name (recon for CUDAWRAP_recon)."""
    args = [a for a in argv if a]
    name = os.path.basename(args[0]) if args else "?"
    base = name.rstrip("0123456789.")
    if base in INTERPRETERS or (base.startswith("python") and base[6:].rstrip("dmu") == ""):
        for arg in args[1:]:
            if not arg.startswith("-") and "=" not in arg:
                name = os.path.basename(arg)
                break
    return name[len(REAL_PREFIX):] if name.startswith(REAL_PREFIX) and len(name) > len(REAL_PREFIX) else name


def wrapped_name(pid: int, uuids: Iterable[str] = ()) -> Optional[str]:
    """The wrapped name PID runs under, from the environment its shim gave it (which survives
    the program's own execs), if that environment also has the lease of one of UUIDS (any
    lease when none is given): a command of `cudawrap run` started from a wrapped program
    keeps that program's variables but has a lease of its own. None when there is none, or
    PID's environment cannot be read (another user's process)."""
    from ..locations import LEASE_ENV, PROGRAM_ENV

    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            block = f.read(1 << 20)
    except OSError:
        return None
    env = dict(item.split(b"=", 1) for item in block.split(b"\0") if b"=" in item)
    name = env.get(PROGRAM_ENV.encode(), b"").decode("utf-8", "replace")
    marker = env.get(LEASE_ENV.encode(), b"").decode("utf-8", "replace")
    leased = {part.split(":")[1] for part in marker.split(",") if part.count(":") >= 1}
    wanted = set(uuids)
    if not name or not leased or (wanted and not wanted & leased):
        return None
    return os.path.basename(name) or None


def process_info(pid: int, uuids: Iterable[str] = ()) -> Dict[str, Any]:
    """User, command line and start time of PID from /proc (what `ps` would say); its program
    by the wrapped name its shim ran it as, when it holds the lease of one of UUIDS."""
    info: Dict[str, Any] = {"pid": pid, "user": "?", "command": "?", "program": "?", "since": "?"}
    try:
        uid = real_uid(pid)
        if uid is None:
            return info
        info["user"] = user_name(uid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(4096).decode("utf-8", "replace").split("\0")
        info["command"] = printable(" ".join(argv).strip(), 4096)
        info["program"] = printable(wrapped_name(pid, uuids) or program_name(argv), 200)
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
        info["since"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started))
    except (OSError, IndexError, ValueError):
        pass
    return info
