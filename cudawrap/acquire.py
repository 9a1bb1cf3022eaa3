"""Taking free devices: all or nothing, in arrival order, released by the kernel.

A device is free when nobody holds its lease and NVML shows no process cudawrap did not
start (where process lists are hidden, when little memory is used). Grabs never block, so
taking several devices cannot deadlock; the queue's mutex (for newcomers) and its head
position (for waiters) make sure only one process grabs at a time, so nobody is passed.
"""
from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Callable, Dict, List, Optional, Sequence, Set

from .devices import Device
from .errors import Interrupted, NoDeviceError
from .leases import Lease, LeaseFiles
from .waitqueue import WaitQueue

# The head of the queue re-checks the leases this often: a freed device reaches the next
# waiter within one period. Only the head polls; everyone behind it sleeps in the kernel.
POLL_S = 0.02
# NVML data older than this is re-read before a device is judged occupied by a process
# cudawrap did not start. A device whose lease was held at the last look is re-read at
# once: the processes seen on it were probably that job's, now gone.
FOREIGN_RECHECK_S = 1.0
# How long even a run that does not wait (wait = 0) waits for the queue's mutex.
MUTEX_GRACE_S = 2.0


class _Deadline(Exception):
    pass


def _raise_deadline(signum: int, frame: object) -> None:
    raise _Deadline()


def _raise_signal(signum: int, frame: object) -> None:
    raise Interrupted("interrupted while waiting for a device", exit_code=128 + signum)


