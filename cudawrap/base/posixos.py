"""What the launch needs of os and os.path, on the posix module alone.

`import os` costs a launch ~1 ms on a small VM, a tenth of a bare interpreter's start: its
_collections_abc builds two dozen abstract classes. The shim's interpreter starts with -S,
so nothing has loaded os when the shim runs; the modules on the shim's path call posix's
functions directly (os re-exports them: posix.open is os.open) and these few of os.path's,
which are string work and a stat. Anything else of os.path loads os where it is needed.
"""

import posix
import sys

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Optional


def environ() -> "Dict[str, str]":
    """A copy of the environment as os.environ holds it (os.environ's own dict is posix.environ,
    so a change made through it shows here too), decoded as os.environ decodes it."""
    return {_decode(k): _decode(v) for k, v in posix.environ.items()}


def getenv(name: str) -> "Optional[str]":
    """os.environ.get(NAME)."""
    value = posix.environ.get(name.encode(sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()))
    return None if value is None else _decode(value)


def _decode(raw: bytes) -> str:
    return raw.decode(sys.getfilesystemencoding(), sys.getfilesystemencodeerrors())


def basename(path: str) -> str:
    """os.path.basename."""
    return path[path.rfind("/") + 1:]


def dirname(path: str) -> str:
    """os.path.dirname: everything up to the last slash, its trailing slashes cut but for the root's."""
    head = path[:path.rfind("/") + 1]
    return head.rstrip("/") or head


def exists(path: str) -> bool:
    """os.path.exists: a stat that succeeds (a link followed)."""
    try:
        posix.stat(path)
    except (OSError, ValueError):
        return False
    return True


def lexists(path: str) -> bool:
    """os.path.lexists: the name is there, even a dangling link."""
    try:
        posix.lstat(path)
    except (OSError, ValueError):
        return False
    return True


def same(a: "posix.stat_result", b: "posix.stat_result") -> bool:
    """os.path.samestat: one file (device and inode)."""
    return a.st_ino == b.st_ino and a.st_dev == b.st_dev


def link_dir(path: str) -> str:
    """The directory PATH's file lies in, its last component's links followed (those of the
    directories above it are for a stat to follow); PATH's own directory when it is no link."""
    for _ in range(40):  # the kernel's own limit of links followed in one lookup (MAXSYMLINKS)
        try:
            target = posix.readlink(path)
        except OSError:  # not a link (EINVAL), or nothing there
            break
        path = target if target.startswith("/") else f"{dirname(path) or '.'}/{target}"
    return dirname(path) or "."
