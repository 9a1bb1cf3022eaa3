"""The service's questions (status, cancel): answered after the grants, never waited on.

The service has one loop, and everyone's grants go through it. A status with 900 runs
waiting costs the loop milliseconds to work out and is ~640 KB to send, more than a socket
takes at once; sent whole, with a timeout, a client that asked and never read held every
hand-over behind it (116-141 s behind 900 such connections: issue 51). So a question waits
until a step has done everything else (the grants, the hand-overs), one is answered a step,
and its answer goes out as the client reads it: what its socket does not take now is kept,
and sent as the socket becomes writable. A whole status (NVML read, every run's ETA worked
out: 150-200 ms with 900 waiting) is finished on a thread of its own (finish()), one at a
time, while the loop goes on; so is every status's line (each waiter's place and why, and
its words: ~30 ms with 900 waiting), from what the loop saw (questions.Look). That thread
waits between the steps of its work while the loop works (pause), runs at a lower nice,
and gives the interpreter back within SWITCH_S (a hand-over's every system call lets it
go to that thread). What a user may have unsent at once is bounded
(MAX_UNSENT: one answer of the largest size); a question past it is refused with an error
line, and an answer of which its client takes nothing for ANSWER_S is dropped with the
connection. Root's are not bounded, as root's connections are not.
"""
from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple, Union

from .. import wire
from ..base.wakepipe import WakePipe
from ..errors import CudawrapError
from .connection import ANSWER_S, Client

# The interpreter's switch interval in the service (5 ms by default): a thread working out
# an answer keeps the loop waiting at most this long each time the loop wants to run again,
# and a hand-over wants to many times (each system call lets the interpreter go).
SWITCH_S = 0.0005
# And between the steps of its work, that thread waits while the loop has work of its own
# (a step under way), at most this long each time: a hand-over is not shared with it.
PAUSE_S = 0.05
NICE = 10  # the answering thread's nice (the loop's is the service's)
MAX_UNSENT = wire.MAX_ANSWER  # per user: bytes of answers its clients have not taken
UNREAD_HINT = "read the answers your connections asked for, or close them"


class Answers:
    def __init__(self) -> None:
        # uid -> its questions to answer, in the order they came; users take turns (next()).
        self.asked: Dict[int, Deque[Client]] = {}
        self.sending: Dict[int, Client] = {}  # socket fd -> a client with an answer partly sent
        self.unsent: Dict[int, int] = {}  # uid -> the bytes of its answers not sent yet
        self.last = 0  # the size of the last answer sent
        self.working: Optional[Client] = None  # the client whose answer a thread is finishing
        self._finished: "queue.Queue[Tuple[Client, Union[Dict[str, str], CudawrapError]]]" = queue.Queue()
        self._wake = WakePipe()
        sys.setswitchinterval(SWITCH_S)
        self.idle = threading.Event()  # set while the loop waits for something to do (Service.step)

    def pause(self) -> None:
        """On the answering thread, between two steps of its work: wait while the loop works."""
        self.idle.wait(PAUSE_S)

    def fileno(self) -> int:
        """Readable once an answer finish() began is finished (finished())."""
        return self._wake.fileno()

    def ready(self) -> bool:
        """Whether a question can be answered now: one is waiting, and no thread is busy."""
        return bool(self.asked) and self.working is None

    def over(self, uid: int, size: int = 0) -> Optional[str]:
        """Why UID may not be sent an answer of SIZE bytes now (None: it may). Without a
        SIZE, the last answer's stands for it: asked before an answer is worked out, so that
        a user at its bound costs the loop no answer that is then refused."""
        unsent = self.unsent.get(uid, 0)
        if uid == 0 or not unsent or unsent + (size or self.last) <= MAX_UNSENT:
            return None
        return (f"your connections have {unsent} bytes of the cudawrap service's answers unread, "
                f"the most one user may have")

    def ask(self, client: Client, verb: str, fields: Dict[str, str]) -> None:
        """CLIENT's question, to be answered once the step has done all else."""
        client.question = (verb, fields)
        self.asked.setdefault(client.peer.uid, deque()).append(client)

    def next(self) -> Optional[Client]:
        """The next question's client still connected (forget() drops the others), once no
        answer is being finished: the users with questions take turns, so that one asking
        on a thousand connections delays nobody else's answer by more than one."""
        while self.asked and self.working is None:
            uid = next(iter(self.asked))
            mine = self.asked.pop(uid)
            client = mine.popleft()
            if mine:
                self.asked[uid] = mine  # last, behind the other users'
            if client.question is not None and client.sock.fileno() >= 0:
                return client
        return None

    def finish(self, client: Client, reply: Dict[str, str],
               work: Callable[[Callable[[], None]], Dict[str, str]]) -> None:
        """CLIENT's REPLY, with WORK's fields added on a thread (it reads nothing the loop
        changes; it calls the pause it is given between its steps): finished() gives it, or
        the CudawrapError WORK raised."""
        self.working = client

        def run() -> None:
            try:  # on Linux a thread's own nice: the loop, and the runs, get the CPU first
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
            except OSError:
                pass
            try:
                done: Union[Dict[str, str], CudawrapError] = dict(reply, **work(self.pause))
            except CudawrapError as exc:
                done = exc
            except Exception as exc:  # a bug of ours: said, and the next question is answered all the same
                done = CudawrapError(f"the cudawrap service could not work out its answer: {exc!r}")
            self._finished.put((client, done))
            self._wake.wake()

        threading.Thread(target=run, name="answer", daemon=True).start()

    def finished(self) -> List[Tuple[Client, Union[Dict[str, str], CudawrapError]]]:
        """The answers finish() finished, each for a client still connected."""
        self._wake.drain()
        out = []
        while True:
            try:
                client, done = self._finished.get_nowait()
            except queue.Empty:
                return out
            self.working = None
            if client.question is not None:
                out.append((client, done))

    def send(self, client: Client, data: bytes) -> Optional[bool]:
        """Start sending CLIENT's answer DATA: True once sent whole, False while some is left
        (send the rest as its socket becomes writable: sent()), None when it is gone."""
        client.unsent, self.last = data, len(data)
        client.stalled_at = time.monotonic()
        done = client.flush()
        if done is False:
            self.sending[client.sock.fileno()] = client
            self.unsent[client.peer.uid] = self.unsent.get(client.peer.uid, 0) + len(client.unsent)
        return done

    def sent(self, client: Client) -> Optional[bool]:
        """CLIENT's socket is writable: more of its answer, as send() says."""
        before = len(client.unsent)
        done = client.flush()
        self._count(client, len(client.unsent) - before if done is not None else -before)
        if done is not False:
            self.sending.pop(client.sock.fileno(), None)
        return done

    def forget(self, client: Client) -> None:
        """CLIENT is closed: its question unanswered, its answer unsent, are nobody's."""
        client.question = None
        if self.sending.get(client.sock.fileno()) is client:
            del self.sending[client.sock.fileno()]
            self._count(client, -len(client.unsent))
        client.unsent = b""

    def _count(self, client: Client, change: int) -> None:
        uid = client.peer.uid
        left = self.unsent.get(uid, 0) + change
        if left > 0:
            self.unsent[uid] = left
        else:
            self.unsent.pop(uid, None)

    def stale(self, now: float) -> List[Client]:
        """The clients that have taken nothing of their answers for ANSWER_S."""
        return [c for c in self.sending.values() if c.stalled_at + ANSWER_S <= now]

    def due(self) -> float:
        """When the next answer goes stale, if its client reads nothing meanwhile."""
        return min((c.stalled_at + ANSWER_S for c in self.sending.values()), default=float("inf"))
