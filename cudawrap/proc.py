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


def start_time(pid: int, exited_too: bool = False) -> Optional[int]:
    """When PID started, in clock ticks since boot (proc(5) field 22): with the pid, it names
    one process for good, as a pid alone is reused. None when there is no such process, its
    stat cannot be read, or (unless EXITED_TOO) it has exited and is a zombie."""
    fields = _stat(pid)
    if (not fields or (not exited_too and fields[0] in (b"Z", b"X", b"x"))
            or len(fields) < 20 or not fields[19].isdigit()):
        return None
    return int(fields[19])


def namespace() -> Optional[Tuple[int, int]]:
    """This process's pid namespace (device, inode of /proc/self/ns/pid); None where unreadable.
    Pids name the same processes only between processes of one namespace."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
