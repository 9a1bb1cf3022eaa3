"""What the service's watch on the files says, read as what a decision needs to know.

One inotify instance watches the lease files (opened, closed, made, removed), the queue
directory (entries made and removed), the slot files (closed: a share's end) and the drains
file (the admin's drain or resume). A close of a lease or slot file may end a grant whose
client exited (a child held it); an open may take a lease the service found free (it is
tried again: Line.touched); a lease file made or removed is a sync (the machine is read
again). An open alone frees nothing, so it wakes no decision. An overflow (events lost)
counts as all of that at once.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Set

from .. import locations as loc
from ..base import inotify

_CLOSE = inotify.IN_CLOSE_WRITE | inotify.IN_CLOSE_NOWRITE
_RENAME = inotify.IN_CREATE | inotify.IN_DELETE | inotify.IN_MOVED_TO
# A watched directory opened and closed: someone listed it (the monitor's loop does, every
# pass). Nothing in it changed.
_LISTING = inotify.IN_ISDIR | inotify.IN_OPEN | _CLOSE


@dataclass
class News:
    touched: Optional[List[str]] = field(default_factory=list)  # lease files opened, closed or replaced (None: any)
    closed: Optional[Set[str]] = field(default_factory=set)  # uuids whose lease or slot file was closed (None: any)
    renamed: bool = False  # lease files made or removed (a sync)
    elsewhere: bool = False  # of anything but the lease files: the queue, a share's slot, the drains
    decide: bool = False  # anything that may let someone in


class FileWatch:
    """The watch, set up on ROOT's lease, queue, slot and state directories."""

    def __init__(self, root: str, lease_dir: str, queue_dir: str) -> None:
        watch = inotify.open_watch()
        if watch is None:
            raise OSError("inotify is not available")
        self.watch = watch
        self.leases = watch.add(lease_dir, _CLOSE | _RENAME | inotify.IN_OPEN)
        watch.add(queue_dir, _RENAME)
        # A share's end is its slot file's close (its lease file's other sharers hold on).
        self.shares = watch.add(loc.under(root, loc.SHARE_DIR), _CLOSE)
        # The admin's drains (state directory): a drain or resume is decided on at once. The
        # drains file is only ever replaced whole (rootfile.write: a rename), so a rename onto
        # it or its removal is all there is to see. Not the closes of files written there: the
        # ledger's lock and every append to the ledger closed a file open for writing, so each
        # grant woke the service's loop again, after its send, while the run it had just granted
        # started beside it (two to four needless wake-ups per hand-over, and more at each
        # pass of the monitor).
        self.state = watch.add(os.path.dirname(loc.under(root, loc.DRAINS)), inotify.IN_MOVED_TO | inotify.IN_DELETE)
        self.drains = os.path.basename(loc.DRAINS)

    def fileno(self) -> int:
        return self.watch.fileno()

    def read(self) -> News:
        events = [e for e in self.watch.events()
                  if (e[0] != self.state or e[2] == self.drains)  # not the ledger's writes
                  and not _listed(e[1], e[2])]
        news = News()
        if any(wd == -1 for wd, _mask, _name in events):  # some were lost
            return News(None, None, True, True, True)
        news.touched = [name for wd, _mask, name in events if wd == self.leases]
        news.elsewhere = len(news.touched) < len(events)
        news.closed = closed = set()
        for wd, mask, name in events:
            if wd == self.leases and mask & ~inotify.IN_OPEN == 0:
                continue  # an open frees nothing
            news.decide = True
            if wd == self.leases and mask & _RENAME:
                news.renamed = True
            if mask & _CLOSE:
                closed.add(name.rpartition(".")[0] if wd == self.shares else name)  # a slot file: UUID.K
        return news


def _listed(mask: int, name: str) -> bool:
    """Whether an event says only that a watched directory itself was listed: it woke a
    decision over every waiter, once per listing, and freed nothing."""
    return not name and mask & inotify.IN_ISDIR != 0 and mask & ~_LISTING == 0
