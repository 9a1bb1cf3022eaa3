"""inotify through ctypes: the kernel tells a waiter when a lease or its queue entry changes.

The standard library has no inotify binding, and this is the only reason a waiting run
loads ctypes (never on a launch that does not wait).
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import List, Optional, Tuple

IN_MODIFY = 0x2
IN_CLOSE_WRITE = 0x8
IN_CLOSE_NOWRITE = 0x10
IN_OPEN = 0x20
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_ISDIR = 0x40000000
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000

_libc = None


def _lib():  # type: ignore[no-untyped-def]
    global _libc
    if _libc is None:
        import ctypes

        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


class Watch:
    """One inotify instance; fileno() for poll, events() to read (and consume) what woke us."""

    def __init__(self) -> None:
        self.fd = _lib().inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self.fd < 0:
            import ctypes

            raise OSError(ctypes.get_errno(), "inotify_init1 failed")

    def add(self, path: str, mask: int) -> int:
        """Watch PATH for MASK: the watch descriptor, or -1 if it cannot be watched (the caller
        then polls)."""
        return int(_lib().inotify_add_watch(self.fd, os.fsencode(path), mask))

    def remove(self, wd: int) -> None:
        if wd >= 0:
            _lib().inotify_rm_watch(self.fd, wd)

    def fileno(self) -> int:
        return self.fd

    def events(self) -> List[Tuple[int, int, str]]:
        """(watch descriptor, mask, name) of every event queued now; name is "" for the watched
        path itself. An IN_Q_OVERFLOW event (wd -1) means some were lost."""
        import struct

        out: List[Tuple[int, int, str]] = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except (BlockingIOError, OSError):
                return out
            if not data:
                return out
            at = 0
            while at + 16 <= len(data):
                wd, mask, _cookie, size = struct.unpack_from("iIII", data, at)
                raw = data[at + 16:at + 16 + size]
                out.append((wd, mask, raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")))
                at += 16 + size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_watch() -> Optional[Watch]:
    """A Watch, or None where inotify is unavailable (out of instances, no ctypes)."""
    try:
        return Watch()
    except (OSError, AttributeError, ImportError):
        return None
