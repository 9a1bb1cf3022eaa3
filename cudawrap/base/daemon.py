"""Running a command in the background without systemd: `cudawrap monitor --daemon`.

The pid file is held with ``flock`` for as long as the daemon lives, so "is it running"
is the kernel's answer, as for leases: a pid file left by a killed daemon is never
mistaken for a live one (and its pid, perhaps reused, is never signalled by us).
"""
from __future__ import annotations

import fcntl
import logging
import os
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
    return fd


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

    The pid is signalled only while the pid file's lock is held, so it is the daemon's and
    not a reused one. A daemon still alive after WAIT_S seconds raises TimeoutError; one
    whose pid cannot be read (-1 from running) raises ProcessLookupError.
    """
    import signal
    import time

    pid = running(pid_file)
    if pid is None:
        return None
    if pid < 0:
        raise ProcessLookupError(f"{pid_file} is locked but holds no pid")
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return pid  # gone between the look and the signal
    deadline = time.monotonic() + wait_s
    # The kernel drops the lock when the process ends: that, not the pid, says it is gone.
    while running(pid_file) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} did not exit within {wait_s:g} s of SIGTERM")
        time.sleep(0.02)
    return pid


def detach(pid_file: str, log_file: str, name: str = "monitor") -> int:
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
        print(f"cudawrap {name}: running as pid {pid} (pid file {pid_file}, log {log_file})")
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
    logging.getLogger().handlers[0].setFormatter(logging.Formatter("%(asctime)s cudawrap monitor: %(message)s"))
    os.write(write_end, str(os.getpid()).encode())
    os.close(write_end)
    return fd
