"""Event-driven clocks for hand-overs: when a job let go of its device, when a waiter got one.

Both are stamped when the kernel says so, not by polling: a 5 ms poll adds up to 5 ms to a
10 ms target and, on 2 cores, competes with what it measures.

* exits: a pidfd per job; it becomes readable when the process has exited, after the
  kernel closed its descriptors, so after its lease was released. A hand-over is measured
  from then: the stand-in's end line comes before its own interpreter teardown (~7 ms),
  which is no part of cudawrap's hand-over.
* grants: inotify on cudawrap's queue directory; a waiter's entry is removed right
  after it locked its devices (IN_DELETE), which is when cudawrap granted them.
"""
from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

from cudawrap.base import inotify
from cudawrap.sched.queue import parse_name


class Clock(threading.Thread):
    """One thread, woken by the kernel, for both ends of every hand-over.

    exited: pid -> time.time() of its exit, for every pid added (before it could be reaped);
    keys / first_seen / left: per waiter (by pid) its queue key (which orders arrivals), when
    its entry appeared and when it was removed.

    One thread, so a departure is never stamped before the exit that caused it; as root it
    runs SCHED_FIFO, so the load it measures does not delay its stamps (it wakes, reads the
    clock and sleeps again: negligible CPU).
    """

    def __init__(self, queue_dir: Optional[Path] = None) -> None:
        super().__init__(daemon=True)
        self.exited: Dict[int, float] = {}
        self.keys: Dict[int, int] = {}
        self.first_seen: Dict[int, float] = {}
        self.left: Dict[int, float] = {}
        self.queue_dir = None if queue_dir is None else str(queue_dir)
        self._pidfds: Dict[int, int] = {}  # pidfd -> pid
        self._new: List[int] = []
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        self._halt = False
        self._watch = None
        if self.queue_dir is not None:
            self._watch = inotify.Watch()
            # Watched from now on, so nothing between this and a listing is missed.
            self._watch.add(self.queue_dir, inotify.IN_CREATE | inotify.IN_DELETE | inotify.IN_MOVED_TO)
        self.start()

    # -- processes -------------------------------------------------------------------
    def add(self, pid: int) -> None:
        """Clock PID's exit (call it right after spawning: a reaped pid has no pidfd)."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        with self._lock:
            self._pidfds[fd] = pid
            self._new.append(fd)
        os.write(self._wake_w, b"x")

    # -- the queue -------------------------------------------------------------------
    def snapshot(self) -> int:
        """Record the entries present now (a listing); returns how many there are."""
        try:
            names = os.listdir(self.queue_dir) if self.queue_dir else []
        except OSError:
            return 0
        now = time.time()
        with self._lock:
            return sum(1 for name in names if self._arrived(name, now))

    def _arrived(self, name: str, now: float) -> bool:
        parsed = parse_name(name)  # <arrival ns>.<pid>.<request>.<reserve>.wait
        if parsed is None:
            return False
        self.keys.setdefault(parsed[1], parsed[0])
        self.first_seen.setdefault(parsed[1], now)
        return True

    def granted(self, pid: int) -> Optional[float]:
        """When PID's entry left the queue, if it was seen to."""
        return self.left.get(pid)

    # -- the thread ------------------------------------------------------------------
    def run(self) -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        except (OSError, AttributeError):
            pass  # not root: stamps may lag under load (the report says which)
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        if self._watch is not None:
            poller.register(self._watch.fileno(), select.POLLIN)
            self.snapshot()
        while not self._halt:
            with self._lock:
                for fd in self._new:
                    poller.register(fd, select.POLLIN)
                self._new = []
            ready = poller.poll(200)
            now = time.time()
            for fd, _mask in ready:
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                elif self._watch is not None and fd == self._watch.fileno():
                    self._queue_events(now)
                else:
                    with self._lock:
                        pid = self._pidfds.pop(fd)
                    self.exited[pid] = now
                    poller.unregister(fd)
                    os.close(fd)

    def _queue_events(self, now: float) -> None:
        for _wd, mask, name in self._watch.events():
            if mask & inotify.IN_Q_OVERFLOW:
                self.snapshot()  # arrivals caught up; a departure lost is a missing figure
            elif mask & inotify.IN_DELETE:
                parsed = parse_name(name)
                if parsed is not None:
                    self.left.setdefault(parsed[1], now)
            else:
                with self._lock:
                    self._arrived(name, now)

    def stop(self) -> None:
        self._halt = True
        os.write(self._wake_w, b"x")
        self.join()
        for fd in self._pidfds:
            os.close(fd)
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._watch is not None:
            self._watch.close()
