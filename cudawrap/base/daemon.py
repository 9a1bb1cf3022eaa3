"""Running a command in the background without systemd: `cudawrap monitor --daemon`, `serve --daemon`.

The pid file is held with ``flock`` for as long as the daemon lives, so "is it running"
is the kernel's answer, as for leases: a pid file left by a killed daemon is never
mistaken for a live one (and its pid, perhaps reused, is never signalled by us: stop pins
the process with a pidfd and checks it is the daemon before signalling). A daemon that
ends removes its pid file (release), so `kill $(cat FILE)` finds no stale pid there.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
from typing import Callable, Optional


class AlreadyRunning(Exception):
    def __init__(self, pid: Optional[int]) -> None:
        super().__init__(pid)
        self.pid = pid


def _pid_in(fd: int) -> Optional[int]:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        return int(os.read(fd, 32).decode().strip() or "x")
    except ValueError:
        return None


def running(pid_file: str) -> Optional[int]:
    """The pid of the live daemon holding PID_FILE, or None if none holds it.

    A shared lock attempt fails exactly while the daemon holds its exclusive one. The
    file is root's alone (see detach): for anyone else the answer is None.
    """
    try:
        fd = os.open(pid_file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _pid_in(fd) or -1
        return None
    finally:
        os.close(fd)


def _take(lock_file: str, on_busy: Optional[Callable[[Optional[int]], None]] = None) -> int:
    """LOCK_FILE opened and locked exclusively; the descriptor. Held by another: AlreadyRunning
    with its pid, or, given ON_BUSY, that pid told to it and the lock waited for.

    Root's alone (0600): whoever can open it can flock it, and a user's lock would keep the
    daemon or loop it guards from starting ("already running")."""
    while True:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _pid_in(fd)
            if on_busy is None:
                os.close(fd)
                raise AlreadyRunning(pid) from None
            on_busy(pid)
            fcntl.flock(fd, fcntl.LOCK_EX)  # the kernel hands it over when the other one ends
        if _is_at(fd, lock_file):
            return fd
        os.close(fd)  # locked after its daemon removed it (release): the name is a new file now


def _is_at(fd: int, path: str) -> bool:
    """Whether PATH names the file open at FD."""
    try:
        st, here = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (here.st_dev, here.st_ino)


def release(pid_file: str, fd: int) -> None:
    """The daemon's end: remove PID_FILE, whose lock FD holds, then let go of it. Removed
    while locked, so no other daemon has taken it meanwhile (_take checks the name still
    leads to the file it locked)."""
    try:
        if _is_at(fd, pid_file):
            os.unlink(pid_file)
    except OSError:
        pass
    os.close(fd)


def _write_pid(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def hold(lock_file: str) -> int:
    """Hold LOCK_FILE, with this process's pid in it, for the rest of its life; the descriptor,
    to keep open. AlreadyRunning (with the holder's pid) if another holds it."""
    fd = _take(lock_file)
    _write_pid(fd)
    return fd


def one_at_a_time(lock_file: str, on_busy: Callable[[Optional[int]], None]) -> int:
    """hold(), waiting for LOCK_FILE if another holds it (ON_BUSY is told that one's pid first)."""
    fd = _take(lock_file, on_busy)
    _write_pid(fd)
    return fd


def stop(pid_file: str, wait_s: float = 10.0) -> Optional[int]:
    """End the live daemon holding PID_FILE and wait until it has; its pid, or None if none ran.

    The pid is signalled only while the pid file's lock is held and the process is the one
    that wrote it (_signal_daemon), never a reused pid. A daemon still alive after WAIT_S
    seconds raises TimeoutError; one whose pid cannot be read (-1 from running) raises
    ProcessLookupError, a pid that is not the daemon's PermissionError.
    """
    import time

    pid = running(pid_file)
    if pid is None:
        return None
    if pid < 0:
        raise ProcessLookupError(f"{pid_file} is locked but holds no pid")
    pidfd = -1
    try:
        try:
            pidfd = _pin(pid)
            _signal_daemon(pid_file, pid, pidfd, signal.SIGTERM)
        except ProcessLookupError:
            return pid  # gone between the look and the signal
        deadline = time.monotonic() + wait_s
        # The kernel drops the lock when the process ends, and the daemon removes its pid
        # file just before (release): the process itself is waited for through its pidfd.
        while running(pid_file) is not None or not _ended(pid, pidfd):
            if time.monotonic() > deadline:
                raise TimeoutError(f"pid {pid} did not exit within {wait_s:g} s of SIGTERM")
            time.sleep(0.02)
        return pid
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _pin(pid: int) -> int:
    """A pidfd of PID (-1 where the kernel or Python has none); ProcessLookupError if gone."""
    try:
        return os.pidfd_open(pid)  # type: ignore[attr-defined,no-any-return]
    except AttributeError:
        return -1
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise ProcessLookupError(f"pid {pid} is gone") from None
        return -1


def _ended(pid: int, pidfd: int) -> bool:
    """Whether the process PID (pinned by PIDFD where there is one) has exited."""
    if pidfd >= 0:
        import select

        return bool(select.select([pidfd], [], [], 0)[0])  # readable once it exits
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False


def _signal_daemon(pid_file: str, pid: int, pidfd: int, signum: int) -> None:
    """Send SIGNUM to PID, the pid PID_FILE names, pinned by PIDFD (-1: none), only if it is
    still that file's daemon.

    The process is pinned first (a pid reused after that cannot be reached through the
    pidfd), then checked: the pid file still locked and naming it, and it started no later
    than the pid file was written (the daemon writes its pid once it runs; a process that
    got the pid once the daemon had ended started later). Without a pidfd (Linux < 5.3) the
    same checks come just before a kill. ProcessLookupError: the daemon is gone;
    PermissionError: the pid is not the daemon's."""
    now = running(pid_file)
    try:
        written = os.stat(pid_file).st_mtime
    except FileNotFoundError:
        now = None  # removed at the daemon's end (release)
    if now is None:
        raise ProcessLookupError(f"pid {pid} is gone")  # it let go of the file meanwhile
    if now != pid or not _started_by(pid, written):
        raise PermissionError(errno.EPERM, f"pid {pid} is not the daemon of {pid_file} (a pid reused since, "
                                           "or a file not written by the daemon): nothing signalled")
    if pidfd >= 0:
        signal.pidfd_send_signal(pidfd, signum)  # type: ignore[attr-defined]
    else:
        os.kill(pid, signum)


def _started_by(pid: int, when: float) -> bool:
    """Whether process PID started no later than WHEN (seconds since the epoch)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    # btime is whole seconds, rounded down: the start computed is never later than the real one.
    return boot + ticks / os.sysconf("SC_CLK_TCK") <= when


def detach(pid_file: str, log_file: str, name: str = "monitor", stop_with: str = "") -> int:
    """Fork into the background; returns in the daemon only (the caller's process exits 0).

    The pid file is locked before forking, so a second start fails at once with
    AlreadyRunning in the caller's own terminal. The daemon's stdout and stderr, and so
    its log lines, go to LOG_FILE (appended).
    """
    fd = _take(pid_file)
    read_end, write_end = os.pipe()
    if os.fork() > 0:  # the caller: report the daemon's pid, then leave
        os.close(write_end)
        os.close(fd)
        with os.fdopen(read_end, "rb") as pipe:
            pid = int(pipe.read().decode() or "0")
        stop = f"; stop it with {stop_with}" if stop_with else ""
        print(f"cudawrap {name}: running in the background as pid {pid}; log {log_file}; "
              f"pid file {pid_file}{stop}", flush=True)  # flushed: os._exit would drop it in a pipe
        os._exit(0 if pid else 1)
    os.close(read_end)
    os.setsid()  # no controlling terminal: a closed terminal's SIGHUP does not reach us
    if os.fork() > 0:
        os._exit(0)
    # The lock came with fd through both forks; it lives as long as this process does.
    _write_pid(fd)
    os.chdir("/")
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    logging.getLogger().handlers[:] = [logging.StreamHandler()]  # the new stderr, timestamped
    logging.getLogger().handlers[0].setFormatter(logging.Formatter(f"%(asctime)s cudawrap {name}: %(message)s"))
    os.write(write_end, str(os.getpid()).encode())
    os.close(write_end)
    return fd
