"""Waiting in the queue for a turn: imported only once a run must queue (see acquirer.py).

No daemon: each waiter decides for itself. So that hundreds of waiters cost nothing while
nothing changes, only the first few in line (WATCHERS) watch the lease and queue
directories through inotify; the others sleep until one of those pokes them (opens their
entry, which they watch) because they moved up or were given devices. Between full looks a
watcher decides on its last look amended by the events since (handover.py), as it
listens for them (listening.py).
"""
from __future__ import annotations

import os
import select
import signal  # waiting only: `signal` pulls in enum (~5 ms)
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Callable, Dict, List, Optional, Set

    from .terms import Verdict, Waiter

from ..base import inotify
from ..errors import Interrupted, NoDeviceError
from ..lease.files import Lease
from .acquirer import Acquirer
from .decision import WATCHERS, Cancelled, Decision, jitter
from .budget import Budget
from .farwait import FarWait
from .foreignwake import ForeignWake
from .handover import hand_over
from .listening import Listen
from .queue import Entry, Scan
from .schedule import GRANTED

IDLE_S = 30.0
# A run behind the watchers counts those ahead of it this often, in case no poke came.
NEAR_CHECK_S = 1.0
# Only the first NEAR in line keep an inotify instance (to be poked): Linux allows a user 128
# (fs.inotify.max_user_instances), and a batch of 500 runs must not use them all up, leaving
# the runs at the head to poll. Those further back (or without an instance) sleep until runs
# leave the queue (farwait: dnotify, or the directory's mtime polled), at most once every
# FAR_POLL_S x (their position / 100), at least FAR_POLL_S; then they count how many of the
# runs ahead at their last look have left (one listing, no lock table) and decide again once
# fewer than NEAR are left, or IDLE_S x (position / NEAR) after their last decision (500
# waiters looking every 30 s would cost a quarter of a core).
NEAR = 48
FAR_POLL_S = 1.0
# A watcher re-looks this often even without events (NVML state has no event to watch).
WATCH_S = 1.0
# Batches of events that changed nothing, at most this many a second after a burst of
# (rate, burst): anyone can open a lease file or a queue entry in a loop (1000 a second made
# the waiters of others use a core), and each batch costs a waiter the same as one event.
# Past that, events wait to be read in one batch: a release 1/rate at most (a watcher);
# a poke of a run behind the watchers (who wait for nothing sooner) longer.
IDLE_BATCHES = (50.0, 10)
IDLE_POKES = (10.0, 3)
# A run behind the watchers, poked: it looks at once if fewer than WATCHERS of the runs
# ahead of it at its last look are left (they cannot be faked: nobody can remove another's
# entry); if a device it may use is free (maybe given to it), (rate, burst) at most; any
# poke once listening.POKE_IDLE_S has passed since its last look.
POKED_LOOKS = (2.0, 3)
# A watcher whose look a newcomer or a lease file opened may have outdated looks again at
# once (rate, burst) at most, so that the release that follows is amended on a fresh look
# (a burst of launches); past that, the release is decided on a full look.
REFRESH_LOOKS = (2.0, 3)
# Without inotify (out of watches) the watchers poll this often.
POLL_S = 0.02


def _raise_signal(signum: int, frame: object) -> None:
    raise Interrupted("interrupted while waiting for a device", exit_code=128 + signum)


