"""`cudawrap cancel PID...`: end waiting runs; a user their own, root anyone's.

The canceller checks that PID is a waiting run (it holds the lock of a live wait-queue
entry, as the kernel records it, and no device lease) and sends it SIGUSR1 through a
pidfd, so a pid reused meanwhile is never signalled. The waiter learns who sent it from
the signal's siginfo (si_uid is set by the kernel, nobody can forge it) and exits 75 with
one line, ``cancelled by USER``: see `CancelWatch` and `cancelled_by` for its side.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # a waiting shim imports this module: no typing, dataclasses, pathlib
if TYPE_CHECKING:
    import signal
    from typing import Callable, Dict, List, Optional, Sequence

    from .paths import Layout

from .errors import NotPermitted, StateError, UsageError
from .users import user_name

CANCELLED_EXIT = os.EX_TEMPFAIL  # 75, as for a wait that ran out


def cancel_signal() -> int:
    import signal  # pulls in enum: only when cancelling or waiting

    return signal.SIGUSR1


class Waiter:
    __slots__ = ("pid", "uid", "key")

    def __init__(self, pid: int, uid: int, key: str) -> None:
        self.pid = pid  # the kernel's record of who holds the entry's lock
        self.uid = uid  # that process's real uid (from /proc), not the entry file's owner
        self.key = key  # its place in the queue


def proc_uid(pid: int) -> Optional[int]:
    """The real uid of PID, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def waiters(root: str) -> List[Waiter]:
    """The runs waiting for a device now. The adapter to the wait queue: the scheduler's
    own ``waiters(root)`` replaces this body (objects with .pid, .uid and .key)."""
    from . import locations as loc
    from .errors import SetupError
    from .leases import _proc_locks
    from .waitqueue import WaitQueue

    try:
        queue = WaitQueue(loc.under(root, loc.QUEUE_DIR), loc.under(root, loc.QUEUE_LOCK))
    except SetupError:  # no queue directory: nobody can be waiting
        return []
    locks = _proc_locks()
    out = []
    for key, _owner, _info in queue.entries():
        try:
            st = os.stat(os.path.join(queue.dir, key), follow_symlinks=False)
        except OSError:
            continue
        pid = locks.get((st.st_dev, st.st_ino))
        uid = proc_uid(pid) if pid is not None else None
        if pid is not None and uid is not None:
            out.append(Waiter(pid, uid, key))
    return out


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


def check(pid: int, waiting: Dict[int, Waiter], held: Dict[int, List[str]], caller_uid: int) -> Waiter:
    """The waiter PID if CALLER_UID may cancel it; raises saying why not. Changes nothing."""
    if pid in held:
        raise StateError(f"pid {pid} holds {', '.join(held[pid])}: it is a running program, not a waiting run",
                         hint=f"to stop it, signal it: kill {pid} (as its owner or root)")
    waiter = waiting.get(pid)
    if waiter is None:
        what = "no such process" if proc_uid(pid) is None else "it is not in the wait queue"
        raise StateError(f"pid {pid} is not a run waiting for a device ({what})",
                         hint="`cudawrap status` lists the waiting runs and their pids")
    if caller_uid != 0 and waiter.uid != caller_uid:
        raise NotPermitted(f"pid {pid} is {user_name(waiter.uid)}'s run; only {user_name(waiter.uid)} "
                           f"or root may cancel it")
    return waiter


def cancel(layout: Layout, pids: Sequence[int], caller_uid: Optional[int] = None) -> List[Waiter]:
    """Cancel the waiting runs PIDS, all or none: every pid is checked before any is signalled."""
    import signal

    from .leases import holders

    caller_uid = os.getuid() if caller_uid is None else caller_uid
    root = str(layout.root)
    # Pin each process first: a pidfd keeps naming the process we checked, whatever pid reuse.
    fds: Dict[int, int] = {}
    try:
        for pid in pids:
            try:
                fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                pass  # reported by check() as "no such process"
        waiting = {w.pid: w for w in waiters(root) if w.pid in fds}
        held: Dict[int, List[str]] = {}
        for uuid, pid in holders(str(layout.lease_dir)).items():
            held.setdefault(pid, []).append(uuid)
        chosen = [check(pid, waiting, held, caller_uid) for pid in pids]
        for waiter in chosen:
            try:
                signal.pidfd_send_signal(fds[waiter.pid], cancel_signal())
            except ProcessLookupError:
                pass  # it got its device or ended since the check: nothing left to cancel
        return chosen
    finally:
        for fd in fds.values():
            os.close(fd)


# --- the waiter's side -------------------------------------------------------------------------


def cancelled_by(siginfo: "signal.struct_siginfo") -> str:
    """The user who sent a cancel, from the kernel's siginfo (sigwaitinfo, sigtimedwait)."""
    return user_name(siginfo.si_uid)


def cancel_message(siginfo: "signal.struct_siginfo") -> str:
    """The one line a cancelled run prints before exiting CANCELLED_EXIT."""
    return f"cancelled by {cancelled_by(siginfo)}"


class CancelWatch:
    """While a run waits, turn a cancel into one line and exit 75, whatever the wait blocks in.

    ``start()`` blocks SIGUSR1 (so it stays pending instead of killing the process)
    and starts a thread that waits for it with sigwaitinfo; ``stop()`` before exec (the
    signal mask survives execve) unblocks it again. ON_CANCEL(message) runs in that
    thread and must end the process (the default prints PROG: message and exits 75).
    """

    def __init__(self, prog: str, on_cancel: Optional[Callable[[str], None]] = None) -> None:
        self.prog = prog
        import threading

        self.on_cancel = on_cancel or self._exit
        self.thread: Optional[threading.Thread] = None
        self.stopped = threading.Event()
        self.previous: set = set()

    def _exit(self, message: str) -> None:
        os.write(2, f"{self.prog}: {message}\n".encode("utf-8", "replace"))
        os._exit(CANCELLED_EXIT)

    def start(self) -> CancelWatch:
        import signal
        import threading

        self.previous = signal.pthread_sigmask(signal.SIG_BLOCK, {cancel_signal()})
        self.thread = threading.Thread(target=self._wait, name="cudawrap-cancel", daemon=True)
        self.thread.start()
        return self

    def _wait(self) -> None:
        import signal

        info = signal.sigwaitinfo({cancel_signal()})
        if not self.stopped.is_set():
            self.on_cancel(cancel_message(info))

    def stop(self) -> None:
        """Granted: a cancel arriving from now on is the program's own SIGUSR1 again."""
        import signal

        self.stopped.set()
        if self.thread is not None and self.thread.is_alive():
            signal.pthread_kill(self.thread.ident, cancel_signal())  # wakes the watcher, which returns
            self.thread.join()
        if cancel_signal() not in self.previous:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {cancel_signal()})
