"""A queued run listening between two full looks: what each batch of events on what it
watches tells it (a full look now, wait on, or its devices, taken on its last look amended by
the events), and whether a poke may be true.

Apart from waiting.py, which decides when to look and what to watch, because this is the other
half of a wait: reading events. Loaded with it, once a run must queue.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Callable, Dict, List, Optional, Set, Tuple, Union

    from .acquirer import Acquirer
    from .terms import Verdict

    # `waiting: Waiting` names waiting.py's class, which imports this module: never imported
    # here, not even for type checking (the layers contract allows no circle).

from ..base import inotify
from ..lease.files import Lease
from .decision import WATCHERS
from .handover import after_release, amend, amendments, hand_over, signature
from .schedule import GRANTED

# A look amended by events (a lease released, a run that left) serves at most this long.
AMEND_S = 10.0
# A poke of a run behind the watchers is worth a look (within waiting.POKED_LOOKS) once this
# long has passed since its last look, whatever else it says.
POKE_IDLE_S = 2.0
MOVED_UP, FREE = "moved up", "free"
# What one batch of events tells the waiting loop: a full look now, or wait on.
LOOK, WAIT = "look", "wait"


class Listen:
    """One wait of WAITING (a waiting.Waiting) for events, up to TIMEOUT: decided on its
    look amended by them where they allow it (sets waiting.lease when its turn came)."""

    def __init__(self, waiting: Waiting, timeout: float) -> None:
        self.waiting = waiting
        self.until = waiting.clock() + timeout
        self.released: Set[str] = set()  # lease files closed since this look
        self.departed: Set[str] = set()  # queue entries removed since
        self.decided_on = signature(waiting.scan)  # what the verdicts were last decided on
        self.pending = False  # another run's turn on what was amended: it should leave soon
        self.outdated = False  # a newcomer or a lock maybe taken since the look
        self.poke_due = False  # a poke worth a look once POKED_LOOKS allows

    def run(self) -> None:
        """Listen until a full look is due (or the wait's lease is taken)."""
        w = self.waiting
        assert w.own is not None
        while True:
            left = (min(self.until, w.clock() + 0.1) if self.pending else self.until) - w.clock()
            ready = w.poller.poll(left * 1000) if left > 0 else []
            if not ready:
                if self.poke_due:
                    w.looks.spend()
                    w.poked = True
                return  # time for a full look
            if w.wake.woken(ready) and w.acq.foreign_left():
                return  # a device is free of what kept it from us: a full look
            # A job ended (its lease file closed) or a run left the queue: decide on this
            # look, amended by what the events say, and take our turn at once (a full
            # look instead if a newcomer came or a lease file was opened since: the look
            # may be out of date). A cancel or an old look: a full look at once. A
            # newcomer or a lease file opened alone cannot make it our turn: a full
            # look only within REFRESH_LOOKS, for a fresh look at the next release.
            budget = w.batches if w.watcher else w.pokes
            budget.pause()  # a storm of events that change nothing: read them in one batch
            events = [e for e in w.own.events() if e[0] not in w.removed]
            if not events:
                continue  # only what watches we removed saw (and IN_IGNORED for them)
            outcome = self.poked(events) if not w.watcher else self.amended(events)
            if outcome == LOOK:
                return
            if isinstance(outcome, Lease):
                w.lease = outcome
                return
            if outcome == WAIT:
                budget.spend()

    def poked(self, events: List[Tuple[int, int, str]]) -> str:
        """Behind the watchers, EVENTS on our entry: a full look now, or wait on."""
        w = self.waiting
        if any(mask != inotify.IN_OPEN for _wd, mask, _name in events):
            return LOOK  # our entry written (a cancel), or events lost
        # Poked: someone's look says we moved up or were given devices, if
        # the poke is true (anyone may open our entry).
        worth = poke_worth(w.acq, w.clock, w.looked_at, w.verdicts, w.entry.name, w.free)
        if worth == MOVED_UP:
            w.poked = True
            return LOOK
        if worth is not None:
            due = w.looks.ready_at()
            if due <= w.clock():
                w.looks.spend()
                w.poked = True
                return LOOK
            self.until, self.poke_due = min(self.until, due), True
        return WAIT

    def amended(self, events: List[Tuple[int, int, str]]) -> Union[str, Lease]:
        """A watcher's EVENTS: a full look now, wait on (WAIT: they changed nothing; "": they
        did), or our lease, taken on our look amended by them."""
        w = self.waiting
        seen = amendments(events, w.world)
        if seen is None or w.clock() - w.looked_at > AMEND_S:
            return LOOK
        if seen[3] and not self.outdated:
            self.outdated = True
            due = w.refresh.ready_at()
            if due <= w.clock():
                w.refresh.spend()
                return LOOK
            self.until = min(self.until, due)  # (and a full look then, as any look past UNTIL)
        poke = seen[2] and poke_worth(w.acq, w.clock, w.looked_at, w.verdicts, w.entry.name, w.free) is not None
        if not (seen[0] or seen[1] or poke):
            return WAIT  # nothing freed, left or said: nothing to decide on
        self.released |= seen[0]
        self.departed |= seen[1]
        amended = amend(w.acq, w.scan, self.released, self.departed, w.verdicts)
        signed = signature(amended)
        if signed == self.decided_on:
            # Nothing freed, taken or left since the verdicts (a run that took its
            # device closing the other lease files, a holder's probe): they stand.
            # Eight watchers deciding again on each such event kept the one whose
            # turn it was off the CPU for milliseconds.
            self.pending = self.pending or poke
            return WAIT
        if self.outdated:
            return LOOK  # something freed or left, on a look that may be out of date
        self.decided_on = signed
        assert w.me is not None
        w.verdicts, outcome = after_release(w.acq, amended, w.me, w.entry.name, self.released)
        if outcome is not None:
            hand_over(w.acq, w.verdicts, w.scan, w.entry.name)
            return outcome
        if w.verdicts[w.entry.name].kind == GRANTED:
            return LOOK  # our turn, and the race for the locks lost: a full look
        # Another run's turn: it takes its devices and leaves the queue (an event);
        # should it not within 0.1 s, a full look (which passes it over once
        # it ignores its turn: turns.py). Poked, though not our turn here: a full look as soon, as the
        # poker's look may be newer. Nobody's turn: the look stands, keep waiting.
        self.pending = poke or any(v.kind == GRANTED for k, v in w.verdicts.items() if k != w.entry.name)
        return ""


def poke_worth(acq: Acquirer, clock: Callable[[], float], looked_at: float, verdicts: Dict[str, Verdict], me: str,
               free: List[str]) -> Optional[str]:
    """Whether a poke (ME's entry opened) may be true, and why: pokes are sent when a run
    moved into the watching places or was given devices, and anyone can open its entry in a
    loop. MOVED_UP (look now): fewer than WATCHERS of the runs ahead of it at the look are
    left, or a device it may use (of ACQ's candidates) was freed since the look (FREE at the
    look, a list of devices); neither can be faked, as nobody can remove another's entry or
    free another's lease. FREE (look within POKED_LOOKS): a device it may use is free, as it
    was at the look, or the look LOOKED_AT is POKE_IDLE_S old by CLOCK (a turn moved by a
    lease taken or let go elsewhere). None: a poke that cannot be true."""
    mine = verdicts.get(me)
    if mine is not None and mine.position >= WATCHERS:
        ahead = {k for k, v in verdicts.items() if v.position < mine.position}
        try:
            left = len(ahead.intersection(os.listdir(acq.queue.dir)))
        except OSError:
            left = 0
        if left < WATCHERS:
            return MOVED_UP
    vacant = [d.uuid for d in acq.candidates if d.uuid not in acq.lost and acq.vacant(d.uuid)]
    if any(u not in free for u in vacant):
        return MOVED_UP
    if vacant or acq.request.share or clock() - looked_at >= POKE_IDLE_S:
        return FREE
    return None
