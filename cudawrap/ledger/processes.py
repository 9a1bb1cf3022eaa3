"""Who a process is, as root sees it in /proc: its user, its start (which, with the pid, names
one process), its program by its wrapped name; and this boot, which the ledger's times and ids
are counted in.

Apart from the looks because these are the kernel's facts, read the same way by whoever needs
to name a process: the looks that record leases, the service's bookkeeping of its grants and
its peers, the memory watch's runs.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence


def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def boot_time() -> float:
    """When the machine booted, in seconds since the epoch, to the clock's precision
    (/proc/stat's btime is whole seconds: too coarse for process start times)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


@dataclass
class Proc:
    pid: int
    uid: int
    ticks: int  # start time in clock ticks since boot: with the pid, names one process
    started: float  # seconds since the epoch
    program: str
    exe: str


def proc(pid: int, devices: Sequence[str] = ()) -> Optional[Proc]:
    """PID as /proc shows it, or None if it is gone; its program by its wrapped name where it
    holds one of DEVICES as a wrapped program's run."""
    from ..base.proc import executable, real_uid
    from ..base.procinfo import printable, wrapped_name

    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        if fields[0] in ("Z", "X"):
            return None  # exited, not yet reaped by its parent: gone for our purposes
        ticks = int(fields[19])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode("utf-8", "replace") for a in f.read(8192).split(b"\0") if a]
    except (OSError, IndexError, ValueError):
        return None
    uid = real_uid(pid)
    if uid is None:
        return None
    exe = executable(pid)
    # The wrapped program: a script run through its shebang has the interpreter first, then
    # the real program's path (CUDAWRAP_name); a binary has the name it was invoked by.
    from ..locations import REAL_PREFIX

    names = [os.path.basename(a) for a in argv[:4]]
    program = wrapped_name(pid, devices) or next(
        (n[len(REAL_PREFIX):] for n in names if n.startswith(REAL_PREFIX) and len(n) > len(REAL_PREFIX)),
        names[0] if names else os.path.basename(exe))
    return Proc(pid, uid, ticks, boot_time() + ticks / os.sysconf("SC_CLK_TCK"), printable(program, 200), exe)
