"""Each grant from the descriptors sent to the lock taken, and on to its release.

The service opens a granted device's lease file read-only and sends the descriptor; the
client takes the lock on it. Until the client says so (HELD), the devices count as
claimed by it (held, in every decision), for at most DEADLINE_S: then the service closes
its copies and the grant is void (a stopped or slow client holds nothing: an unlocked
descriptor holds no device; should it lock later, the lock table shows it, as any lock).
HELD is checked, not believed: the service still has the same open file descriptions,
and /proc/self/fdinfo lists the locks each of them holds.

A held grant is followed by a pidfd of its client (no polling): once the client exits the
service tries each lease (LOCK_EX|LOCK_NB on its own descriptor): free, the grant ends;
still held (a child inherited the descriptor), it ends at a later close of that lease file.
"""
from __future__ import annotations

import array
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .. import wire
from ..lease.files import LeaseFiles, lock_kind
from ..paths import Layout
from . import accounts

DEADLINE_S = 2.0
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass
class Pending:
    key: str
    pid: int
    devices: List[str]
    fds: List[int]  # the service's copies of what was sent
    deadline: float
    lease_id: str = ""  # its ledger record

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


@dataclass
class Held:
    uid: int
    pid: int
    pidfd: int
    devices: List[str]
    program: str
    since: float  # time.time() of the grant
    lease_id: str = ""
    exited: bool = False
    ended: List[str] = field(default_factory=list)  # devices found released


class Grants:
    def __init__(self, leases: LeaseFiles, layout: Layout) -> None:
        self.leases = leases
        self.layout = layout
        self.pending: Dict[str, Pending] = {}
        self.held: Dict[int, Held] = {}  # pidfd -> grant

    def claimed(self) -> Dict[str, int]:
        return {u: p.pid for p in self.pending.values() for u in p.devices}

    def offer(self, sock: socket.socket, key: str, pid: int, uid: int, devices: List[str], program: str,
              asked: float) -> bool:
        """Record the grant, then send DEVICES' lease descriptors to the client PID on SOCK;
        False if that failed (the record then ends at once)."""
        lease_id = accounts.grant(self.layout, pid, uid, devices, program, asked)
        if lease_id is None:
            return False
        fds: List[int] = []
        try:
            for uuid in devices:
                fds.append(os.open(self.leases.path(uuid), _OPEN))
            data = wire.encode(wire.GRANT, {"devices": ",".join(devices)})
            sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
            if sent != len(data):
                raise OSError("short send")
        except OSError:
            for fd in fds:
                os.close(fd)
            accounts.end(self.layout, lease_id, "not taken (the client went away)")
            return False
        self.pending[key] = Pending(key, pid, list(devices), fds, time.monotonic() + DEADLINE_S, lease_id)
        return True

    def void(self, key: str) -> None:
        pending = self.pending.pop(key, None)
        if pending is not None:
            pending.close()
            accounts.end(self.layout, pending.lease_id, "not taken")

    def confirm(self, key: str) -> Optional[Pending]:
        """The pending grant KEY if every lock is now held through what was sent; void otherwise."""
        pending = self.pending.pop(key, None)
        if pending is None:
            return None
        ok = all(lock_kind(fd) is True for fd in pending.fds)
        pending.close()
        if not ok:
            accounts.end(self.layout, pending.lease_id, "not taken")
        return pending if ok else None

    def expired(self, now: float) -> List[str]:
        return [k for k, p in self.pending.items() if p.deadline <= now]

    def follow(self, held: Held) -> None:
        self.held[held.pidfd] = held

    def check(self, held: Held) -> bool:
        """Whether every lease of HELD is free now (its client has exited); frees the pidfd then."""
        held.ended = [u for u in held.devices if u in held.ended or self.leases.free_now(u)]
        if len(held.ended) < len(held.devices):
            return False
        self.held.pop(held.pidfd, None)
        os.close(held.pidfd)
        accounts.end(self.layout, held.lease_id)
        return True

    def lingering(self) -> List[Held]:
        """Grants whose client exited with a lease still held (by a child it passed it to)."""
        return [h for h in self.held.values() if h.exited]
