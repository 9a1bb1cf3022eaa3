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
from . import asks, peer
from .slurmjob import JobCgroup

HELLO_S = 5.0  # a connection that asks nothing for this long is closed
ANSWER_S = 2.0  # what an answer may wait for a client that does not read
BACKLOG = 1024


class Client:
    """One connection: who it is, what it asks, where it stands."""

    def __init__(self, sock: socket.socket, who: peer.Peer) -> None:
        self.sock = sock
        self.peer = who
        self.reader = wire.Reader()
        self.hello_by = time.monotonic() + HELLO_S
        self.ask: Optional[asks.Ask] = None
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

    @property
    def fresh(self) -> bool:
        """Connected, and has asked nothing yet."""
        return self.ask is None and self.resolving is None

    def send(self, verb: str, fields: Dict[str, str]) -> bool:
        try:
            return self.sock.send(wire.encode(verb, fields)) > 0
        except OSError:  # full (a client that never reads) or gone: either way, done with it
            return False

    def answer(self, fields: Dict[str, str]) -> None:
        """Send an answer (it may be far larger than a socket buffer: status with 500
        waiters) whole, giving a client that does not read ANSWER_S at most."""
        try:
            data = wire.encode(wire.ANSWER, fields)
        except ValueError as exc:
            data = wire.encode(wire.ERROR, {"text": str(exc), "code": str(os.EX_SOFTWARE)})
        try:
            self.sock.settimeout(ANSWER_S)
            self.sock.sendall(data)
        except OSError:
            pass


def listen(path: str) -> socket.socket:
    """The service's socket at PATH, listening (every user may connect); SetupError where a
    service already answers there, or the runtime directory is missing."""
    if not os.path.isdir(os.path.dirname(path)):
        from ..lease.files import SYNC_HINT

        raise SetupError(f"the runtime directory {os.path.dirname(path)} is missing", hint=SYNC_HINT)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        raise SetupError(f"a service already answers on {path}",
                         hint="stop it first (systemctl stop cudawrap, or kill the pid in its pid file)")
    except OSError:
        pass  # nobody answers: a socket left by a service that died is replaced
    finally:
        probe.close()
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = f"{path}.{os.getpid()}.new"
    sock.bind(tmp)
    os.chmod(tmp, 0o666)  # every user connects; who they are comes from the kernel
    os.rename(tmp, path)
    sock.listen(BACKLOG)
    sock.setblocking(False)
    return sock
