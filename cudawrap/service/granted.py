"""What a grant of the service is: sent and not yet taken (Pending), then held (Held).

Apart from grants.py, which follows them, because a restarted service makes Held records
again from the ledger (adoption.py) as much as the grants it sends make them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List

from ..lease.files import lock_kind


@dataclass
class Pending:
    key: str
    pid: int
    devices: List[str]
    fds: List[int]  # the service's copies of what was sent
    deadline: float
    lease_id: str = ""  # its ledger record
    exclusive: List[bool] = field(default_factory=list)  # the lock each of FDS must hold
    slots: Dict[str, int] = field(default_factory=dict)  # uuid -> the slot file sent, for a share
    released_by: int = 0  # the pid whose release it was handed over at, on the last look (0: a new look)
    uid: int = -1  # its client's

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def taken(self) -> bool:
        """Whether every lock is held through what was sent, each of its kind."""
        return all(lock_kind(fd) is kind for fd, kind in zip(self.fds, self.exclusive))


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
    slots: Dict[str, int] = field(default_factory=dict)  # uuid -> its slot, for a share (0: let go already)
    how: str = "ended"  # what its end record says ("revoked by NAME": cudawrap revoke)
    let_go: List[str] = field(default_factory=list)  # devices found free while it ran: closed to its cgroup
