"""Questions (status, cancel, revoke) answered, a part of the service's loop (loop.Service).

A question is answered once a step has done all else, one a step (the grants come first);
a status's look is taken on the loop and the rest worked out off it (answers.py), and an
answer is sent as its client reads it: the loop never waits on a client.

Apart from the loop's select and step (loop.py), which it shares its state with: this is
what the service tells of itself and what root may end, that is when it is answered.
"""
from __future__ import annotations

import os
import selectors
import signal
from typing import Dict, List, Union

from .. import wire
from ..base.users import user_name
from ..errors import CudawrapError
from ..ops.cancel import CANCELLED_EXIT
from .answers import UNREAD_HINT
from .connection import Client, answer_bytes
from .journal import say


class Answering:
    """Status, cancel and revoke, answered (a part of loop.Service)."""

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
                    say(f"pid {victim.peer.pid} cancelled by {by}")
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
            say(f"{uuid} revoked by {by}" + (f" from pid {holding[0].pid} (uid {holding[0].uid})" if holding else ""))
        self._renewed(uuids)
        self.freed = True
        return {"revoked": ",".join(uuids), "holders": ",".join(ended), "service": str(os.getpid())}


def _kill(pidfd: int) -> None:
    """SIGKILL to the process PIDFD follows (gone already: nothing)."""
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except OSError:
        pass
