"""What the kernel says of a process, read from /proc without a library."""
from __future__ import annotations

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import List, Optional, Tuple

GONE = None


def _stat(pid: int) -> Optional[List[bytes]]:
    """The fields of /proc/PID/stat after the command name (which may hold ")" and spaces:
    they start after the last ")"), from the state on; None when there is no such process,
    [] when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return GONE
    except (OSError, IndexError):
        return []


def state(pid: int) -> Optional[bytes]:
    """PID's state letter (b"R", b"S", b"T", b"Z", ...); None when there is no such process,
    b"?" when it cannot be read."""
    fields = _stat(pid)
    if fields is None:
        return GONE
    return fields[0] if fields else b"?"


# include/linux/sched.h: set when the process has begun to exit (its files close next).
PF_EXITING = 0x4


def exiting(pid: int) -> bool:
    """Whether PID is gone, a zombie, or on its way out (PF_EXITING): its descriptors, and
    the locks on them, are closed or about to be."""
    fields = _stat(pid)
    if fields is None or (fields and fields[0] in (b"Z", b"X", b"x")):
        return True
    return len(fields) > 6 and fields[6].isdigit() and bool(int(fields[6]) & PF_EXITING)


def start_time(pid: int) -> Optional[int]:
    """When PID started, in clock ticks since boot (proc(5) field 22): with the pid, it names
    one process for good, as a pid alone is reused. None when there is no such process or
    its stat cannot be read."""
    fields = _stat(pid)
    if not fields or len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


def started_as(pid: int, started: int) -> bool:
    """Whether PID is still the live process that started at STARTED (start_time): False once
    it has exited (gone, a zombie) or its pid names another process. Where its /proc entry
    cannot be read (hidden from us: hidepid), only the kernel's answer to signal 0 says it
    is gone; another user's process answers EPERM, and counts as the one that started."""
    fields = _stat(pid)
    if fields:
        if fields[0] in (b"Z", b"X", b"x"):
            return False
        return len(fields) < 20 or not fields[19].isdigit() or int(fields[19]) == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # EPERM: it lives, someone else's
    return True


def namespace() -> Optional[Tuple[int, int]]:
    """This process's pid namespace (device, inode of /proc/self/ns/pid); None where unreadable.
    Pids name the same processes only between processes of one namespace."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
