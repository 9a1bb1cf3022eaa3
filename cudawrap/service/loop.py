"""`cudawrap serve`: the socket, its connections, and the decisions they wait for.

One thread, one poll loop: a connection costs a descriptor and a few hundred bytes, a waiting
client nothing (it blocks on its socket). A decision is made when something it depends on
changed (a request, a grant taken or void, a client gone, a lease file closed, the queue
directory changed) and at least every TICK_S while anyone waits (NVML has no events), never
more often than MIN_GAP_S; asking Slurm for a client's job's GPUs (it may block) runs on worker
threads (slurmjob.Lookups). Whatever a client sends, the worst it gets is one error line and
a closed connection; a user may keep at most max_connections connections open, and one that
does not send its request within HELLO_S is closed. A waiting client keeps its place across a
restart of the service by the ticket it was given (service/tickets.py). Questions (status, cancel)
are answered after the grants, one a step, their answers sent as their clients read them
(service/answers.py): the loop never waits on a client.

This module is the loop itself (its state, its select and its step, its start and stop);
what each thing it reads does is in the parts the Service is made of (Service's docstring).
"""
from __future__ import annotations

import os
import selectors
import signal
import time
from typing import Dict, List, Optional, Set

from .. import locations as loc
from ..base.wakepipe import WakePipe
from . import ledgerturn, slurmjob
from ..paths import Layout
from .answering import Answering
from .answers import Answers
from .clients import Clients
from .connection import Client, listen
from .granting import Granting
from .grants import Grants, Held
from .journal import say
from .releases import Releases
from .restart import Comeback
from .waitline import Line
from .filewatch import FileWatch
from .roster import Roster
from .stalls import Stalls

TICK_S = 1.0
MIN_GAP_S = 0.002
# After a hand-over on the last look (_hand_over), the full decision (everyone else's place,
# a new look) waits this long, or for a request: on 2 cores it took the CPU from the exec of
# the run just granted (record -> exec p95 2.7-5.3 ms against 1.5-2.2 without it).
FOLLOW_S = 0.005
MAX_CONNECTIONS_PER_UID = 1000  # as many runs as one user may have in the queue directory


