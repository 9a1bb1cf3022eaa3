"""The service's socket and its connections: listening (never beside a live service), and
one Client per connection, with who it is (the kernel's word), what it asks, where it stands.
"""
from __future__ import annotations

import os
import socket
import time
from typing import Dict, Optional, Tuple

from .. import wire
from ..errors import CudawrapError, SetupError
from ..sched.schedule import Waiter
from . import peer, requests
from .slurmjob import JobCgroup

HELLO_S = 5.0  # a connection that asks nothing for this long is closed
ANSWER_S = 2.0  # an answer whose client takes none of it for this long is dropped
BACKLOG = 1024


class Client:
    """One connection: who it is, what it asks, where it stands."""

    def __init__(self, sock: socket.socket, who: peer.Peer) -> None:
        self.sock = sock
        self.peer = who
        self.reader = wire.Reader()
        self.hello_by = time.monotonic() + HELLO_S
        self.ask: Optional[requests.Ask] = None
        self.resolving: Optional[Tuple[JobCgroup, Dict[str, str]]] = None  # its Slurm job's GPUs being asked
        self.waiter: Optional[Waiter] = None
        self.wait_until = float("inf")
        self.told = ""
        self.arrival_ns = 0
        self.ticket_at = float("-inf")  # when it was last given a ticket (time.monotonic())
        # What the kernel says of it, read when it connects (Service._learn): its Slurm job
        # and the wrapped program it is a shim run of; or why they could not be read.
        self.facts: Optional[Tuple[Optional[JobCgroup], Optional[str]]] = None
        self.facts_error: Optional[CudawrapError] = None
        self.ticks: Optional[int] = None  # its start (proc.start_time), read then too: its grant's record names it
        self.exe: Optional[str] = None  # its executable, likewise
        self.question: Optional[Tuple[str, Dict[str, str]]] = None  # a status or cancel, to be answered
        self.unsent = b""  # what of its answer the socket has not taken yet (service/answers.py)
        self.stalled_at = 0.0  # when the socket last took some of it (time.monotonic())

    @property
    def fresh(self) -> bool:
        """Connected, and has asked nothing yet."""
        return self.ask is None and self.resolving is None and self.question is None

    def send(self, verb: str, fields: Dict[str, str]) -> bool:
        try:
            return self.sock.send(wire.encode(verb, fields)) > 0
        except OSError:  # full (a client that never reads) or gone: either way, done with it
            return False

    def flush(self) -> Optional[bool]:
        """Send what the socket takes now of the answer left (never waiting: the service's
        one loop serves everyone): True once all of it is sent, False while some is left,
        None when the client is gone."""
        try:
            sent = self.sock.send(self.unsent)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return None
        if sent:
            self.unsent = self.unsent[sent:]
            self.stalled_at = time.monotonic()
        return not self.unsent


def answer_bytes(fields: Dict[str, str]) -> bytes:
    """An answer as it is sent (it may be far larger than a socket buffer: status with 900
    waiting is ~640 KB); an error line where it cannot be encoded."""
    try:
        return wire.encode(wire.ANSWER, fields)
    except ValueError as exc:
        return wire.encode(wire.ERROR, {"text": str(exc), "code": str(os.EX_SOFTWARE)})


# sizeof(struct sockaddr_un.sun_path) - 1 (linux/un.h UNIX_PATH_MAX 108, less the NUL).
UNIX_PATH_MAX = 107


def listen(path: str) -> socket.socket:
    """The service's socket at PATH, listening (every user may connect); SetupError where a
    service already answers there, or the runtime directory is missing."""
    if not os.path.isdir(os.path.dirname(path)):
        from ..lease.files import SYNC_HINT

        raise SetupError(f"the runtime directory {os.path.dirname(path)} is missing", hint=SYNC_HINT)
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise SetupError(f"the service's socket path {path} is {len(os.fsencode(path))} bytes, over the "
                         f"kernel's {UNIX_PATH_MAX} for a unix socket",
                         hint="install under a shorter root (install.sh --prefix DIR)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        raise SetupError(f"a service already answers on {path}",
                         hint="stop it first (systemctl stop cudawrap, or cudawrap serve --stop)")
    except OSError:
        pass  # nobody answers: a socket left by a service that died is replaced
    finally:
        probe.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Beside it, no longer than its own name (a unix socket's path has the kernel's limit).
    tmp = os.path.join(os.path.dirname(path), f".s{os.getpid()}")
    sock.bind(tmp)
    os.chmod(tmp, 0o666)  # every user connects; who they are comes from the kernel
    os.rename(tmp, path)
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock
