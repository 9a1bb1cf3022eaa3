"""First come, first served waiting for devices, with no daemon.

Each waiter creates an entry file in the sticky, world-writable queue directory and holds
an exclusive flock on it for as long as it waits. Entries are named by a key taken under
a short global mutex, so their order is arrival order. A waiter sleeps in a blocking
flock on its predecessor's entry: the kernel wakes exactly one waiter when the one ahead
leaves (granted, interrupted or killed), so waiting costs no CPU and there is no
thundering herd. The waiter with no live predecessor is the head and alone polls the
device leases. A dead waiter's entry is unlocked and so simply skipped.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Iterator, List, Optional

from .errors import NoDeviceError, SetupError
from .leases import SYNC_HINT

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_SUFFIX = ".wait"


class Mutex:
    """The queue's global mutex: a root-created file every user may flock read-only.

    Anyone can therefore hold it, on purpose or not; it is normally held for milliseconds.
    With a finite LIMIT_S a launch gives up after that long instead of hanging forever.
    """

    def __init__(self, path: str, limit_s: float = float("inf")) -> None:
        self.path = path
        self.limit_s = limit_s
        self.fd = -1

    def __enter__(self) -> Mutex:
        try:
            self.fd = os.open(self.path, _OPEN_FLAGS)
        except OSError as exc:
            raise SetupError(f"cannot open the queue lock {self.path}: {exc.strerror}", hint=SYNC_HINT) from None
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise SetupError(f"the queue lock {self.path} is not a regular file", hint=SYNC_HINT)
        if self.limit_s == float("inf"):
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            return self
        deadline = time.monotonic() + self.limit_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    self.fd = -1
                    raise NoDeviceError(
                        f"the wait queue's lock {self.path} was held by another process for "
                        f"{self.limit_s:g} s", hint="`cudawrap status` shows who holds it") from None
                time.sleep(0.002)

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # closing drops the lock
        self.fd = -1


class Entry:
    """This process's place in the queue."""

    def __init__(self, key: str, fd: int, path: str) -> None:
        self.key = key
        self.fd = fd
        self.path = path


def _is_entry(name: str) -> bool:
    # ASCII digits only: anyone can create names here, and int() refuses "²²²…".
    key = name[:20]
    return name.endswith(_SUFFIX) and len(name) > 21 and name[20] == "." and key.isascii() and key.isdigit()


class WaitQueue:
    def __init__(self, queue_dir: str, mutex_path: str) -> None:
        self.dir = queue_dir
        self.mutex_path = mutex_path
        try:
            st = os.stat(queue_dir)
        except OSError:
            raise SetupError(f"the queue directory {queue_dir} is missing", hint=SYNC_HINT) from None
        # Sticky and world-writable, like /tmp: anyone may queue, nobody may remove
        # another user's entry.
        if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_ISVTX:
            raise SetupError(f"the queue directory {queue_dir} is not a sticky directory",
                             hint="run `cudawrap doctor --repair` as root")

    def mutex(self, limit_s: float = float("inf")) -> Mutex:
        return Mutex(self.mutex_path, limit_s)

    def _names(self) -> List[str]:
        try:
            return sorted(n for n in os.listdir(self.dir) if _is_entry(n))
        except OSError:
            return []

    def _open_live(self, name: str) -> int:
        """A descriptor on entry NAME if its owner is alive (holds its lock), else -1."""
        path = self.dir + "/" + name
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except OSError:
            return -1
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                return -1
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return fd  # locked: its owner is waiting
            os.close(fd)
            return -1
        # Nobody holds it: its owner died. Remove it if we may (our own, or as root).
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        return -1

    def live(self, before: Optional[str] = None) -> List[str]:
        """Keys of live entries in arrival order (only those ahead of BEFORE if given)."""
        out = []
        for name in self._names():
            if before is not None and name >= before:
                break
            fd = self._open_live(name)
            if fd >= 0:
                os.close(fd)
                out.append(name)
        return out

    def anyone_waiting(self) -> bool:
        """Whether any live entry exists (stops at the first: newcomers ask this)."""
        for name in self._names():
            fd = self._open_live(name)
            if fd >= 0:
                os.close(fd)
                return True
        return False

    def enqueue(self, info: bytes) -> Entry:
        """Join the queue; the caller holds the mutex, which makes the key order arrival order."""
        now = time.monotonic_ns()
        # CLOCK_MONOTONIC is one clock for the whole machine, so a real waiter's key is never
        # ahead of it: a key from the future was planted (anyone may create files here) and
        # must not steer ours, which would make our names predictable and out of order.
        keys = [int(n[:20]) for n in self._names()]
        last = max((k for k in keys if k <= now + 10**9), default=0)
        key_ns = max(now, last + 1)
        pid = os.getpid()
        while True:
            tmp = f"{self.dir}/.new-{pid}-{key_ns}"
            try:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
                break
            except FileExistsError:  # planted by someone else: never opened, just avoided
                key_ns += 1
        try:
            os.fchmod(fd, 0o644)  # readable whatever our umask, or others would not see us waiting
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, info)
            while True:
                name = f"{key_ns:020d}.{pid}{_SUFFIX}"
                try:
                    os.link(tmp, self.dir + "/" + name)  # link, unlike rename, never replaces
                    break
                except FileExistsError:
                    key_ns += 1
        finally:
            os.unlink(tmp)
        return Entry(name, fd, self.dir + "/" + name)

    def wait_turn(self, entry: Entry) -> None:
        """Block until no live entry is ahead of ENTRY."""
        while True:
            ahead = self.live(before=entry.key)
            if not ahead:
                return
            fd = self._open_live(ahead[-1])
            if fd < 0:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # sleeps until the one ahead leaves
            finally:
                os.close(fd)

    def leave(self, entry: Entry) -> None:
        try:
            os.unlink(entry.path)
        except OSError:
            pass
        if entry.fd >= 0:
            os.close(entry.fd)  # wakes the waiter behind us
            entry.fd = -1

    def entries(self) -> Iterator[tuple]:
        """(key, owner uid, info bytes) of every live entry, for `cudawrap status`."""
        for name in self._names():
            fd = self._open_live(name)
            if fd < 0:
                continue
            try:
                uid = os.fstat(fd).st_uid
                info = os.read(fd, 4096)
            finally:
                os.close(fd)
            yield name, uid, info
