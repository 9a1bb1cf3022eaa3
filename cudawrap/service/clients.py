"""One client's connection and its request, a part of the service's loop (loop.Service).

A connection is accepted (a user may keep at most max_per_uid open), read as it sends, and
its messages handled in turn: a request read (its Slurm job asked off the loop: it may
block) and put in line, told it waits (with a ticket for a restart), a question handed on
to be answered (answering.py), a grant's word handed on (granting.py). Whatever a client
sends, the worst it gets is one error line and a closed connection.

Apart from the loop's select and step (loop.py), which it shares its state with: this is
what one client's messages do, that is when they are read.
"""
from __future__ import annotations

import logging
import os
import selectors
import socket
import time
from typing import Dict, Optional

from .. import wire
from ..base.proc import executable, start_time
from ..errors import CudawrapError
from . import peer, requests, slurmjob, tickets
from .connection import Client
from .journal import say
from .slurmjob import JobGpus

log = logging.getLogger(__name__)


class Clients:
    """The service's clients, from their connection to their place in line (a part of loop.Service)."""

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the backlog waits
                log.warning("accept: %s", exc)
                return
            sock.setblocking(False)
            who = peer.identify(sock)
            if who is None:
                sock.close()
                continue
            mine = self.per_uid.get(who.uid, 0)
            client = Client(sock, who)
            if who.uid != 0 and mine >= self.max_per_uid:
                client.send(wire.ERROR, {"code": str(os.EX_TEMPFAIL),
                                         "text": f"you have {mine} connections to the cudawrap service open, "
                                                 f"the most one user may have",
                                         "hint": "wait for some of your runs to start"})
                sock.close()
                who.close()
                continue
            self.clients[sock.fileno()] = client
            self.roster.connected(sock.fileno(), client)
            self.per_uid[who.uid] = mine + 1
            self.selector.register(sock, selectors.EVENT_READ, client)
            # What the kernel says of it, read at once: where the client runs on another CPU,
            # its request arrives meanwhile and is read in this turn, not the next (where our
            # wake-up took its CPU, the request comes next turn whatever is done first).
            self._learn(client)
            self._readable(client)

    def _drop(self, client: Client) -> None:
        if self.clients.pop(client.sock.fileno(), None) is None:
            return
        self.roster.left(client.sock.fileno(), client)
        self.answers.forget(client)
        left = self.per_uid.pop(client.peer.uid, 1) - 1
        if left:
            self.per_uid[client.peer.uid] = left
        self.selector.unregister(client.sock)
        if client.waiter is not None:
            self._void(client.waiter.key)  # and a waiter gone is one the last look counted
            self.stalls.end(client.waiter.key)
            self.grants.gone(client.peer.pid)  # [confine] runs: one that got nothing leaves no cgroup
        client.sock.close()
        client.peer.close()

    def _fail(self, client: Client, code: int, text: str, hint: str = "") -> None:
        client.send(wire.ERROR, {"code": str(code), "text": text, **({"hint": hint} if hint else {})})
        self._drop(client)

    def _readable(self, client: Client) -> None:
        try:
            data = client.sock.recv(wire.MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            if client.waiter is not None and client.waiter.key in self.grants.pending:
                # A run whose grant is whole says nothing more: it locks and execs, and its
                # connection closes in the exec. Its locks are checked, as a HELD's are.
                self._held(client)
                return
            self._drop(client)
            return
        try:
            messages = client.reader.feed(data)
        except wire.WireError as exc:
            self._fail(client, os.EX_PROTOCOL, f"the cudawrap service: {exc}")
            return
        if client.fresh and _hung_up(client):
            self._drop(client)  # asked and left already: nobody to answer, nor to grant a device to
            return
        for verb, fields in messages:
            if client.sock.fileno() not in self.clients:
                return
            self._handle(client, verb, fields)

    def _handle(self, client: Client, verb: str, fields: Dict[str, str]) -> None:
        if verb in (wire.REQUEST, wire.RUN) and client.fresh:
            if verb == wire.RUN:
                fields.setdefault("asks", "")  # requests.read reads the run's settings from them
            else:
                fields.pop("asks", None)
            self._request(client, fields)
        elif verb in (wire.STATUS, wire.CANCEL, wire.REVOKE) and client.fresh:
            self._question(client, verb, fields)
        elif verb == wire.HELD and client.waiter is not None:
            self._held(client)
        elif verb == wire.LOST and client.waiter is not None:
            self._void(client.waiter.key)  # taken past us
        else:
            self._fail(client, os.EX_PROTOCOL, f"the cudawrap service: a {verb} message out of turn")

    def _learn(self, client: Client) -> None:
        """What the kernel says of CLIENT (Client.facts): its Slurm job, from its cgroup, and
        the wrapped program it is a shim run of (peer.program), from its command line."""
        try:
            client.facts = (slurmjob.job_of(client.peer.pid), peer.program(client.peer.pid, self.root))
        except CudawrapError as exc:
            client.facts_error = exc
        # Read here, not at its grant (a hand-over's path): what its grant's record names.
        client.ticks = start_time(client.peer.pid)
        client.exe = executable(client.peer.pid)

    def _request(self, client: Client, fields: Dict[str, str]) -> None:
        client.arrival_ns = time.time_ns()  # its place in line: when it asked (or a ticket's, in _ask)
        if client.facts_error is not None:
            exc = client.facts_error
            self._fail(client, exc.exit_code, exc.message, exc.hint or "")
            return
        if client.facts is None or not client.peer.alive():
            self._drop(client)  # its pid may be another's now: what /proc said is not the client's
            return
        job = client.facts[0]
        known = self.jobs.get(job) if job is not None else None
        if job is not None and known is None:
            client.resolving = (job, fields)  # Slurm answers on a worker; others are served meanwhile
            return
        self._ask(client, fields, known)

    def _resolved(self) -> None:
        """Slurm answered for some jobs: their waiting requests go on, or fail with its error."""
        for job_id, outcome in self.jobs.ready():
            say(str(outcome))  # "Slurm job 12: GPUs 0,1 here", or why Slurm could not say
            for client in [c for c in self.clients.values()
                           if c.resolving is not None and c.resolving[0].job_id == job_id]:
                assert client.resolving is not None
                fields, client.resolving = client.resolving[1], None
                if isinstance(outcome, CudawrapError):
                    self._fail(client, outcome.exit_code, outcome.message, outcome.hint or "")
                else:
                    self._ask(client, fields, outcome)

    def _ask(self, client: Client, fields: Dict[str, str], job: Optional[JobGpus]) -> None:
        """Read CLIENT's request (JOB: its Slurm job's GPUs, Slurm's word) and put it in line."""
        # A sync since: the machine is read again. The watch says so (a listing costs each
        # request ~0.03 ms); without a watch, or once it lost events, the listing does.
        if (self.renamed or not self.line.watched) and self.line.changed():
            self.line.load()
        self.renamed = False
        assert client.facts is not None
        link = client.facts[1]
        try:
            ask = requests.read_kept(self.root, self.line.inventory, fields, link, client.peer.uid, self.line.present, job)
        except CudawrapError as exc:
            self._fail(client, exc.exit_code, exc.message, exc.hint or "")
            return
        restored = self.comeback.resume(client.peer.uid, client.peer.pid, fields.get("ticket", ""))
        client.arrival_ns = restored or client.arrival_ns
        key, arrival = requests.arrival_key(client.peer.pid, client.arrival_ns)
        client.ask = ask
        client.waiter = ask.waiter(key, client.peer.uid, client.peer.pid, arrival)
        if client.facts[0] is None:  # [confine] runs: its own cgroup, made while it is decided on (not in Slurm's)
            self.grants.enter(client.peer.pid, client.peer.uid)
        now = time.monotonic()
        # Its wait counts from its arrival, before a restart too.
        client.wait_until = now + max(0.0, ask.wait - max(0.0, time.time() - arrival))
        self.dirty = True
        grace = self.comeback.in_grace(now)
        if grace:
            # Decided with everyone once the grace is over: a run that waited before the
            # restart goes in its old place, a newcomer in its own, as if nothing happened.
            client.wait_until = max(client.wait_until, self.comeback.grace_until)
        self.roster.queued(client.sock.fileno(), client)
        self.line.forget()  # a release's hand-over waits for a decision that counts this run
        if grace:
            client.told = "grace"
            if not self._tell(client, "waiting for a device: the service has just restarted, and the runs that "
                                      f"waited in it are coming back in line (up to {tickets.GRACE_S:g} s)"):
                self._drop(client)
            return
        self.newcomers = True  # answered at once, free devices or not: once this step has read all it can

    def _tell(self, client: Client, text: str) -> bool:
        """A wait line for CLIENT (none if TEXT is empty), with a new ticket when its last one is
        getting old; False when the client is gone."""
        fields = {"text": text} if text else {}
        now = time.monotonic()
        if now - client.ticket_at >= tickets.REFRESH_S:
            ticket = self.comeback.issue(client.peer.uid, client.peer.pid, client.arrival_ns,
                                         client.ticket_at == float("-inf"), self.roster.ticketed, now)
            if ticket is not None:
                fields["ticket"] = ticket
                self.roster.ticket_given(client.sock.fileno(), client, now)
        return client.send(wire.WAIT, fields) if fields else True


def _hung_up(client: Client) -> bool:
    """Whether CLIENT's end of its connection is closed (nothing more to read, nobody to answer)."""
    try:
        return client.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except OSError:
        return False  # nothing to read yet (EAGAIN): still there
