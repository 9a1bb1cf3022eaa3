"""What the kernel says of a process, read from /proc without a library."""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Optional

GONE = None


def state(pid: int) -> Optional[bytes]:
    """PID's state letter (b"R", b"S", b"T", b"Z", ...); None when there is no such process,
    b"?" when it cannot be read. The command name may hold ")" and spaces: the state is the
    first field after the last ")"."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except FileNotFoundError:
        return GONE
    except OSError:
        return b"?"
    return fields[0] if fields else b"?"
