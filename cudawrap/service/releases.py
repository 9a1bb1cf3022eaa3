"""Grants ending, a part of the service's loop (loop.Service): the files' news and runs' exits.

A held grant ends when its run exits or lets go of its leases (a close the file watch
reports, tried at once and RECHECK_S later); what it let go is handed over at once on the
last decision's look where that is still true (Line.hand_over), else decided on afresh.
Anything else the watch reports (a lease taken past the service, a queue entry, a drain)
asks for a full look.

Apart from the loop's select and step (loop.py), which it shares its state with: this is
what a release frees and who gets it next, that is when it is read.
"""
from __future__ import annotations

import time
from typing import List, Set

from .filewatch import News
from .grants import Held

# inotify reports a close before the kernel drops the file's flock (__fput): a lease that a
# close of it left held is tried once more this much later (a later close comes otherwise).
RECHECK_S = 0.002


class Releases:
    """The ends of grants and what they free (a part of loop.Service)."""

    def _events(self) -> None:
        assert self.watch is not None
        news = self.watch.read()
        expected = self._expected(news)
        if not expected:
            self.line.forget()  # a lease taken past us, a queue entry, a drain: a full look
        self.line.touched(news.touched)
        self.renamed = self.renamed or news.renamed
        self._recheck([h for h in self.grants.lingering() if news.closed is None or news.closed & set(h.devices)])
        if expected:
            self._let_go(news.closed or set())  # what those closes freed, if anything, decided on there
        else:
            self.dirty = self.dirty or news.decide

    def _let_go(self, closed: Set[str], again: bool = True) -> None:
        """Leases of running whole grants were closed (CLOSED): where all of one grant's are
        free now, its holder let go of them (most often it is exiting: the close comes before
        its exit can be read), and they are handed over at once (its exit, read later, finds
        them sent on, as after any close); a lease still held is tried again RECHECK_S later
        if AGAIN (the kernel drops a lock just after it reports its file's close). A close
        that frees nothing wakes no decision: it has nothing to give."""
        leases = self.grants.leases
        for held in [h for h in self.grants.held.values() if not h.exited and not h.slots and closed & set(h.devices)]:
            if any(self.grants.sent_since(held, u) for u in held.devices):
                continue
            if all(map(leases.free_now, held.devices)):
                self.grants.let_go(held)  # [confine] runs: closed to it before it goes on
                if not self._hand_over(held):
                    self.freed = self.dirty = True
            elif again:
                self.closing.update(held.devices)
                self.recheck_at = min(self.recheck_at, time.monotonic() + RECHECK_S)

    def _expected(self, news: News) -> bool:
        """Whether NEWS is only of lease files the service's own whole grants hold or were
        sent (their holders' opens and closes, our copies'): nothing the last look did not count."""
        if news.touched is None or news.renamed or news.elsewhere:
            return False
        ours = {u for u, locks in self.grants.claimed().items() if all(exclusive for _pid, exclusive in locks)}
        ours.update(u for h in self.grants.held.values() if not h.slots for u in h.devices)
        return ours.issuperset(news.touched)

    def _recheck(self, lingering: List[Held], again: bool = True) -> None:
        """Try LINGERING grants' leases after a close; if held, once more RECHECK_S later if AGAIN."""
        for held in lingering:
            if self.grants.check(held):
                self.line.forget()  # a child's hold the last look counted: decided on afresh
                self.freed = self.dirty = True
            elif again:
                self.recheck_at = min(self.recheck_at, time.monotonic() + RECHECK_S)

    def _exited(self, held: Held) -> None:
        self.selector.unregister(held.pidfd)
        held.exited = True
        # Its devices sent to the next runs already (the lease's close came first, and was
        # decided on): nothing is freed, and a decision now would only take the CPU from
        # their execs.
        resent = [u for u in held.devices if self.grants.sent_since(held, u)]
        ended = self.grants.check(held)
        if not held.slots and len(resent) == len(held.devices):
            return
        if ended and not held.slots and not resent and self._hand_over(held):
            return
        # Decided on at once: a run's exit, unlike a close (anyone's, at any rate), comes once a grant.
        self.freed = ended or self.freed
        self.dirty = True

    def _hand_over(self, held: Held) -> bool:
        """HELD's devices, let go whole and found free, to the next runs at once: decided on
        the last decision's look carried on (Line.hand_over), which spares the new look
        (every lease tried, every holder's uid: most of a hand-over on a cold CPU). False
        where none is carried on: the full decision. The full decision follows either way,
        once nothing else is ready, for everyone else's place in line."""
        if self.comeback.in_grace(time.monotonic()):
            return False
        grants = self.line.hand_over(held.devices)
        if grants is None:
            return False
        for key, devices in grants.items():
            client = self.roster.by_key.get(key)
            if client is None or key in self.grants.pending:
                self.line.forget()  # not the line the look counted: the full decision sees to it
                continue
            if not self._offer(client, list(devices)):
                self._drop(client)
            elif key in self.grants.pending:
                self.grants.pending[key].released_by = held.pid  # the journal's line says so
        self.freed = self.dirty = True
        self.handed = time.monotonic()
        return True
