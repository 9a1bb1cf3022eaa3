"""The service's connections by where they stand, kept up to date as they change.

The loop wakes for every inotify event on the lease, queue and state directories, most of
which change nothing (a listing of the lease directory, the ledger's own writes: ~18 a
second on a quiet machine). Before this, each such wake-up walked every connection three or
four times (who is waiting, whose wait runs out first, who has not asked yet, how many hold
tickets): ~0.9 ms with 1000 runs waiting, 1.6 % of a core spent on nothing. Here each
answer is kept as clients come, ask and go, so a wake-up costs the same with 1000 waiting
as with none.
"""
from __future__ import annotations

import heapq
from typing import Dict, List, Tuple

from .connection import Client

NEVER = float("inf")


class Roster:
    """WAITING: socket fd -> each client in line (its waiter set); BY_KEY: the same by its
    waiter's key (a release's grants name their runs by key: looked up, not found by a pass
    over the line); the clients that have not asked yet; the soonest end of a wait; how many
    waiting clients hold a ticket."""

    def __init__(self) -> None:
        self.waiting: Dict[int, Client] = {}
        self.by_key: Dict[str, Client] = {}
        self.ticketed = 0
        self._unasked: Dict[int, Client] = {}  # pruned lazily: those that asked leave at the next look
        self._due: List[Tuple[float, int, int, Client]] = []  # (wait_until, seq, fd, client), stale ones lazily
        self._seq = 0

    def connected(self, fd: int, client: Client) -> None:
        self._unasked[fd] = client

    def queued(self, fd: int, client: Client) -> None:
        """CLIENT is in line now, its wait_until set."""
        self.waiting[fd] = client
        if client.waiter is not None:
            self.by_key[client.waiter.key] = client
        self._seq += 1
        heapq.heappush(self._due, (client.wait_until, self._seq, fd, client))
        if len(self._due) > 2 * len(self.waiting) + 64:
            # Waits that ended other than by running out (a grant, a drop) stay in the heap
            # until they reach its top; a wait of days might never: rebuilt from those in line.
            self._due = [e for e in self._due if self._current(e)]
            heapq.heapify(self._due)

    def ticket_given(self, fd: int, client: Client, now: float) -> None:
        """CLIENT was given a ticket NOW (time.monotonic()): counted once while it waits."""
        if client.ticket_at == float("-inf") and self.waiting.get(fd) is client:
            self.ticketed += 1
        client.ticket_at = now

    def left(self, fd: int, client: Client) -> None:
        """CLIENT is out of line: served, or gone."""
        if self._unasked.get(fd) is client:
            del self._unasked[fd]
        if self.waiting.get(fd) is client:
            del self.waiting[fd]
            if client.waiter is not None and self.by_key.get(client.waiter.key) is client:
                del self.by_key[client.waiter.key]
            if client.ticket_at > float("-inf"):
                self.ticketed -= 1

    def unasked(self) -> List[Client]:
        """The clients connected that have not asked yet."""
        for fd in [fd for fd, c in self._unasked.items() if not c.fresh]:
            del self._unasked[fd]
        return list(self._unasked.values())

    def next_due(self) -> float:
        """When the soonest wait in line runs out (NEVER if none does)."""
        due = self._due
        while due and not self._current(due[0]):
            heapq.heappop(due)
        return due[0][0] if due else NEVER

    def _current(self, entry: Tuple[float, int, int, Client]) -> bool:
        until, _seq, fd, client = entry
        return self.waiting.get(fd) is client and client.wait_until == until
