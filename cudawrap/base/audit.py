"""The audit trail: one syslog line per grant, wait, timeout and error (`journalctl -t cudawrap`).

libc's syslog() drops messages silently when no syslog socket exists, which is what we
want: a container or a minimal chroot must not make every launch complain.
"""

import posix

from .users import user_name

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Optional

_opened = False


def field(value: object) -> str:
    """VALUE as one token of an audit line: program names and reasons come from users, so
    control characters are escaped (a newline cannot forge a second line) and a value with
    spaces or quotes is double-quoted."""
    text = str(value)
    if not text.isprintable():  # text.py only then: the launch logs a grant every time
        from .text import printable

        text = printable(text)
    if text and not any(c in text for c in ' "\''):
        return text
    return '"' + text.replace('"', '\\"') + '"'


def log(event: str, priority: str = "info", **fields: "Any") -> None:
    """Send "EVENT key=value …" to syslog with the caller's user and pid."""
    global _opened
    try:
        import syslog
    except ImportError:  # pragma: no cover - non-Unix
        return
    if not _opened:
        syslog.openlog("cudawrap", syslog.LOG_PID, syslog.LOG_USER)
        _opened = True
    parts = [event, f"user={user_name(posix.getuid())}", f"uid={posix.getuid()}"]
    for key, value in fields.items():
        parts.append(f"{key}={field(value)}")
    level = syslog.LOG_WARNING if priority == "warning" else (
        syslog.LOG_ERR if priority == "error" else syslog.LOG_INFO)
    syslog.syslog(level, " ".join(parts))


SYSLOG_SOCKET = "/dev/log"  # where libc's syslog() sends; without it messages vanish silently
_noticed = False


def channel_problem(socket: str = SYSLOG_SOCKET) -> "Optional[str]":
    """Why syslog cannot receive the audit trail, or None when it can."""
    import stat

    try:
        if stat.S_ISSOCK(posix.stat(socket).st_mode):
            return None
        return f"{socket} is not a socket: syslog messages (the audit trail) are lost"
    except OSError as exc:
        return f"{socket} is missing ({exc.strerror}): syslog messages (the audit trail) are lost"


def notice_if_unreachable() -> None:
    """Say once per process, on stderr, that the audit trail has no syslog to go to.

    For the monitor only, as it starts (its log then says why no grant reaches syslog):
    neither a launch nor an admin command (drain, resume) repeats it on every run where
    no syslog runs, as in many containers. install.sh says it once and `cudawrap doctor`
    reports it. Leases are still recorded in the ledger, which does not depend on syslog.
    """
    global _noticed
    problem = None if _noticed else channel_problem()
    _noticed = True
    if problem:
        posix.write(2, f"cudawrap: warning: {problem}; grants and ends of leases are still recorded "
                    f"in the ledger (`cudawrap usage`)\n".encode())
