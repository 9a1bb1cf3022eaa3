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
    try:  # os.read, not open(): the service reads it at every grant
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, 4096).rsplit(b")", 1)[1].split()
        finally:
            os.close(fd)
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


def parent(pid: int) -> Optional[int]:
    """PID's parent pid; None when there is no such process or it cannot be read."""
    fields = _stat(pid)
    return int(fields[1]) if fields and len(fields) > 1 and fields[1].isdigit() else None


# include/linux/sched.h: set when the process has begun to exit (its files close next).
PF_EXITING = 0x4


def exiting(pid: int) -> bool:
    """Whether PID is gone, a zombie, or on its way out (PF_EXITING): its descriptors, and
    the locks on them, are closed or about to be."""
    fields = _stat(pid)
    if fields is None or (fields and fields[0] in (b"Z", b"X", b"x")):
        return True
    return len(fields) > 6 and fields[6].isdigit() and bool(int(fields[6]) & PF_EXITING)


def real_uid(pid: int) -> Optional[int]:
    """The real uid of PID (the "Uid:" line of /proc/PID/status), None if there is no such
    process or it cannot be read.

    The one way cudawrap tells whose a process is. Not the owner of /proc/PID: that is the
    effective uid, or root for a process that is not dumpable, so a user's lease kept by a
    setuid program they exec'd (su waiting for a password) would count as root's.
    """
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return GONE
    try:
        text = os.read(fd, 4096)  # the Uid: line comes within the first ~300 bytes
    except OSError:
        return GONE
    finally:
        os.close(fd)
    start = text.find(b"\nUid:")
    if start < 0:
        return GONE
    fields = text[start + 5:text.find(b"\n", start + 1)].split()
    return int(fields[0]) if fields and fields[0].isdigit() else GONE


def closing(pid: int) -> bool:
    """Whether PID lives and has begun to exit (PF_EXITING, not yet a zombie): its files are
    being closed now. A zombie's files are closed: locks still held there are someone else's
    (a child that inherited them), as are those of a pid that is gone."""
    fields = _stat(pid)
    if not fields or fields[0] in (b"Z", b"X", b"x"):
        return False
    return len(fields) > 6 and fields[6].isdigit() and bool(int(fields[6]) & PF_EXITING)


def start_time(pid: int) -> Optional[int]:
    """When PID started, in clock ticks since boot (proc(5) field 22): with the pid, it names
    one process for good, as a pid alone is reused. None when there is no such process or
    its stat cannot be read."""
    fields = _stat(pid)
    if not fields or len(fields) < 20 or not fields[19].isdigit():
        return None
    return int(fields[19])


def executable(pid: int) -> str:
    """The file PID runs (the kernel's own path, resolved); "" when it cannot be read."""
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return ""


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


def busy_ns(pid: int) -> Optional[int]:
    """Nanoseconds PID has spent on a CPU or runnable and waiting for one (the first two
    fields of /proc/PID/schedstat): what it did not spend asleep. None where unreadable
    (no such process, a kernel without schedstat)."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            fields = f.read().split()
        return int(fields[0]) + int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
