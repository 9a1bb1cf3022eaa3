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
"""
from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import time
from typing import Dict, List, Optional, Set, Union

from .. import locations as loc
from .. import wire
from ..base import audit
from ..base.wakepipe import WakePipe
from ..ops.cancel import CANCELLED_EXIT
from ..errors import CudawrapError
from ..sched.schedule import GRANTED, Verdict
from ..sched.turns import STALL_S
from ..base.proc import executable, start_time
from ..base.users import user_name
from . import bookkeeping, peer, requests, slurmjob, tickets
from ..paths import Layout
from .answers import UNREAD_HINT, Answers
from .restart import Comeback
from .connection import Client, answer_bytes, listen
from .grants import Grants, Held
from .waitline import Line
from .filewatch import FileWatch, News
from .roster import Roster
from .stalls import Stalls
from .slurmjob import JobGpus

log = logging.getLogger(__name__)

TICK_S = 1.0
MIN_GAP_S = 0.002
# inotify reports a close before the kernel drops the file's flock (__fput): a lease that a
# close of it left held is tried once more this much later (a later close comes otherwise).
RECHECK_S = 0.002
# After a hand-over on the last look (_hand_over), the full decision (everyone else's place,
# a new look) waits this long, or for a request: on 2 cores it took the CPU from the exec of
# the run just granted (record -> exec p95 2.7-5.3 ms against 1.5-2.2 without it).
FOLLOW_S = 0.005
MAX_CONNECTIONS_PER_UID = 1000  # as many runs as one user may have in the queue directory


class Service:
    def __init__(self, root: str, max_per_uid: int = MAX_CONNECTIONS_PER_UID, private_status: bool = False) -> None:
        self.root = root
        self.max_per_uid = max_per_uid
        self.private_status = private_status
        self.renamed = True  # lease files made or removed since the last look (sync): list them again
        self.line = Line(root)
        from pathlib import Path

        layout = Layout(Path(root))
        bookkeeping.background(layout)  # the ledger's state rewrites and fsyncs off this loop
        self.grants = Grants(self.line.leases, layout, _say)  # say: MPS's ACLs
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
        self._adopt()
        # The directories are root's now (servestart): what anyone opened before is worth nothing.
        self._renewed(self.grants.renew(self.grants.every_file()))
        self.comeback = Comeback(layout, self.notes, _say)

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

    def close(self) -> None:
        bookkeeping.finish()
        # The runs waiting now are those a successor waits for (those that left the line in
        # the last second are not, though a fall is written at most once a second).
        self.comeback.census.note(self.roster.ticketed, time.monotonic(), exact=True)
        for client in list(self.clients.values()):
            self._drop(client)
        if self.grants.confine is not None:
            self.selector.unregister(self.grants.confine.fileno())
        self.grants.close()  # [confine] runs: every run cgroup with no process left goes
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
        ready = self.selector.select(bookkeeping.idle_within(timeout))
        self.answers.idle.clear()
        if not ready:
            bookkeeping.idle()  # the ledger's state written, its fsync later (on the writer's thread)
        # One ledger turn for all of it, carried on to the next while hand-overs follow each
        # other: one state write, once the grants are sent (bookkeeping.turn).
        with bookkeeping.turn(self.grants.layout, carry=True):
            for key, mask in sorted(ready, key=_first):
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
                elif mask & selectors.EVENT_WRITE:
                    self._writable(key.data)
                else:
                    self._readable(key.data)
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
        bookkeeping.release(older_than=bookkeeping.CARRY_MAX_S)  # a look waits for its lock meanwhile
        self._answer()  # after the grants, and one a step: what is ready meanwhile comes first

    def _all_held(self) -> bool:
        """Whether every device is held through a grant whose client runs, as its lock says:
        then a tick's decision (over every waiter: ~20 ms with 1000) can grant nobody."""
        held = self.grants.holders()
        return (not self.grants.pending and not self.grants.lingering() and self.line.present <= held.keys()
                and self.line.queue.idle() and not any(self.line.leases.free_now(u) for u in self.line.present))

    def _tick_tickets(self, now: float) -> None:
        """A tick with nothing to decide: each waiter's ticket is still renewed in time."""
        self.last_decision = now
        for client in self._waiting():
            if now - client.ticket_at >= tickets.REFRESH_S and not self._tell(client, ""):
                self._drop(client)

    def _waiting(self) -> List[Client]:
        return list(self.roster.waiting.values())

    def _late(self, key: str, ignored: bool = False) -> None:
        """The grant KEY is past its deadline, or its client IGNORED it (service/stalls.py): void,
        unless its client's word is waiting unread (a long step, such as a burst of requests,
        can outlast the deadline by itself) or its locks are held all the same (a client that
        locked and has not said so: the lock is the truth, and its run is counted from it).
        One that ignored it is passed over, as runs deciding for themselves pass it over."""
        client = self.roster.by_key.get(key)
        if client is not None:
            self._readable(client)
        pending = self.grants.pending.get(key)
        if pending is None:
            return
        if client is not None and client.waiter is not None and pending.taken():
            self._held(client)
            return
        self._void(key)
        if ignored and client is not None and client.waiter is not None:
            self._pass_over(client)

    def _pass_over(self, client: Client) -> None:
        assert client.waiter is not None
        key, pid = client.waiter.key, client.peer.pid
        if not self.stalls.passed(key, client):
            self._fail(client, os.EX_TEMPFAIL, f"the cudawrap service: pid {pid} was granted devices twice "
                                                "and took them neither time", "run it again")
            return
        self.line.pass_over(key, client.peer.uid, time.monotonic())
        _say(f"pid {pid} (uid {client.peer.uid}) did not take the devices it was granted: "
             f"it and its user's other runs are passed over for {STALL_S:g} s")

    def _renewed(self, uuids: List[str]) -> None:
        """UUIDS' lease files were replaced (Grants.renew): a new look."""
        if uuids:
            self.line.touched(uuids)
            self.line.forget()
            self.dirty = True

    def _void(self, key: str) -> None:
        """Take back the grant KEY sent (if it is not taken): its leases are tried again, and decided on."""
        self.line.touched(self.grants.void(key))
        self.line.forget()
        self.dirty = True

    # -- connections ------------------------------------------------------------------------
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
            _say(str(outcome))  # "Slurm job 12: GPUs 0,1 here", or why Slurm could not say
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

    def _held(self, client: Client) -> None:
        assert client.waiter is not None and client.ask is not None
        pending = self.grants.confirm(client.waiter.key)
        if pending is None:
            self.line.touched()
            self._fail(client, os.EX_PROTOCOL, "the cudawrap service: the grant's locks are not held")
            self.dirty = True
            return
        if client.peer.pidfd >= 0:
            held = Held(client.peer.uid, client.peer.pid, os.dup(client.peer.pidfd), pending.devices,
                        client.ask.program, time.time(), lease_id=pending.lease_id, slots=pending.slots)
            self.grants.follow(held)
            self.selector.register(held.pidfd, selectors.EVENT_READ, held)
        self.line.held_by(client.peer.pid)
        self.stalls.end(client.waiter.key)
        # Only a share's client waits for this: follow() above opened the MPS pipe directory to it.
        client.send(wire.DONE, {})
        audit.log("grant", holder=user_name(client.peer.uid), pid=client.peer.pid, program=client.waiter.program,
                  devices=",".join(pending.devices), **({"shared": ",".join(pending.slots)} if pending.slots else {}),
                  via="service")
        _say(f"granted {'a share of ' if pending.slots else ''}{','.join(pending.devices)} to uid "
             f"{client.peer.uid} pid {client.peer.pid} ({client.waiter.program})"
             + (f", handed over as pid {pending.released_by} let go" if pending.released_by else ""))
        self.roster.left(client.sock.fileno(), client)
        client.waiter = None  # served: no longer waiting
        self._drop(client)

    def _question(self, client: Client, verb: str, fields: Dict[str, str]) -> None:
        """A status or cancel: answered once a step has done all else (_answer)."""
        refused = self.answers.over(client.peer.uid)
        if refused:
            self._fail(client, os.EX_TEMPFAIL, refused, UNREAD_HINT)
            return
        self.answers.ask(client, verb, fields)

    def _answer(self) -> None:
        """The next question asked, answered: as much of its answer sent as its socket takes
        now, the rest as the client reads (_writable)."""
        client = self.answers.next()
        if client is None or client.question is None:
            return
        refused = self.answers.over(client.peer.uid)  # its answers since it asked: worked out for nothing
        if refused:
            self._fail(client, os.EX_TEMPFAIL, refused, UNREAD_HINT)
            return
        from . import questions

        (verb, fields), asker = client.question, client.peer.uid
        reply: Union[Dict[str, str], CudawrapError]
        try:
            if verb == wire.CANCEL:
                waiting = {c.peer.pid: c for c in self._waiting()}
                chosen = questions.cancellable(fields.get("pids", ""), waiting, asker, self.private_status)
                by = user_name(asker)
                for victim in chosen:
                    _say(f"pid {victim.peer.pid} cancelled by {by}")
                    self._fail(victim, CANCELLED_EXIT, f"cancelled by {by}")
                reply = {"cancelled": ",".join(str(c.peer.pid) for c in chosen)}
            elif verb == wire.REVOKE:
                reply = self._revoke(asker, fields)
            else:
                seen = questions.Look(self.root, self.line, self.grants.claimed(), self.grants.holders(),
                                      list(self.grants.held.values()), self._waiting(), asker, self.private_status)
                self.dirty = self.dirty or seen.grants  # what it found grants someone: the loop decides next
                with_whole = fields.get("whole") == "1"
                # The rest (every waiter's place and why, the line's words, NVML, the ETAs) off the loop.
                self.answers.finish(client, {}, lambda pause: questions.reply(seen, with_whole, pause))
                return
        except CudawrapError as exc:
            reply = exc
        self._send_answer(client, reply)

    def _send_answer(self, client: Client, reply: Union[Dict[str, str], CudawrapError]) -> None:
        if isinstance(reply, CudawrapError):
            self._fail(client, reply.exit_code, reply.message, reply.hint or "")
            return
        asker = client.peer.uid
        data = answer_bytes(reply)
        refused = self.answers.over(asker, len(data))
        if refused:
            self._fail(client, os.EX_TEMPFAIL, refused, UNREAD_HINT)
        elif self.answers.send(client, data) is False:
            self.selector.modify(client.sock, selectors.EVENT_WRITE, client)  # the rest as it reads
        else:
            self._drop(client)

    def _writable(self, client: Client) -> None:
        if self.answers.sent(client) is not False:
            self._drop(client)  # all sent, or gone

    def _revoke(self, asker: int, fields: Dict[str, str]) -> Dict[str, str]:
        """`cudawrap revoke` (root's): each device's lease and slot files replaced, the grants
        holding it ended (their runs killed, where they still run: by pidfd, never a pid that
        may be another's now), those sent and not taken void."""
        from ..errors import NotPermitted

        if asker != 0:
            raise NotPermitted("only root may revoke a lease", hint="sudo cudawrap revoke DEVICE")
        by = fields.get("by") or user_name(asker)
        names = self.line.leases.names()
        uuids = [u for u in fields.get("devices", "").split(",") if u in names and u.startswith(("GPU-", "MIG-"))]
        ended: List[str] = []
        for uuid in uuids:
            holding, keys = self.grants.revoke(uuid, by)
            for key in keys:
                self._void(key)
            for held in holding:
                ended.append(f"{held.pid}:{held.uid}:{'exited' if held.exited else 'killed'}")
                if held.exited:
                    self.grants.check(held)  # its end recorded now: nothing else holds the new file
                else:
                    _kill(held.pidfd)  # its exit, read next, ends the grant (_exited)
            _say(f"{uuid} revoked by {by}" + (f" from pid {holding[0].pid} (uid {holding[0].uid})" if holding else ""))
        self._renewed(uuids)
        self.freed = True
        return {"revoked": ",".join(uuids), "holders": ",".join(ended), "service": str(os.getpid())}

    # -- the machine ------------------------------------------------------------------------
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

    def _decide(self) -> None:
        self.last_decision = time.monotonic()
        self.dirty = self.freed = False
        if self.comeback.in_grace(self.last_decision):
            return  # nobody is granted before the runs that waited are back (service/tickets.py)
        self.stalls.renew(self.line, self.last_decision)
        waiting = {c.waiter.key: c for c in self._waiting()
                   if c.waiter is not None and c.waiter.key not in self.grants.pending}
        if not waiting:
            return
        verdicts = self.line.decide([c.waiter for c in waiting.values() if c.waiter is not None],
                                    self.grants.claimed(), self.grants.holders(), carry=True)
        # The grants are sent first: the decision has worked the line out only as far as its
        # last grant, and the others' verdicts (most of the work with 1000 waiting: their
        # places, why each waits) come after, while the runs granted start.
        for key, verdict in verdicts.items():
            client = waiting.get(key)  # or a queue entry's: a run deciding for itself takes its own
            if client is not None and verdict.kind == GRANTED and not self._offer(client, list(verdict.devices)):
                self._drop(client)
        verdicts.finish()
        now = time.monotonic()
        for client in waiting.values():
            assert client.waiter is not None and client.ask is not None
            verdict = verdicts.get(client.waiter.key)
            if verdict is None or verdict.kind == GRANTED:
                continue
            unreachable = self.line.unreachable(client.waiter)
            if unreachable is not None:  # drained or lost since it asked: told at once, as without the service
                self._fail(client, unreachable.exit_code, unreachable.message, unreachable.hint or "")
            elif client.ask.wait <= 0 or now >= client.wait_until:
                self._timed_out(client, verdict)
            elif verdict.kind != client.told:
                client.told = verdict.kind
                if not self._tell(client, f"waiting for a device: {verdict.text} (pid {client.peer.pid})"):
                    self._drop(client)
            elif now - client.ticket_at >= tickets.REFRESH_S and not self._tell(client, ""):
                self._drop(client)

    def _offer(self, client: Client, devices: List[str]) -> bool:
        """Send CLIENT the grant of DEVICES: of a share of each that has slots, for a shared
        run (as a run deciding for itself takes them: Acquirer._take). False if the client is
        gone; a share that cannot be had now (its slots taken past the line since, or under MPS
        another user's work found there) stays waiting."""
        assert client.waiter is not None and client.ask is not None
        ask, slots = client.ask, self.line.acquirer.slots
        shared = [u for u in devices if ask.share and slots.get(u, 1) > 1]
        if not self.line.joinable(shared, client.peer.uid):
            self.dirty = True  # NVML was read again: the next decision sees who is there
            return True
        chosen = self.grants.free_slots(shared, slots)
        if chosen is None:  # taken since the decision, or not made yet (sync makes slot files)
            if ask.wait <= 0 or time.monotonic() >= client.wait_until:
                self._fail(client, os.EX_TEMPFAIL, f"no free device: no slot of {','.join(shared)} is free now",
                           "try again later, or set CUDAWRAP_WAIT=SECONDS")
            return True
        sharing = self.line.acquirer.sharing
        self.line.touched(devices)  # claimed now (decide() counts them held), tried again once let go
        fields = ask.variables(self.root, shared, self.line.acquirer.current, slots)
        if client.told:  # told it waits: then what it got and after how long, as a run deciding for itself says
            fields["text"] = f"got {','.join(devices)} after {max(0.0, time.time() - client.waiter.arrival):.1f} s"
        if not self.grants.offer(client.sock, client.waiter.key, client.peer.pid, client.peer.uid, devices,
                                 ask.program, client.waiter.arrival, chosen, fields,
                                 sum(sharing.cost(slots.get(u, 1)) for u in devices), client.ticks, client.exe):
            return False
        self.stalls.offered(client, time.monotonic())  # judged from now on (service/stalls.py)
        return True

    def _timed_out(self, client: Client, verdict: Verdict) -> None:
        assert client.ask is not None
        if client.ask.wait <= 0:
            self._fail(client, os.EX_TEMPFAIL, f"no free device: {verdict.text}; waiting is off (wait = 0)",
                       "set CUDAWRAP_WAIT=SECONDS to wait")
        else:
            self._fail(client, os.EX_TEMPFAIL, f"no device within {client.ask.wait:g} s: {verdict.text}",
                       "try again later, or set CUDAWRAP_WAIT=SECONDS")


def _first(ready: "tuple[selectors.SelectorKey, int]") -> int:
    """The order a step reads what is ready in: a run's exit first, so that its hand-over
    (on the last look: _hand_over) waits for nothing else read this step; then the files'
    news, so that a request in the same step is read with the lease files as they are."""
    data = ready[0].data
    return 0 if isinstance(data, Held) else 1 if data == "watch" else 2


def _hung_up(client: Client) -> bool:
    """Whether CLIENT's end of its connection is closed (nothing more to read, nobody to answer)."""
    try:
        return client.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except OSError:
        return False  # nothing to read yet (EAGAIN): still there


def _say(line: str) -> None:
    """A line for the journal (or the --daemon log): the service's own account of what it did."""
    print(f"cudawrap serve: {line}", flush=True)


def _kill(pidfd: int) -> None:
    """SIGKILL to the process PIDFD follows (gone already: nothing)."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
