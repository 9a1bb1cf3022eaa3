"""Small files root writes for the shim to read: atomic ``marshal`` data, trusted by owner.

marshal is a C module (no import cost) and loads plain data only. A reader trusts a file
only if the runtime directory's owner (root on a system install) wrote it and nobody
else can write it, so a user cannot plant data that steers other users' launches.
"""

import _thread
import marshal
import posix

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Optional

from .. import locations as loc

_MAX_SIZE = 8 << 20


def private_tmp(path: str) -> str:
    """A temporary name beside PATH that no other writer uses: the pid alone is not enough,
    as two threads of one process (the service's, a test's monitor loop) would write the
    same file and one's rename would find it gone."""
    return f"{path}.{posix.getpid()}.{_thread.get_ident()}.tmp"


def write(path: str, data: "Any", mode: int = 0o644) -> None:
    """DATA at PATH, atomically; MODE 0o644 (the default) lets every user read it."""
    tmp = private_tmp(path)
    fd = posix.open(tmp, posix.O_WRONLY | posix.O_CREAT | posix.O_TRUNC | posix.O_NOFOLLOW | posix.O_CLOEXEC, mode)
    try:
        posix.write(fd, marshal.dumps(data))
        posix.fchmod(fd, mode)  # whatever root's umask
    finally:
        posix.close(fd)
    posix.replace(tmp, path)


def read_raw(root: str, path: str) -> "Optional[bytes]":
    """The bytes at PATH if trusted (see the module's docstring), else None."""
    try:
        fd = posix.open(path, posix.O_RDONLY | posix.O_NOFOLLOW | posix.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = posix.fstat(fd)
        owner = posix.stat(loc.under(root, loc.RUNTIME_DIR)).st_uid
        if st.st_uid != owner or st.st_mode & 0o022 or st.st_size > _MAX_SIZE:
            return None
        return posix.read(fd, st.st_size + 1)
    except OSError:
        return None
    finally:
        posix.close(fd)


def loads(raw: "Optional[bytes]", version: int) -> "Optional[dict]":
    """The dict RAW holds if it is of VERSION, else None."""
    if raw is None:
        return None
    try:
        data = marshal.loads(raw)
    except (ValueError, EOFError, TypeError):
        return None
    if not isinstance(data, dict) or data.get("version") != version:
        return None
    return data


def read(root: str, path: str, version: int) -> "Optional[dict]":
    """The dict at PATH if trusted and of VERSION, else None."""
    return loads(read_raw(root, path), version)
