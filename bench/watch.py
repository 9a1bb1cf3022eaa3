"""Event-driven clocks for hand-overs: when a job let go of its device, when a waiter got one.

Both are stamped when the kernel says so, not by polling: a 5 ms poll adds up to 5 ms to a
10 ms target and, on 2 cores, competes with what it measures.

* exits and execs: as root, the kernel's process events (the proc connector, netlink): each
  comes with the kernel's own time (CLOCK_MONOTONIC), taken in the exiting or exec'ing
  process itself, so no wake-up of this thread delays a stamp. A process's exit event comes
  after its descriptors were closed, so after its lease was released; its exec event once
  the new program is loaded, before its first instruction (and before a dynamically linked
  program's loader runs). Without the connector (not root, or a kernel without it): a pidfd
  per job, stamped when this thread wakes on it, and no exec times (the job's own start
  line stands in: later by its loading). A hand-over is measured from the exit: the
  stand-in's end line comes before its own interpreter teardown (~7 ms), which is no part
  of cudawrap's hand-over.
* grants: inotify on cudawrap's queue directory; a waiter's entry is removed right
  after it locked its devices (IN_DELETE), which is when cudawrap granted them.
"""
from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from cudawrap.base import inotify
from cudawrap.base.wakepipe import WakePipe
from cudawrap.sched.queue import parse_name

# linux/connector.h and linux/cn_proc.h
_NETLINK_CONNECTOR = 11
_CN_IDX_PROC = _CN_VAL_PROC = 1
_PROC_CN_MCAST_LISTEN = 1
_NLMSG_DONE = 3
PROC_EVENT_EXEC = 0x00000002
PROC_EVENT_EXIT = 0x80000000
_NLMSG_HDR = 16  # nlmsghdr
_CN_MSG = 20  # struct cn_msg before its data
_SO_RCVBUFFORCE = 33
_EARLY_S = 5.0  # how long events of a pid not yet added are kept (at least)


