"""Waking a waiter kept off a device by processes cudawrap did not start, as they leave.

NVML has no event for a process leaving a device, so a waiter held back only by such a
process used to decide again once a second (acquire.WATCH_S), ~1 s after the device was
idle. It now also wakes when one of those processes exits (a pidfd on each whose pid is
visible here: Linux 5.3+, Python 3.9+; elsewhere nothing) and when the monitor rewrites its
snapshot (inotify on the snapshot's directory), which no longer lists a process that left
(one in another pid namespace, say). A wake decides nothing: the waiter re-reads the device
and looks again, so a pid that names some other process costs one look at most.

Only the watchers (the first few in line) follow, and only while such processes hold them
back: a pidfd per process, and one more inotify instance each for the snapshot (out of
instances, the waiter keeps its timer).
"""
from __future__ import annotations

import errno
import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    import select
    from typing import Dict, Iterable, List, Optional, Set, Tuple

    from ..base.inotify import Watch

# Pids seen to exit are never followed again (a zombie's pidfd is readable at once); past
# this many, a long wait through many foreign processes forgets the oldest ones.
_GONE_MAX = 4096


def _pidfd(pid: int) -> Tuple[Optional[int], bool]:
    """A pidfd for PID, readable once it exits (None where there is none), and whether PID
    may have exited already: no such process here (ESRCH), which is also what a pid from
    another pid namespace gives."""
    try:
        return os.pidfd_open(pid), False  # type: ignore[attr-defined]
    except OSError as exc:
        return None, exc.errno == errno.ESRCH
    except AttributeError:  # no pidfd_open (Linux < 5.3, Python < 3.9)
        return None, False


class ForeignWake:
    """The exits of the processes followed, and the snapshot's rewrites, as POLLER events."""

    def __init__(self, poller: select.poll, snapshot: Optional[str]) -> None:
        self.poller = poller
        self.snapshot = snapshot  # the monitor's snapshot file; None when launches do not read one
        self.pidfds: Dict[int, int] = {}  # pid -> its pidfd
        self.gone: Set[int] = set()
        self.watch: Optional[Watch] = None

    def follow(self, pids: Iterable[int]) -> bool:
        """Wake on the exit of each of PIDS, and on the snapshot's rewrite while there is any;
        stop following every other process. True: one of PIDS was gone already (it exited
        between the look that named it and now), which is a wake like its exit."""
        listed = set(pids)
        wanted = listed - self.gone
        for pid in set(self.pidfds) - wanted:
            self._drop(pid)
        missed = False
        for pid in wanted - set(self.pidfds):
            fd, gone = _pidfd(pid)
            if gone:  # never followed again: an unseen pid costs one re-read, not one per look
                self._gone(pid)
                missed = True
            if fd is not None:
                import select

                # Registered before it is named: a signal in between (a SIGTERM's handler
                # closes us) must not leave a name that poll does not know.
                self.poller.register(fd, select.POLLIN)
                self.pidfds[pid] = fd
        # The snapshot is watched while any is listed, followed or not: it is what tells of
        # one we cannot follow (another pid namespace's) leaving, or of one gone still listed.
        if listed and self.watch is None and self.snapshot is not None:
            self._watch_snapshot()
        elif not listed and self.watch is not None:
            self._unwatch_snapshot()
        return missed

    def woken(self, ready: List[Tuple[int, int]]) -> bool:
        """Whether READY (what poll returned) holds an exit or a snapshot rewrite; consumes them."""
        fds = {fd for fd, _mask in ready}
        woke = False
        for pid, fd in list(self.pidfds.items()):
            if fd in fds:
                self._drop(pid)
                self._gone(pid)
                woke = True
        if self.watch is not None and self.watch.fileno() in fds:
            name = os.path.basename(self.snapshot or "")
            woke = any(event[2] == name for event in self.watch.events()) or woke
        return woke

    def close(self) -> None:
        for pid in list(self.pidfds):
            self._drop(pid)
        if self.watch is not None:
            self._unwatch_snapshot()

    def _gone(self, pid: int) -> None:
        if len(self.gone) >= _GONE_MAX:
            self.gone.clear()
        self.gone.add(pid)

    def _drop(self, pid: int) -> None:
        fd = self.pidfds.pop(pid)
        _unregister(self.poller, fd)
        os.close(fd)

    def _watch_snapshot(self) -> None:
        """The snapshot is replaced by a rename (rootfile.write): watch its directory for it."""
        from ..base import inotify
        import select

        watch = inotify.open_watch()
        if watch is not None and watch.add(os.path.dirname(self.snapshot or "") or ".", inotify.IN_MOVED_TO) < 0:
            watch.close()
            watch = None
        if watch is None:
            self.snapshot = None  # out of inotify instances or watches: the waiter's own timer stands
            return
        self.poller.register(watch.fileno(), select.POLLIN)  # before it is named (see follow)
        self.watch = watch

    def _unwatch_snapshot(self) -> None:
        if self.watch is not None:
            _unregister(self.poller, self.watch.fileno())
            self.watch.close()
            self.watch = None


def _unregister(poller: select.poll, fd: int) -> None:
    try:
        poller.unregister(fd)
    except KeyError:
        pass  # never registered: a signal came between the two (see follow)