class Waiting:
    """One queued run's wait for its turn: ENTRY in the queue until DEADLINE (WAIT_S after
    it asked), FIRST the verdict it queued on, AHEAD the runs ahead of it then."""

    def __init__(self, acq: Acquirer, entry: Entry, deadline: float, wait_s: float,
                 on_wait: Optional[Callable[[str], None]], first: Verdict, ahead: Set[str]) -> None:
        self.acq = acq
        self.clock = acq.clock
        self.entry = entry
        self.deadline = deadline
        self.wait_s = wait_s
        self.on_wait = on_wait
        self.first = first
        self.previous: Dict[int, object] = {}  # the signal handlers ours replaced
        self.own: Optional[inotify.Watch] = None  # one inotify instance: our entry, and the machine while a watcher
        self.world: List[int] = []  # its watches on the lease and queue directories
        # Watches of `own` removed since (the kernel never reuses a watch descriptor within
        # an instance): what they still report happened while unwatched, and is no news.
        self.removed: Set[int] = set()
        self.poller = select.poll()
        self.wake = ForeignWake(self.poller, acq.snapshot)  # processes cudawrap did not start, leaving
        # The newcomer decided just before it queued: far back, it need not decide again
        # until the queue changes (a full look at 500 entries is ~10 ms, and each arrival of a
        # batch would otherwise pay it twice).
        self.position = self.placed = first.position
        self.last_decision = self.clock() if self.position >= NEAR else 0.0
        self.looked_at = self.clock()  # the newcomer's look (each full look sets it anew)
        self.before: Optional[Set[str]] = ahead  # the runs ahead of us at our last look
        self.far: Optional[FarWait] = None  # far back: woken when runs leave the queue
        self.poked = False  # woken while not watching by a poke: we moved up, or were given devices
        self.lost_race = False  # our look gave us devices and another run locked them first: look again
        # Once devices are reserved for us (policy reserve_after) we move up: look then.
        self.reserve_at = self.clock() + acq.request.reserve_after
        self.told = ""  # the kind of wait last reported
        self.verdicts: Dict[str, Verdict] = {}
        self.free: List[str] = []
        self.scan = Scan([], {}, {})
        self.me: Optional[Waiter] = None
        self.watcher = False
        self.lease: Optional[Lease] = None  # taken: the wait is over
        # For events that change nothing:
        self.batches, self.pokes = Budget(*IDLE_BATCHES, self.clock), Budget(*IDLE_POKES, self.clock)
        self.looks = Budget(*POKED_LOOKS, self.clock)  # for pokes that may be true, behind the watchers
        self.refresh = Budget(*REFRESH_LOOKS, self.clock)  # for looks outdated by a newcomer or a lease file opened

    def run(self) -> Lease:
        """Wait until our turn comes and our devices are taken; leave the queue in any case."""
        for s in (signal.SIGTERM, signal.SIGHUP):
            try:
                self.previous[s] = signal.signal(s, _raise_signal)
            except ValueError:  # not the main thread: the caller keeps its own handlers
                pass
        try:
            if self.on_wait is not None:  # inside the try: a Ctrl-C from here on leaves the queue clean
                self.on_wait(self.first.text)  # what the newcomer's own decision said; later, what changed
            self.told = self.first.kind
            while self.lease is None:
                self._round()
            return self.lease
        except KeyboardInterrupt:
            raise Interrupted("interrupted while waiting for a device") from None
        finally:
            self._close()

    def _close(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self.acq.queue.leave(self.entry)
        if self.own is not None:
            self.own.close()
        if self.far is not None:
            self.far.close()
        self.wake.close()

    def _round(self) -> None:
        """One turn of the wait: a look and a decision, then sleep until something may have
        changed (or, far back, until enough runs ahead have left)."""
        now = self.clock()
        self._check(now)
        # After a lost race the next look comes at once, wherever we are in line: devices were
        # free for us, and others may be. Asleep behind the runs ahead instead, as if told to
        # wait, a run lost up to IDLE_S (500 waiters: seven losers at once left freed devices
        # idle ~25 s, their next looks due only then).
        lost_race, self.lost_race = self.lost_race, False
        if not lost_race and self._far_asleep(now):
            return
        if not lost_race and self._near_asleep(now):
            self._listen(min(NEAR_CHECK_S, max(0.0, self.deadline - now)), again=True)
            return
        if self._decide(now):
            return
        if self._rewatch():
            return
        timeout = self._timeout(now)
        if self.own is None and not self.watcher:
            return  # to the far wait
        if self.own is None:
            time.sleep(timeout)
            return
        # A process that exits between our look and its pidfd wakes nothing: read free since
        # the look (warm's re-read), or gone before it is followed, it is a full look now.
        if self.watcher and self.acq.foreign_freed():
            return
        if self.wake.follow(self.acq.foreign_pids() if self.watcher else ()) and self.acq.foreign_left():
            return
        self._listen(timeout)

    def _check(self, now: float) -> None:
        """Raise if our entry was cancelled or our time is up."""
        by = self.acq.queue.cancelled_by(self.entry)
        if by is not None:
            raise Cancelled(f"cancelled by {by}")
        if now >= self.deadline:
            key, wait_s = self.entry.name, self.wait_s
            raise NoDeviceError(f"no device within {wait_s:g} s: {self.verdicts[key].text}"
                                if key in self.verdicts else f"no device within {wait_s:g} s",
                                hint="try again later, or set CUDAWRAP_WAIT=SECONDS")

    def _far_asleep(self, now: float) -> bool:
        """Far back (or no inotify): decide again only once enough of those ahead of us at
        our last look have left; asleep until a run leaves the queue. True: not yet."""
        position = self.position
        if not (self.own is None and position >= WATCHERS and now < self.reserve_at
                and now - self.last_decision < IDLE_S * max(1.0, position / NEAR)):
            return False
        if self.far is None:
            self.far = FarWait(self.acq.queue.dir)
        moved = self.far.moved()
        if moved:
            departed = self._departed()
            if departed is None:
                departed = len(self.before or ())  # (all gone: decide)
            self.position = position = max(0, self.placed - departed)
        if not moved or position >= NEAR:
            self.far.wait(FAR_POLL_S * max(1.0, position / 100),
                          min(self.last_decision + IDLE_S * max(1.0, position / NEAR), self.reserve_at,
                              self.deadline) - now,
                          moved)
            return True
        return False

    def _near_asleep(self, now: float) -> bool:
        """Behind the watchers, with an inotify instance (so woken by pokes): whether at
        least WATCHERS of the runs ahead of us at our last look are still queued (one
        listing, no look). Pokes move a run into the watching places at once; this is the
        net under them, every NEAR_CHECK_S: a line turning over fast (its leavers each
        poke the same few) once left freed devices idle for the IDLE_S a near run waits."""
        if not (self.own is not None and not self.watcher and self.position >= WATCHERS and not self.poked
                and now - self.last_decision < IDLE_S and now < self.reserve_at and self.verdicts):
            return False
        departed = self._departed()
        return departed is not None and len(self.before or ()) - departed >= WATCHERS

    def _departed(self) -> Optional[int]:
        """How many of the runs ahead of us at our last look have left the queue (one
        listing); None where it cannot be listed. Junk can only add names, never remove
        those we counted."""
        if self.before is None:
            self.before = {k for k, v in self.verdicts.items() if v.position < self.placed}
        try:
            listed = os.listdir(self.acq.queue.dir)
        except OSError:
            return None
        return len(self.before.difference(listed))

    def _decide(self, now: float) -> bool:
        """A full look and a decision on it; True to look again at once (or our lease taken)."""
        acq, entry = self.acq, self.entry
        if now >= self.reserve_at:
            self.reserve_at = float("inf")  # devices are reserved for us from now: one look to see it
        if self.far is not None:
            self.far.moved()  # what happens from this look on counts for the next far wait
        self.last_decision = now
        self.before = None
        # Watch before looking where this look will probably say so (the place we
        # expect; a poke says we moved up): what changes during the look is then an
        # event, and the look need not be made again once the watch exists (~10 ms at
        # 500 waiters, paid by every run moving up).
        if self.own is None and self.position < NEAR:
            self.own = self._watch_entry()
        if self.own is not None and not self.world and (self.position < WATCHERS or self.poked):
            self.world = self._watch_world(self.own)
        self.poked = False
        scan = self.scan = acq.queue.scan(mine=entry.name)
        me = next((w for w in scan.waiters if w.key == entry.name), None)
        if me is None:  # our entry is not seen as valid (cannot happen unless tampered with)
            me = acq.waiter_of(entry.name)
            self.verdicts, self.free = acq.decide(scan, me, queued=False)
        else:
            # What we ask for, we know first-hand; the entry says the same to others.
            me.request = acq.request
            self.verdicts, self.free = acq.decide(scan, me, queued=True)
        self.me = me
        verdict = self.verdicts[entry.name]
        self.position = self.placed = verdict.position
        acq.observe(Decision.LOOK, entry.name, self.verdicts, self.free)
        if verdict.kind == GRANTED:
            self.lease = acq.take_exactly(verdict.devices)
            if self.lease is not None:
                hand_over(acq, self.verdicts, scan, entry.name)
                return True
            jitter()
            self.lost_race = True
            return True
        unreachable = acq.unreachable([d.uuid for d in acq.candidates], acq.request.count)
        if unreachable is not None:
            raise unreachable
        if verdict.kind != self.told:
            if self.on_wait is not None:
                self.on_wait(verdict.text)
            self.told = verdict.kind
        return acq.watch_others(self.verdicts, scan, entry.name)

    def _rewatch(self) -> bool:
        """Watch what our place in line calls for; True to look again at once (something may
        have changed before a new watch existed)."""
        position = self.position
        if position < NEAR and self.own is None:
            self.own = self._watch_entry()
            if self.own is not None:
                return True  # something may have changed before the watch existed
        elif position >= NEAR and self.own is not None:
            self.poller.unregister(self.own.fileno())
            self.own.close()  # give the instance back for those nearer the head
            self.own, self.world = None, []
            self.removed = set()
        self.watcher = watcher = position < WATCHERS
        if watcher:
            self.acq.warm()  # a hand-over may come next: its NVML start-up is paid now, not then
        if watcher and self.own is not None and not self.world:
            self.world = self._watch_world(self.own)
            return True  # something may have changed before the watch existed
        if not watcher and self.world and self.own is not None:
            for wd in self.world:
                self.own.remove(wd)
            self.removed.update(wd for wd in self.world if wd >= 0)  # (-1: never added; -1 also marks an overflow)
            self.world = []
        return False

    def _timeout(self, now: float) -> float:
        """How long to wait for events before the next full look."""
        acq, position = self.acq, self.position
        if self.watcher and self.own is not None and min(self.world) >= 0:
            # The head alone re-looks WATCH_S apart (NVML changes have no event); the
            # other watchers wake on events, or when the head pokes them.
            timeout = WATCH_S if position == 0 else IDLE_S
        elif self.watcher:
            timeout = POLL_S
        elif self.own is not None:
            timeout = NEAR_CHECK_S  # then a count of those ahead (_near_asleep), not a look
        else:
            timeout = FAR_POLL_S * max(1.0, position / 100)
        if acq.offered:
            timeout = min(timeout, max(0.0, acq.offered.due(now) - now))
        timeout = min(timeout, max(0.0, self.deadline - now))
        acq.stale.update(d.uuid for d in acq.candidates if d.uuid not in self.free)
        return timeout

    def _listen(self, timeout: float, again: bool = False) -> None:
        """Wait up to TIMEOUT for events on what we watch, deciding on our look amended by
        them where they allow it (sets self.lease when our turn came); back for a full look."""
        assert self.own is not None
        if not again:  # (AGAIN: listening on after a check that was no look)
            self.looked_at = self.clock()
        Listen(self, timeout).run()

    def _watch_entry(self) -> Optional[inotify.Watch]:
        """An inotify instance watching our entry (pokes, a cancel); None if none is left."""
        own = inotify.open_watch()
        if own is not None:
            own.add(self.entry.path, inotify.IN_OPEN | inotify.IN_MODIFY)
            self.poller.register(own.fileno(), select.POLLIN)
        return own

    def _watch_world(self, own: inotify.Watch) -> List[int]:
        """Watch the machine as a watcher does: lease files opened and closed, runs coming
        and leaving (OWN's watches on the lease and queue directories)."""
        acq = self.acq
        return [own.add(acq.leases.dir, inotify.IN_CLOSE_NOWRITE | inotify.IN_CLOSE_WRITE | inotify.IN_OPEN),
                own.add(acq.queue.dir, inotify.IN_CREATE | inotify.IN_DELETE
                        | inotify.IN_CLOSE_WRITE | inotify.IN_MOVED_TO)]