class Acquirer:
    """One run's request for COUNT devices among CANDIDATES."""

    def __init__(
        self,
        leases: LeaseFiles,
        queue: WaitQueue,
        candidates: Sequence[Device],
        all_devices: Sequence[Device],
        count: int,
        placement: str = "spread",
        foreign: str = "avoid",
        busy_memory_mib: int = 1024,
        refresh: Optional[Callable[[Device], Optional[Device]]] = None,
        checked_at: Optional[float] = None,
    ) -> None:
        self.leases = leases
        self.queue = queue
        self.candidates = list(candidates)
        self.count = count
        self.placement = placement
        self.foreign = foreign
        self.busy_memory_mib = busy_memory_mib
        self.refresh = refresh
        self.current: Dict[str, Device] = {d.uuid: d for d in all_devices}
        now = time.monotonic() if checked_at is None else checked_at
        self.checked_at: Dict[str, float] = {d.uuid: now for d in all_devices}
        # Devices whose data may be stale: their lease was held at some look since they were
        # last read (the processes seen were probably that job's), or we slept in the queue.
        self.stale: Set[str] = set()
        self.lost: Set[str] = set()

    # -- judging devices -------------------------------------------------------------
    def occupied(self, device: Device) -> bool:
        """Whether NVML shows work cudawrap did not start on DEVICE (its lease being free)."""
        if self.foreign == "ignore":
            return False
        if device.pids is None:
            return device.memory_used_mib > self.busy_memory_mib
        return bool(device.pids)

    def _recheck(self, uuid: str, now: float) -> bool:
        """Re-read DEVICE from NVML if its data may be stale; True if it is now free."""
        fresh = self.refresh(self.current[uuid]) if self.refresh else None
        if fresh is None:
            if self.refresh is not None:
                self.lost.add(uuid)  # NVML lost it mid-run: never hand it out
            return False
        self.current[uuid] = fresh
        self.checked_at[uuid] = now
        self.stale.discard(uuid)
        return not self.occupied(fresh)

    def _eligible(self, uuid: str, now: float) -> bool:
        if uuid in self.stale and self.refresh is not None:
            # Meanwhile its job may have ended, its GPU been lost or its MIG instance destroyed
            # (the lease file outlives it until the next sync): only a fresh look tells,
            # whatever the old data or the foreign policy say.
            return self._recheck(uuid, now)
        if not self.occupied(self.current[uuid]):
            return True
        if now - self.checked_at[uuid] > FOREIGN_RECHECK_S:
            return self._recheck(uuid, now)
        return False

    # -- choosing ----------------------------------------------------------------------
    def _order(self, eligible: List[Device], busy: Set[str]) -> List[Device]:
        """COUNT devices from ELIGIBLE by the placement policy."""
        if self.placement == "random":
            import random  # only here: ~3 ms of imports nobody else needs

            return random.sample(eligible, self.count)
        total: Dict[str, int] = {}
        taken: Dict[str, int] = {}
        for device in self.current.values():
            total[device.parent_uuid] = total.get(device.parent_uuid, 0) + 1
            if device.uuid in busy:
                taken[device.parent_uuid] = taken.get(device.parent_uuid, 0) + 1
        chosen: List[Device] = []
        pool = list(eligible)
        sign = -1 if self.placement == "pack" else 1
        while len(chosen) < self.count:
            best = min(pool, key=lambda d: (
                sign * taken.get(d.parent_uuid, 0) / total[d.parent_uuid],
                d.gpu_index, d.mig_slot if d.mig_slot is not None else -1))
            pool.remove(best)
            chosen.append(best)
            taken[best.parent_uuid] = taken.get(best.parent_uuid, 0) + 1
        return chosen

    def try_grab(self) -> Optional[Lease]:
        """Take COUNT free devices now, or nothing."""
        now = time.monotonic()
        locked: List[Device] = []
        held: Set[str] = set()
        for device in self.candidates:
            if device.uuid in self.lost:
                continue
            if self.leases.try_lock(device.uuid):
                locked.append(device)
            else:
                held.add(device.uuid)
        eligible = [self.current[d.uuid] for d in locked if self._eligible(d.uuid, now)]
        self.stale |= held
        locked_ids = {d.uuid for d in locked}
        chosen_ids: List[str] = []
        if len(eligible) >= self.count:
            busy = held | (locked_ids - {d.uuid for d in eligible})
            busy |= {u for u, d in self.current.items()
                     if u not in held and u not in locked_ids and self.occupied(d)}
            chosen_ids = [d.uuid for d in self._order(eligible, busy)]
        for uuid in locked_ids - set(chosen_ids):
            self.leases.unlock(uuid)
        return self.leases.take(chosen_ids) if chosen_ids else None

    def usable(self) -> int:
        return len([d for d in self.candidates if d.uuid not in self.lost])

    # -- waiting -----------------------------------------------------------------------
    def acquire(self, wait_s: float, info: bytes,
                on_wait: Optional[Callable[[int], None]] = None) -> Lease:
        """Devices within WAIT_S seconds (inf: as long as it takes), first come first served."""
        start = time.monotonic()
        # A finite wait bounds the wait for the queue's mutex too (anyone can hold that file's
        # lock); "do not wait" still allows for the moment another launch holds it.
        with self.queue.mutex(max(wait_s, MUTEX_GRACE_S)):
            if not self.queue.anyone_waiting():
                lease = self.try_grab()
                if lease is not None:
                    return lease
            if wait_s <= 0:
                raise NoDeviceError(self._busy_message(), hint="set CUDAWRAP_WAIT=SECONDS to wait")
            entry = self.queue.enqueue(info)
        import signal  # waiting only: `signal` pulls in enum (~5 ms)

        previous = {s: signal.signal(s, _raise_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
        old_alarm = signal.signal(signal.SIGALRM, _raise_deadline)
        try:
            if on_wait is not None:
                on_wait(len(self.queue.live(before=entry.key)))
            deadline = start + wait_s
            if deadline != float("inf"):
                signal.setitimer(signal.ITIMER_REAL, max(deadline - time.monotonic(), 0.001))
            self.queue.wait_turn(entry)
            self.stale.update(d.uuid for d in self.candidates)  # we slept: all of it is old
            while True:
                lease = self.try_grab()
                if lease is not None:
                    return lease
                if self.usable() < self.count:
                    raise NoDeviceError("the devices this run may use are gone (lost or removed)")
                time.sleep(POLL_S)
        except _Deadline:
            raise NoDeviceError(f"no device became free within {wait_s:g} s",
                                hint="try again later, or set CUDAWRAP_WAIT=SECONDS") from None
        except KeyboardInterrupt:
            raise Interrupted("interrupted while waiting for a device") from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_alarm)
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.queue.leave(entry)

    def _busy_message(self) -> str:
        n = len(self.candidates)
        what = "device" if n == 1 else f"all {n} devices"
        return f"no free device: {what} busy and waiting is off (wait = 0)"


def describe_wait(candidates: int, ahead: int) -> str:
    who = "nobody" if ahead == 0 else ("1 run" if ahead == 1 else f"{ahead} runs")
    return f"all {candidates} usable devices are busy; waiting ({who} ahead, pid {os.getpid()})"