class Service(Clients, Answering, Granting, Releases):
    """The service's state and its loop's select and step; what each thing read does is a part
    of its own: a client's messages (clients.py), the questions' answers (answering.py), the
    decisions and their grants (granting.py), the grants' ends (releases.py)."""

    def __init__(self, root: str, max_per_uid: int = MAX_CONNECTIONS_PER_UID, private_status: bool = False) -> None:
        self.root = root
        self.max_per_uid = max_per_uid
        self.private_status = private_status
        self.renamed = True  # lease files made or removed since the last look (sync): list them again
        self.line = Line(root)
        from pathlib import Path

        layout = Layout(Path(root))
        ledgerturn.background(layout)  # the ledger's state rewrites and fsyncs off this loop
        self.grants = Grants(self.line.leases, layout, say)  # say: MPS's ACLs
        self.line.books = self.grants.books  # who holds what, from the grants, never a pid alone
        self.clients: Dict[int, Client] = {}  # socket fd -> client
        self.roster = Roster()  # who waits, who has not asked yet: kept, not found by a pass over everyone
        self.per_uid: Dict[int, int] = {}  # uid -> its connections (counting them was a pass over every client)
        self.answers = Answers()  # questions waiting for the grants, answers waiting for their readers
        self.stalls = Stalls()  # grants sent and not taken yet; clients passed over for ignoring theirs
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.answers.fileno(), selectors.EVENT_READ, "answers")
        if self.grants.confine is not None:  # [confine] runs: the exits that empty an ended run's cgroup
            self.selector.register(self.grants.confine.fileno(), selectors.EVENT_READ, "confine")
        self._catch_stops()  # before the socket exists: a stop from here on removes it
        self.dirty = False
        self.freed = False  # a grant ended: decided on at once, MIN_GAP_S or not
        # Requests read this step: one decision for all of them at its end (one each, with
        # 900 waiting and requests pouring in, took the loop for seconds: issue 51).
        self.newcomers = False
        # When a release was last handed over on the last decision's look (_hand_over):
        # the full decision waits FOLLOW_S (another release meanwhile is handed over too).
        self.handed = float("-inf")
        self.recheck_at = float("inf")
        self.closing: Set[str] = set()  # leases of running grants closed and found held: tried at recheck_at
        self.last_decision = 0.0
        self.notes: List[str] = []  # for the log, once it listens
        self.path = loc.under(root, loc.SERVICE_SOCKET)
        self.listener = listen(self.path)
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.watch = self._watch()
        # A lease found free is believed until the watch says otherwise (Line._free).
        self.line.watched = self.watch is not None and self.watch.leases >= 0
        self.jobs = slurmjob.Lookups()  # Slurm is asked off the loop: it may block
        self.selector.register(self.jobs.fileno(), selectors.EVENT_READ, "slurm")
        self.strays: Set[int] = set()  # pidfds of the holders no adopted grant follows (_adopt)
        self._adopt()
        # The directories are root's now (servestart): what anyone opened before is worth nothing.
        self._renewed(self.grants.renew(self.grants.every_file()))
        self.comeback = Comeback(layout, self.notes, say)

    # -- setting up -------------------------------------------------------------------------
    def _watch(self) -> Optional[FileWatch]:
        try:
            watch = FileWatch(self.root, self.line.leases.dir, self.line.queue.dir)
        except OSError:
            return None  # decisions every TICK_S only
        self.selector.register(watch.fileno(), selectors.EVENT_READ, "watch")
        return watch

    def _adopt(self) -> None:
        for held in self.grants.adopt(self.line.acquirer.slots):
            self.selector.register(held.pidfd, selectors.EVENT_READ, held)
            self.line.held_by(held.pid)
        self.grants.restore_mps_access()
        # [confine] nodes: a holder no adopted grant follows (granted just before a crash, its
        # record not yet written) keeps its nodes while it lives: its exit closes them.
        for pid in self.grants.strays():
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                self.grants.stray_gone()  # exited meanwhile
                continue
            self.strays.add(fd)
            self.selector.register(fd, selectors.EVENT_READ, STRAY)

    def close(self) -> None:
        ledgerturn.finish()
        # The runs waiting now are those a successor waits for (those that left the line in
        # the last second are not, though a fall is written at most once a second).
        self.comeback.census.note(self.roster.ticketed, time.monotonic(), exact=True)
        for client in list(self.clients.values()):
            self._drop(client)
        if self.grants.confine is not None:
            self.selector.unregister(self.grants.confine.fileno())
        self.grants.close()  # [confine] runs: every run cgroup with no process left goes
        for fd in self.strays:
            os.close(fd)
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.listener.close()

    # -- the loop ---------------------------------------------------------------------------
    def _catch_stops(self) -> None:
        """SIGTERM, SIGINT and SIGHUP only set a flag, and the signal's byte on the wakeup
        pipe wakes the select at once: the loop leaves between two steps (run). The handler
        raised before, wherever the loop was: half-way into a lock or a queue put, the stop
        then waited on it for good (a service alive 10 s after its SIGTERM)."""
        self.stopping = False
        self.wake = WakePipe()
        self.selector.register(self.wake.fileno(), selectors.EVENT_READ, "signal")
        self.previous_wakeup = signal.set_wakeup_fd(self.wake.w)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._stop)

    def run(self) -> None:
        """Steps until a stop signal; then the socket is removed and the ledger made durable."""
        try:
            while not self.stopping:
                self.step(self._timeout())
        finally:
            signal.set_wakeup_fd(self.previous_wakeup)
            self.selector.unregister(self.wake.fileno())
            self.wake.close()
            self.close()

    def _stop(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _timeout(self) -> float:
        now = time.monotonic()
        times = [c.hello_by for c in self.roster.unasked()]
        times += [p.deadline for p in self.grants.pending.values()]
        times += [self.stalls.due(now)] if self.grants.pending else []
        times += [self.recheck_at] if self.recheck_at < float("inf") else []
        times += [now] if self.answers.ready() else [self.answers.due()] if self.answers.sending else []
        if self.roster.waiting:
            times.append(now + TICK_S)
            times.append(self.roster.next_due())
            if self.comeback.grace_until > now:
                times.append(self.comeback.grace_until)
            if self.dirty:  # and after a hand-over, once its run has started (FOLLOW_S)
                times.append(max(self.last_decision + MIN_GAP_S, self.handed + FOLLOW_S))
        return max(0.0, min(times) - now) if times else TICK_S * 30

    def step(self, timeout: float) -> None:
        self.answers.idle.set()  # an answer being worked out on its thread goes on meanwhile
        ready = self.selector.select(ledgerturn.idle_within(timeout))
        self.answers.idle.clear()
        if not ready:
            ledgerturn.idle()  # the ledger's state written, its fsync later (on the writer's thread)
        # One ledger turn for all of it, carried on to the next while hand-overs follow each
        # other: one state write, once the grants are sent (ledgerturn.turn).
        with ledgerturn.turn(self.grants.layout, carry=True):
            for key, mask in sorted(ready, key=_first):
                self._read(key, mask)
            if self.grants.renewing:  # before the decision: a file found free is replaced first
                self._renewed(self.grants.renew_free())
            if self.newcomers:
                self.newcomers = False
                self._decide()
            now = time.monotonic()
            for client in [c for c in self.roster.unasked() if c.hello_by <= now] + self.answers.stale(now):
                self._drop(client)  # connected and never asked, or never reads: its slot goes to others
            for key in self.grants.expired(now):
                self._late(key)
            for key in self.stalls.ignored(self.grants.pending, now) if self.grants.pending else ():
                self._late(key, ignored=True)
            if now >= self.recheck_at:
                self.recheck_at = float("inf")
                self._recheck(self.grants.lingering(), again=False)
                closing, self.closing = self.closing, set()
                self._let_go(closing, again=False)
            if self.comeback.ended(now):
                self.dirty = True  # those who came meanwhile are decided on now
            waiting = self.roster.waiting
            due = self.roster.next_due() <= now
            if self.handed + FOLLOW_S > now:
                pass  # the run just granted starts first (FOLLOW_S); a release meanwhile is handed over
            elif waiting and (self.dirty or now - self.last_decision >= TICK_S or due):
                if not (self.dirty or due) and self._all_held():
                    self._tick_tickets(now)  # nothing to grant: only the tickets age
                elif self.freed or now - self.last_decision >= MIN_GAP_S:
                    self._decide()
            # After the grants are sent: its file is rewritten once a second while runs leave
            # the line, and before the decision that rewrite delayed a second's first hand-over.
            self.comeback.census.note(self.roster.ticketed, now)
        ledgerturn.release(older_than=ledgerturn.CARRY_MAX_S)  # a look waits for its lock meanwhile
        self._answer()  # after the grants, and one a step: what is ready meanwhile comes first

    def _read(self, key: selectors.SelectorKey, mask: int) -> None:
        """What KEY's descriptor had ready (MASK), handed to the part whose it is."""
        if key.data == "signal":
            self.wake.drain()  # a stop signal's byte: run() leaves after this step
        elif key.data == "listen":
            self._accept()
        elif key.data == "watch":
            self._events()
        elif key.data == "slurm":
            self._resolved()
        elif key.data == "confine":
            self.grants.confine.emptied()
        elif key.data == "answers":
            for client, done in self.answers.finished():
                self._send_answer(client, done)
        elif isinstance(key.data, Held):
            self._exited(key.data)
        elif key.data is STRAY:
            self.selector.unregister(key.fd)
            self.strays.discard(key.fd)
            os.close(key.fd)
            self.grants.stray_gone()
        elif mask & selectors.EVENT_WRITE:
            self._writable(key.data)
        else:
            self._readable(key.data)


STRAY = object()  # the selector's mark of a stray's pidfd (_adopt)


def _first(ready: "tuple[selectors.SelectorKey, int]") -> int:
    """The order a step reads what is ready in: a run's exit first, so that its hand-over
    (on the last look: _hand_over) waits for nothing else read this step; then the files'
    news, so that a request in the same step is read with the lease files as they are."""
    data = ready[0].data
    return 0 if isinstance(data, Held) else 1 if data == "watch" else 2
