"""Who is on the other end of a connection, as the kernel says: never as the message says.

The uid and gid come from SO_PEERCRED, the process from SO_PEERPIDFD where the kernel has it
(a pidfd names the very process that connected, whatever pids are reused since), else from
the pid SO_PEERCRED recorded at connect(2), held by a pidfd opened at once and checked to
belong to the same uid and to have started before the connection was accepted (to within the
second /proc/stat's boot time is given in). The program is the kernel's word too: a request
counts as a run of a wrapped program only when the process runs the interpreter of this install's shims on a
shim file of this install that is root's (docs/admin/service.md).
"""
from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .. import locations as loc
from ..base.proc import real_uid

# include/uapi/asm-generic/socket.h (Linux 6.5); Python names it only from 3.13 on.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


@dataclass
class Peer:
    pid: int
    uid: int
    gid: int
    pidfd: int  # -1: none (a kernel without pidfds)

    def alive(self) -> bool:
        """Whether the process is still running (assumed so without a pidfd)."""
        if self.pidfd < 0:
            return True
        import select

        poll = select.poll()
        poll.register(self.pidfd, select.POLLIN)  # readable once the process has exited
        return not poll.poll(0)

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1


def identify(sock: socket.socket) -> Optional[Peer]:
    """The peer of SOCK; None when it is gone already (or its pid is another user's now)."""
    pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        struct.calcsize("3i")))
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        return Peer(pid, uid, gid, pidfd)
    except OSError:
        pass
    accepted = time.time()
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = -1
    started = _started(pid)
    # Exited, its pid reused since: by someone else's process, or by one started after the
    # connection was accepted (so after it was made).
    if real_uid(pid) != uid or started is None or started > accepted + _SLACK_S:
        if pidfd >= 0:
            os.close(pidfd)
        return None
    return Peer(pid, uid, gid, pidfd)


# The boot time in /proc/stat is whole seconds: a start time read from /proc may be late by
# up to that, and by a clock tick.
_SLACK_S = 1.0 + 1.0 / os.sysconf("SC_CLK_TCK")


def _started(pid: int) -> Optional[float]:
    """When PID started (seconds since the epoch, to a clock tick), None if it is gone."""
    from ..ledger.looks import proc

    p = proc(pid)
    return p.started if p is not None else None


def _cmdline(pid: int) -> List[bytes]:
    try:  # os.read, not open(): each request pays this
        fd = os.open(f"/proc/{pid}/cmdline", os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.read(fd, 1 << 16).split(b"\0")
        finally:
            os.close(fd)
    except OSError:
        return []


def _shebang_python(shim: str) -> Optional[str]:
    try:
        with open(shim, "rb") as f:
            first = f.readline(4096).decode("utf-8", "surrogateescape")
    except OSError:
        return None
    words = first[2:].split() if first.startswith("#!") else []
    return words[0] if words else None


def _baked_link(shim: str) -> Optional[str]:
    """The program's link a per-program shim was written for (its last line), or None."""
    import ast

    try:
        with open(shim, encoding="utf-8", errors="replace") as f:
            last = f.read(1 << 16).rstrip().rsplit("\n", 1)[-1]
    except OSError:
        return None
    if not (last.startswith("main(") and last.endswith(")")):
        return None
    try:
        args = ast.literal_eval(last[len("main"):])
    except (ValueError, SyntaxError):
        return None
    return args[1] if isinstance(args, tuple) and len(args) == 2 and isinstance(args[1], str) else None


def program(pid: int, root: str) -> Optional[str]:
    """The link of the wrapped program PID is a shim run of, or None (the defaults apply).

    A shim runs as ``PYTHON -IS SHIM-PATH ARGS``: SHIM-PATH (the program's link, or a link
    to the shim) must resolve to a shim of the install at ROOT, owned by the service's
    user and writable by nobody else, and /proc/PID/exe (which only the kernel sets) must
    be the interpreter that shim names."""
    from ..launch import find_link
    from ..paths import Layout
    from pathlib import Path

    argv = _cmdline(pid)
    if len(argv) < 3 or argv[1] != b"-IS":
        return None
    script = os.fsdecode(argv[2])
    if not script.startswith("/"):
        try:
            script = os.path.join(os.readlink(f"/proc/{pid}/cwd"), script)
        except OSError:
            return None
    try:
        st = os.stat(script)  # the shim itself, through the program's link
        exe = os.readlink(f"/proc/{pid}/exe")  # resolved already: the kernel's own path
    except OSError:
        return None
    identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_uid, st.st_mode)
    known = _known.get((root, script))
    if known is not None and known[0] == identity:
        return known[2] if exe == known[1] or os.path.realpath(exe) == known[1] else None
    layout = Layout(Path(root))
    if not layout.is_shim_path(script):
        return None
    shim = os.path.realpath(script)
    python = _shebang_python(shim)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022 or python is None:
        return None
    python = os.path.realpath(python)
    if python != os.path.realpath(exe):
        return None
    baked = _baked_link(shim)
    if baked is None:
        return find_link(script, loc.under(root, loc.SHIM))  # the shared shim: the links decide, every time
    if len(_known) >= _KNOWN_MAX:
        _known.clear()
    _known[(root, script)] = (identity, python, baked)
    return baked


# (root, the path a shim was run by) -> (that shim file's identity, its interpreter, the link
# baked into it): what program() found the last time, for as long as the path leads to the
# same unchanged file (a shim is rewritten, never edited in place, by install and doctor).
# Only a path that led into the install's shims is kept, so a path elsewhere is checked in full.
_known: Dict[Tuple[str, str], Tuple[Tuple[int, ...], str, str]] = {}
_KNOWN_MAX = 4096
