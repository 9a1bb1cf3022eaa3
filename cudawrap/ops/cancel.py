"""`cudawrap cancel PID...`: end waiting runs; a user their own, root anyone's.

The canceller checks that PID is a waiting run (it holds the lock of a live wait-queue
entry, as the kernel records it, and no device lease), then appends ``cancel=USER`` to
each entry PID holds and removes it. Only the entry's owner and root can write or remove
it, so nobody can cancel another user's run; the waiter watches its own entry (inotify),
sees the line at once, and exits 75 with one line, ``cancelled by USER``. An entry made
by hand, whose process never reads the line, is gone from the queue all the same. No
signal is involved: a reused pid is never touched, and the program's own signals stay
its own.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # a waiting shim imports this module: no typing, dataclasses, pathlib
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Sequence

    from ..paths import Layout

from ..errors import NotPermitted, StateError, UsageError
from ..base.proc import real_uid
from ..base.users import either, user_name
from ..sched.waiters import Waiter, waiters

CANCELLED_EXIT = os.EX_TEMPFAIL  # 75, as for a wait that ran out


def parse_pids(args: Sequence[str]) -> List[int]:
    if not args:
        raise UsageError("no PID given", hint="cudawrap cancel PID... (`cudawrap status` lists who waits)")
    out = []
    for arg in args:
        text = arg.strip()
        if not (text.isascii() and text.isdigit() and 0 < len(text) <= 9 and int(text) > 0):
            shown = "".join(c if c.isprintable() else "?" for c in arg[:40])
            raise UsageError(f"PID {shown!r}: not a process id", hint="give the pid `cudawrap status` shows")
        if int(text) not in out:
            out.append(int(text))
    return out


def check(pid: int, waiting: Dict[int, Waiter], held: Dict[int, List[str]], caller_uid: int,
          private: bool = False) -> Waiter:
    """The waiter PID if CALLER_UID may cancel it; raises saying why not (PRIVATE, [service]
    private_status: without naming another user). Changes nothing."""
    if pid in held:
        raise StateError(f"pid {pid} holds {', '.join(held[pid])}: it is a running program, not a waiting run",
                         hint=f"to stop it, signal it: kill {pid} (as its owner or root)")
    waiter = waiting.get(pid)
    if waiter is None:
        what = "no such process" if real_uid(pid) is None else "it is not in the wait queue"
        raise StateError(f"pid {pid} is not a run waiting for a device ({what})",
                         hint="`cudawrap status` lists the waiting runs and their pids")
    if caller_uid != 0 and waiter.uid != caller_uid:
        raise _not_yours(waiter, private)
    return waiter


def _not_yours(waiter: Waiter, private: bool = False) -> NotPermitted:
    if private:
        return NotPermitted(f"pid {waiter.pid} is not your run; only its owner or root may cancel it")
    return NotPermitted(f"pid {waiter.pid} is {user_name(waiter.uid)}'s run; only {either(waiter.uid, 0)} "
                        "may cancel it")


def cancel(layout: Layout, pids: Sequence[int], caller_uid: Optional[int] = None) -> List[Waiter]:
    """Cancel the waiting runs PIDS, all or none: every pid is checked before any is cancelled."""
    from ..lease.holders import holdings
    from ..sched.queue import cancel as cancel_entry

    caller_uid = os.getuid() if caller_uid is None else caller_uid
    waiting = {w.pid: w for w in waiters(str(layout.root))}
    held: Dict[int, List[str]] = {}
    for uuid, holding in holdings(str(layout.lease_dir)).items():
        for pid in holding.pids:  # the holder, or each sharer
            if pid is not None:
                held.setdefault(pid, []).append(uuid)
    from .view import cancel as cancel_served, service_waiters

    waiting.update((pid, Waiter(pid, uid, "")) for pid, uid in service_waiters(layout).items())
    from ..policy.privacy import hidden_from

    private = hidden_from(str(layout.root), caller_uid) is not None
    chosen = [check(pid, waiting, held, caller_uid, private) for pid in pids]
    served = [w.pid for w in chosen if not w.paths]  # waiting in the service: it answers them
    if served:
        cancel_served(layout, served)
    for waiter in chosen:
        for path in waiter.paths:
            try:
                cancel_entry(path, user_name(caller_uid))
            except FileNotFoundError:
                pass  # it got its device or ended since the check: nothing left to cancel
            except PermissionError:
                raise _not_yours(waiter, private) from None
    return chosen
