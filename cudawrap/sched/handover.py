"""Hand-over: deciding on the last look amended by the events since, without a full look.

A watcher (see waiting.py) sees leases released and runs leaving the queue as inotify
events. Reading /proc/locks again costs ~8 ms when nothing read it a moment before, most of
a hand-over, so the last look stands, amended by what the events say (amendments, amend),
and the run whose turn it now is takes its devices at once (after_release); as it leaves
the line it wakes those who move into the watching places (hand_over).
"""
from __future__ import annotations

import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, FrozenSet, List, Optional, Set, Tuple

    from ..lease.files import Lease
    from .terms import Verdict, Waiter

from .acquirer import Acquirer
from .decision import UNKNOWN_HOLDER, WATCHERS, Decision
from .queue import Scan, poke


def amend(acq: Acquirer, scan: Scan, closed: Set[str], departed: Set[str], before: Dict[str, Verdict]) -> Scan:
    """SCAN (the last full look) as the events since say it is now, without reading
    /proc/locks (see after_release).

    That read costs ~8 ms when nothing read it in the last moment (the kernel waits out an
    RCU grace period first), most of a hand-over. So the last look stands, amended: the
    leases of CLOSED count free; the runs of DEPARTED have left the queue, holding what
    BEFORE (the last verdicts) gave them. The look is otherwise current, as any other
    change (a newcomer, a lease file opened) makes the next one a full look. A wrong
    amendment costs a turn at most, never a device twice: should a closed lease still be
    held (someone only probed it), the flock says so and nothing is taken."""
    from ..base.proc import exiting, state

    table = dict(scan.table)
    releasing = []
    for uuid in closed:
        # Any process that looked at the machine had every lease file open and closes them
        # all when it goes (or execs its job): a close frees a lease only if its holders
        # are on their way out. The kernel reports the close a moment before it drops
        # the lock: the lock itself says when.
        ident = acq.leases.ident(uuid)
        locks = table.get(ident)
        if locks is None:
            continue
        if all(exiting(pid) for pid, _ex in locks):
            releasing.append((uuid, ident))
        elif acq.leases.free_now(uuid):
            del table[ident]  # let go by a process that lives on (the API's Lease.release)
            _forget_slots(acq, table, uuid, {pid for pid, _ex in locks})
    for uuid, ident in releasing:
        holders = [pid for pid, _ex in table.pop(ident)]
        _forget_slots(acq, table, uuid, set(holders))
        for _ in range(20):
            if acq.vacant(uuid):
                break
            if all(state(pid) in (None, b"Z") for pid in holders):
                # They have exited and it is held: taken again since (by whom, below)
                table[ident] = [UNKNOWN_HOLDER]
                break
            time.sleep(0.0005)  # still exiting: the lock goes with its files
        else:
            table[ident] = [(pid, True) for pid in holders]
    if departed:
        # Runs that left the queue took devices free at the look or freed since (or gave
        # up). Which: their locks say (a probe holds a shared lock for microseconds; a
        # taker that meets one tries again). Who: the runs that left and still live (one
        # that has exited since holds nothing: its device, if held, was taken by someone
        # else), in their order of the last verdicts, each as many as it asked for.
        takers = sorted((w for w in scan.waiters if w.key in departed and not exiting(w.pid)),
                        key=lambda w: before[w.key].position if w.key in before else len(before))
        slots = [w.pid for w in takers for _ in range(w.count)]
        for uuid in acq.current:
            ident = acq.leases.ident(uuid)
            if ident is None or uuid in acq.lost or (ident in table and table[ident][0][0] != UNKNOWN_HOLDER[0]):
                continue
            if acq.vacant(uuid):
                table.pop(ident, None)
            else:
                table[ident] = [(slots.pop(0), True) if slots else UNKNOWN_HOLDER]
    return Scan([w for w in scan.waiters if w.key not in departed], table, scan.paths)

def _forget_slots(acq: Acquirer, table: Dict[Tuple[int, int], List[Tuple[int, bool]]], uuid: str,
                  pids: Set[int]) -> None:
    """Drop from TABLE the locks of PIDS on UUID's slot files: their shares ended with their
    lease locks (left there, they would read as slots locked apart from the lease)."""
    if acq.slots.get(uuid, 1) < 2:
        return
    for ident in acq.leases.slot_idents(uuid, acq.slots[uuid]):
        left = [lock for lock in table.get(ident, ()) if lock[0] not in pids]
        if left:
            table[ident] = left
        else:
            table.pop(ident, None)


