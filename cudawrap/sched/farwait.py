"""Waiting far back in the queue: woken when runs leave it, without an inotify instance.

Linux gives each user 128 inotify instances (fs.inotify.max_user_instances), so runs far
back in a long queue have none (acquire.NEAR). They wait on dnotify instead (fcntl
F_NOTIFY), which needs no instance: the kernel sends the process SIGIO when a file in the
queue directory is removed, renamed or written to (a cancel), and the waiter sleeps in
sigtimedwait until then. Arrivals are not signalled, as they never move a waiter forward:
an entry is made as an unnamed O_TMPFILE file and linked into place (waitqueue.enqueue), so
joining the queue removes nothing. 500 waiters behind a quiet queue thus cost nothing at all
between their rare safety-net looks.

Where dnotify cannot be used (a thread other than the main one, a program that handles
SIGIO itself, a file system without it) the queue directory's mtime is polled instead.
Anyone can remove their own files in the directory and so send these signals: that costs
the far waiters some CPU, at most one check per nap each, and never delays anyone.
"""
from __future__ import annotations

import os
import signal
import time


def _ignore(signum: int, frame: object) -> None:
    """SIGIO's handler while we wait: one reaching a thread that does not block it must not
    end the process (SIGIO's default action)."""


# fcntl's F_SETOWN_EX and F_OWNER_TID (Linux; Python's fcntl module does not name them).
_F_SETOWN_EX = 15
_F_OWNER_TID = 0


def _to_this_thread(fd: int) -> None:
    """FD's signals sent to this thread, not to the process. dnotify signals the process,
    and the kernel hands a process's signal to any thread that does not block it: with
    another thread beside this one (a program's own, using the Python API), 13 of 200 were
    taken there (by its handler, _ignore) and never reached our sigtimedwait. Where this
    fails the waiter still looks again at its next nap."""
    import fcntl
    import struct
    import threading

    try:
        fcntl.fcntl(fd, _F_SETOWN_EX, struct.pack("ii", _F_OWNER_TID, threading.get_native_id()))
    except OSError:
        pass


class FarWait:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.fd = -1
        self.previous: object = None  # SIGIO's handler before ours, while ours is set
        self.unblock = False  # whether we blocked SIGIO (and so unblock it when done)
        self.pending = False  # a signal taken by wait(), not yet reported by moved()
        self.token = self._mtime()
        try:
            self._notify()
        except (OSError, ValueError):  # ValueError: signal handlers are the main thread's
            self.close()

    def _notify(self) -> None:
        import fcntl

        if (signal.getsignal(signal.SIGIO) is not signal.SIG_DFL
                or signal.SIGIO in signal.pthread_sigmask(signal.SIG_BLOCK, ())):
            return  # the program uses SIGIO itself
        self.previous = signal.signal(signal.SIGIO, _ignore)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGIO})
        self.unblock = True
        self.fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.fcntl(self.fd, fcntl.F_NOTIFY,
                    fcntl.DN_DELETE | fcntl.DN_RENAME | fcntl.DN_MODIFY | fcntl.DN_MULTISHOT)
        _to_this_thread(self.fd)

    @property
    def notified(self) -> bool:
        """Whether the kernel signals changes (else they are polled)."""
        return self.fd >= 0

    def _mtime(self) -> int:
        try:
            return os.stat(self.dir).st_mtime_ns
        except OSError:
            return 0

    def moved(self) -> bool:
        """Whether a run left the queue, or an entry was written, since the last call."""
        if self.fd >= 0:
            seen = self.pending or signal.sigtimedwait({signal.SIGIO}, 0) is not None
            self.pending = False
            return seen
        current = self._mtime()  # a removal changes the directory's mtime, and so does an arrival
        seen, self.token = current != self.token, current
        return seen

    def wait(self, every: float, longest: float, changed: bool) -> None:
        """Until a change, LONGEST at most; having just acted on a change (CHANGED), not
        before EVERY: changes meanwhile are kept, not acted on, which bounds how often a
        far waiter wakes however busy the queue. Polling: EVERY (or LONGEST if sooner)."""
        if self.fd < 0 or changed:
            time.sleep(max(0.0, min(every, longest)))
            if self.fd < 0 or longest <= every:
                return
            longest -= every
        if not self.pending and longest > 0:
            self.pending = signal.sigtimedwait({signal.SIGIO}, longest) is not None

    def close(self) -> None:
        """Stop the signals, and leave SIGIO as it was (a blocked signal would outlive exec)."""
        if self.fd >= 0:
            os.close(self.fd)  # ends the notification
            self.fd = -1
        if self.unblock:
            while signal.sigtimedwait({signal.SIGIO}, 0) is not None:
                pass  # one already sent, taken here rather than by the restored handler
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGIO})
            self.unblock = False
        if self.previous is not None:
            signal.signal(signal.SIGIO, self.previous)
            self.previous = None
