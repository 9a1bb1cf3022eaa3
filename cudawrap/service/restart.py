"""A restart of the service, from the side of the runs that waited in it: the key their
reconnect tickets are signed with, how many of them the service before counted, and the
grace during which nothing is granted until they are back in line (tickets.py: the rules).
"""
from __future__ import annotations

import time
from typing import Callable, List, Optional

from ..paths import Layout
from . import tickets


class Comeback:
    """The tickets this service gives and honours, and its grace after a restart. NOTES
    gathers what the log says once the service listens; SAY is the log."""

    def __init__(self, layout: Layout, notes: List[str], say: Callable[[str], None]) -> None:
        self.say = say
        key, why = tickets.load_key(layout.service_key)
        if why not in ("", "missing"):
            notes.append(f"a new key for reconnect tickets in {layout.service_key} (the old one was {why})")
        self.tickets = tickets.Tickets(key, time.time())
        # Nothing is granted until as many runs as held tickets of the service before this one
        # are back in line with them, or GRACE_S.
        self.census = tickets.Census(layout.service_waiters)
        self.expected = self.census.previous(time.time())
        self.returned = 0
        self.grace_until = time.monotonic() + (tickets.GRACE_S if self.expected else 0.0)
        if self.expected:
            notes.append(f"runs that waited before the restart: {self.expected}; nothing is granted "
                         f"until they are back in line (up to {tickets.GRACE_S:g} s)")

    def in_grace(self, now: float) -> bool:
        """Whether the runs that waited before a restart may not all be back in line yet."""
        return now < self.grace_until and self.returned < self.expected

    def ended(self, now: float) -> bool:
        """True once, when the grace is over (those who came meanwhile are decided on then)."""
        if not self.grace_until or self.in_grace(now):
            return False
        if self.expected:
            self.say(f"back in line after the restart: {self.returned} of {self.expected} runs; "
                     f"deciding for everyone")
        self.grace_until = 0.0
        return True

    def resume(self, uid: int, pid: int, text: str) -> Optional[int]:
        """The arrival (ns) the ticket TEXT of PID (UID) restores, or None: a newcomer (the log
        says why)."""
        if not text:
            return None
        from ..base.proc import start_time

        try:
            arrival_ns = self.tickets.check(text, uid, pid, start_time(pid), time.time())
        except tickets.Refused as exc:
            self.say(f"the ticket of pid {pid} (uid {uid}) restores nothing: {exc}; it waits as a newcomer")
            return None
        self.returned += 1
        self.say(f"pid {pid} (uid {uid}) is back in line as it arrived at {arrival_ns / 1e9:.3f}")
        return arrival_ns

    def issue(self, uid: int, pid: int, arrival_ns: int, first: bool, holders: int, now: float) -> Optional[str]:
        """A ticket for PID (UID), which arrived at ARRIVAL_NS; FIRST: its first (HOLDERS, the
        waiting runs holding one before it, are counted with it before it can know of it)."""
        from ..base.proc import start_time

        start = start_time(pid)
        if start is None:
            return None
        if first:
            self.census.note(holders + 1, now)
        return self.tickets.issue(uid, pid, start, arrival_ns, time.time())