def after_release(acq: Acquirer, amended: Scan, me: Waiter, key: str, closed: Set[str]
                  ) -> Tuple[Dict[str, Verdict], Optional[Lease]]:
    """A hand-over on an AMENDED look: (verdicts, our lease if it is our turn)."""
    from .schedule import GRANTED

    table = dict(amended.table)
    queued = any(w.key == key for w in amended.waiters)
    for _ in range(3):
        verdicts, free = acq.decide(Scan(amended.waiters, table, amended.paths), me, queued=queued)
        verdict = verdicts[key]
        acq.observe(Decision.RELEASE, key, verdicts, free, closed)
        if verdict.kind != GRANTED:
            return verdicts, None
        lease = acq.take_exactly(verdict.devices)
        if lease is not None:
            return verdicts, lease
        # Another watcher, amending its own look, took them: count them held, decide again.
        for uuid in verdict.devices:
            ident = acq.leases.ident(uuid)
            if ident is not None:
                table.setdefault(ident, [UNKNOWN_HOLDER])
    return verdicts, None


def hand_over(acq: Acquirer, verdicts: Dict[str, Verdict], scan: Scan, me: str) -> None:
    """We leave the line: wake those who now move into the watching places."""
    from .schedule import GRANTED

    # The watchers see us leave (they watch the queue), but those behind them do not:
    # wake the next in line, and as many more as runs were given devices with us (they
    # leave too, and their views of the line may be older than ours: each wakes the
    # same few, so that none who moves up is left asleep, unwatched, until IDLE_S).
    leaving = sum(1 for v in verdicts.values() if v.kind == GRANTED)
    for key, v in verdicts.items():
        if key != me and WATCHERS <= v.position < WATCHERS + max(1, leaving) and key in scan.paths:
            poke(scan.paths[key])

def signature(scan: Scan) -> Tuple[int, FrozenSet[Tuple[Tuple[int, int], Tuple[Tuple[int, bool], ...]]]]:
    """What a decision on SCAN depends on that events change: who waits, who holds what."""
    return len(scan.waiters), frozenset((ident, tuple(locks)) for ident, locks in scan.table.items())


def amendments(events: List[Tuple[int, int, str]], world: List[int]
                ) -> Optional[Tuple[Set[str], Set[str], bool, bool]]:
    """(lease files closed, queue entries removed, poked, outdated) from EVENTS; None if a
    full look is due at once: our entry written to (a cancel), events lost. Outdated: a
    queue entry made (a newcomer may come first) or a lease file opened (a lock may have
    been taken since the last look); neither can make it anyone's turn, so they only
    keep the look from being amended. A poke (our entry opened): someone's look says we
    moved up or it is our turn. WORLD: the watches on the lease and the queue directory."""
    from ..base import inotify
    from .queue import SUFFIX

    if len(world) != 2:
        return None
    closed: Set[str] = set()
    departed: Set[str] = set()
    poked = outdated = False
    for wd, mask, name in events:
        if wd == world[0] and not name:
            # The lease directory itself, listed (the monitor does, twice a second; so does
            # every newcomer): a listing takes no lock and frees none. Read as "a lock may
            # have been taken", it sent every watcher to a full look at once, all queued on
            # /proc/locks, just as a device freed: a hand-over of ~50 ms.
            continue
        if wd == world[0] and mask & (inotify.IN_CLOSE_WRITE | inotify.IN_CLOSE_NOWRITE):
            closed.add(name)
        elif wd == world[0] and mask & inotify.IN_OPEN:
            outdated = True
        elif wd == world[1] and mask & inotify.IN_DELETE and name.endswith(SUFFIX):
            departed.add(name)
        elif wd == world[1] and mask & inotify.IN_CLOSE_WRITE:
            pass  # an entry closed after writing (its owner leaving)
        elif wd == world[1] and mask & (inotify.IN_CREATE | inotify.IN_MOVED_TO | inotify.IN_DELETE):
            outdated = True  # a newcomer (or its temporary name)
        elif wd not in world and mask == inotify.IN_OPEN:
            poked = True
        else:
            return None
    return closed, departed, poked, outdated