def proc_connector() -> Optional[socket.socket]:
    """A socket subscribed to the kernel's process events, or None where that is refused
    (it takes CAP_NET_ADMIN) or the kernel has no proc connector."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_CONNECTOR)
    except (OSError, AttributeError):
        return None
    try:
        sock.bind((0, _CN_IDX_PROC))
        op = struct.pack("I", _PROC_CN_MCAST_LISTEN)
        cn = struct.pack("IIIIHH", _CN_IDX_PROC, _CN_VAL_PROC, 0, 0, len(op), 0) + op
        sock.send(struct.pack("IHHII", _NLMSG_HDR + len(cn), _NLMSG_DONE, 0, 0, 0) + cn)
    except OSError:
        sock.close()
        return None
    return sock


def proc_events(data: bytes) -> List[Tuple[int, int, int]]:
    """(what, tgid, kernel ns) of each exec and each process's exit in one datagram of the
    proc connector (a thread's exit, whose pid is not its tgid, is left out)."""
    out: List[Tuple[int, int, int]] = []
    at = 0
    while at + _NLMSG_HDR <= len(data):
        size = struct.unpack_from("I", data, at)[0]
        if size < _NLMSG_HDR:
            break
        body = at + _NLMSG_HDR + _CN_MSG  # struct proc_event: what, cpu, timestamp_ns, then the event
        if body + 24 <= at + size:
            what, _cpu, ns = struct.unpack_from("IIQ", data, body)
            pid, tgid = struct.unpack_from("ii", data, body + 16)
            if what == PROC_EVENT_EXEC or (what == PROC_EVENT_EXIT and pid == tgid):
                out.append((what, tgid, ns))
        at += (size + 3) & ~3
    return out


class Clock(threading.Thread):
    """One thread, woken by the kernel, for both ends of every hand-over.

    exited: pid -> time.time() of its exit, for every pid added (before it could be reaped);
    execs: pid -> the times of its execs, where the kernel's process events are read (kernel);
    keys / first_seen / left: per waiter (by pid) its queue key (which orders arrivals), when
    its entry appeared and when it was removed.

    One thread, so a departure is never stamped before the exit that caused it. Where it
    stamps by waking (queue departures; pidfds without the kernel's events) it runs
    SCHED_FIFO where it may, so the load it measures does not delay its stamps (it wakes,
    reads the clock and sleeps again: negligible CPU); with the kernel's stamps alone,
    SCHED_IDLE.
    """

    def __init__(self, queue_dir: Optional[Path] = None) -> None:
        super().__init__(daemon=True)
        self.exited: Dict[int, float] = {}
        self.execs: Dict[int, List[float]] = {}
        self.keys: Dict[int, int] = {}
        self.first_seen: Dict[int, float] = {}
        self.left: Dict[int, float] = {}
        self.queue_dir = None if queue_dir is None else str(queue_dir)
        self._pidfds: Dict[int, int] = {}  # pidfd -> pid
        self._new: List[int] = []
        self._lock = threading.Lock()
        self._wake = WakePipe()  # add() and stop() wake the thread
        self._halt = False
        self._clocked: Set[int] = set()
        # Events of pids not (yet) added, kept a while in two generations (so each stays
        # _EARLY_S at least): a child execs before Popen returns, and its next exec or even
        # its exit can come before add(), which takes them over.
        self._early: Dict[int, List[Tuple[int, float]]] = {}
        self._earlier: Dict[int, List[Tuple[int, float]]] = {}
        self._early_since = time.monotonic()
        self._events = proc_connector()
        self.kernel = self._events is not None
        self._watch = None
        if self.queue_dir is not None:
            self._watch = inotify.Watch()
            # Watched from now on, so nothing between this and a listing is missed.
            self._watch.add(self.queue_dir, inotify.IN_CREATE | inotify.IN_DELETE | inotify.IN_MOVED_TO)
        self.start()

    # -- processes -------------------------------------------------------------------
    def add(self, pid: int, spawned: Optional[float] = None) -> None:
        """Clock PID's exit and execs (call it right after spawning: a reaped pid has no
        pidfd). SPAWNED, time.time() before the spawn, tells its events from those of an
        earlier process with the same pid."""
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        with self._lock:
            self._clocked.add(pid)
            self._pidfds[fd] = pid
            self._new.append(fd)
            early = self._earlier.pop(pid, []) + self._early.pop(pid, [])
            for what, when in early:
                if spawned is None or when >= spawned:
                    self._stamp(pid, what, when)
        self._wake.wake()

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

    def exec_before(self, pid: int, when: Optional[float]) -> Optional[float]:
        """When PID last exec'd before WHEN (its start line: the exec of the program that
        wrote it), where execs are clocked."""
        if when is None:
            return None
        before = [t for t in self.execs.get(pid, ()) if t <= when]
        return before[-1] if before else None

    def granted(self, pid: int) -> Optional[float]:
        """When PID's entry left the queue, if it was seen to."""
        return self.left.get(pid)

    # -- the thread ------------------------------------------------------------------
    def run(self) -> None:
        if self._events is not None:
            # The kernel stamps each of its events: they may wait in the socket until this
            # thread gets the CPU. Room for a burst's events meanwhile.
            with contextlib.suppress(OSError):
                self._events.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, 32 << 20)
        with contextlib.suppress(OSError, AttributeError):
            if self._watch is not None or self._events is None:
                # A queue entry's removal (and, without the kernel's events, a pidfd) is
                # stamped when this thread wakes: as root it runs first, so the load it
                # measures does not delay its stamps. Not root: they may lag.
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            else:
                # The kernel's stamps alone: it runs only when nothing else wants the CPU,
                # so it takes none from what it measures (the service, the waiter's exec;
                # it woke at every exec and exit on the machine, on 2 cores).
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        poller = select.poll()
        poller.register(self._wake.fileno(), select.POLLIN)
        if self._watch is not None:
            poller.register(self._watch.fileno(), select.POLLIN)
            self.snapshot()
        if self._events is not None:
            poller.register(self._events.fileno(), select.POLLIN)
        while not self._halt:
            with self._lock:
                for fd in self._new:
                    poller.register(fd, select.POLLIN)
                self._new = []
            ready = poller.poll(200)
            now = time.time()
            for fd, _mask in ready:
                if fd == self._wake.fileno():
                    self._wake.drain()
                elif self._watch is not None and fd == self._watch.fileno():
                    self._queue_events(now)
                elif self._events is not None and fd == self._events.fileno():
                    self._process_events()
                else:
                    with self._lock:
                        pid = self._pidfds.pop(fd)
                    # The kernel's stamp where there is one (its event may come a moment later).
                    self.exited.setdefault(pid, now)
                    poller.unregister(fd)
                    os.close(fd)

    def _process_events(self) -> None:
        assert self._events is not None
        try:
            data = self._events.recv(65536)
        except OSError:
            return  # ENOBUFS: events lost; those exits keep their pidfd stamps
        to_real = time.time() - time.monotonic()
        with self._lock:
            if time.monotonic() - self._early_since > _EARLY_S:
                # Kept for a spawn's add() only: a few seconds is ample, and bounds the memory.
                self._earlier, self._early, self._early_since = self._early, {}, time.monotonic()
            for what, pid, ns in proc_events(data):
                when = ns / 1e9 + to_real
                if pid in self._clocked:
                    self._stamp(pid, what, when)
                else:
                    self._early.setdefault(pid, []).append((what, when))

    def _stamp(self, pid: int, what: int, when: float) -> None:
        if what == PROC_EVENT_EXEC:
            self.execs.setdefault(pid, []).append(when)
        else:
            self.exited[pid] = when

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
        self._wake.wake()
        self.join()
        for fd in self._pidfds:
            os.close(fd)
        if self._events is not None:
            self._events.close()
        self._wake.close()
        if self._watch is not None:
            self._watch.close()
