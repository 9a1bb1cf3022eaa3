"""The audit trail: one syslog line per grant, wait, timeout and error (`journalctl -t cudawrap`).

libc's syslog() drops messages silently when no syslog socket exists, which is what we
want: a container or a minimal chroot must not make every launch complain.
"""
from __future__ import annotations

import os

from .users import user_name

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any

_opened = False


def log(event: str, priority: str = "info", **fields: Any) -> None:
    """Send "EVENT key=value …" to syslog with the caller's user and pid."""
    global _opened
    try:
        import syslog
    except ImportError:  # pragma: no cover - non-Unix
        return
    if not _opened:
        syslog.openlog("cudawrap", syslog.LOG_PID, syslog.LOG_USER)
        _opened = True
    parts = [event, f"user={user_name(os.getuid())}", f"uid={os.getuid()}"]
    for key, value in fields.items():
        text = str(value).replace("\n", " ")
        parts.append(f"{key}={text!r}" if " " in text or not text else f"{key}={text}")
    level = syslog.LOG_WARNING if priority == "warning" else (
        syslog.LOG_ERR if priority == "error" else syslog.LOG_INFO)
    syslog.syslog(level, " ".join(parts))
