"""The decisions and the grants they send, a part of the service's loop (loop.Service).

A decision (Line.decide over every waiter and the queue's entries) sends its grants first,
then tells the others why they wait, or that their wait is over; a grant sent is followed
until its client says it holds it (HELD, or its connection closed in the exec), void at its
deadline unless its locks are held all the same, and a client that ignores its grants is
passed over (service/stalls.py).

Apart from the loop's select and step (loop.py), which it shares its state with: this is
who gets what and what they are told, that is when it is decided.
"""
from __future__ import annotations

import os
import selectors
import time
from typing import List

from .. import wire
from ..base import audit
from ..base.users import user_name
from ..sched.schedule import GRANTED, Verdict
from ..sched.turns import STALL_S
from . import tickets
from .connection import Client
from .grants import Held
from .journal import say


class Granting:
    """Decisions, and the grants they send (a part of loop.Service)."""

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
        say(f"pid {pid} (uid {client.peer.uid}) did not take the devices it was granted: "
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
        say(f"granted {'a share of ' if pending.slots else ''}{','.join(pending.devices)} to uid "
             f"{client.peer.uid} pid {client.peer.pid} ({client.waiter.program})"
             + (f", handed over as pid {pending.released_by} let go" if pending.released_by else ""))
        self.roster.left(client.sock.fileno(), client)
        client.waiter = None  # served: no longer waiting
        self._drop(client)

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
        run (as a run deciding for itself takes them: Acquirer.take_exactly). False if the client is
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
