"""A line on stderr and the caller's environment, on the C module posix alone.

The shim's fast path (cudawrap.launch) cannot afford `import os` (~0.8 ms on every launch);
the general launch and `cudawrap run` use the same two through base.program.
"""
from __future__ import annotations

import posix

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict


def say(prog: str, message: str) -> None:
    """One line on stderr; written in one call so parallel launches never interleave."""
    posix.write(2, f"{prog}: {message}\n".encode("utf-8", "replace"))


def original_environ() -> Dict[bytes, bytes]:
    """The caller's environment exactly as it was passed to us, byte for byte.

    Python adds LC_CTYPE when it coerces a C locale, and os.environ cannot tell us what
    it changed; the kernel's copy in /proc/self/environ is the untouched original.
    """
    try:
        fd = posix.open("/proc/self/environ", posix.O_RDONLY | posix.O_CLOEXEC)
    except OSError:
        return dict(posix.environ)
    try:
        chunks = []
        while True:
            chunk = posix.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        posix.close(fd)
    env: Dict[bytes, bytes] = {}
    for item in b"".join(chunks).split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key not in env:  # the first of duplicates wins, as with getenv()
            env[key] = value
    return env
