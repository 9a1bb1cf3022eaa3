"""The service's ledger writes that can wait, made on a thread of their own, in order.

The ledger's state is rewritten by a rename, which ext4 makes flush the new file's data
first (~0.5–0.9 ms), and the records are made durable by fsync (~0.5 ms each). Made on the
service's loop, each held up whatever came meanwhile: runs that end together end a few
milliseconds apart, so a hand-over often came while the loop was inside one of them (15 of
31 hand-overs that found the loop busy, in one burst of bench/service.py). On this thread
the loop goes on; the system calls release the GIL, and what they need from the loop (the
state's text, the paths) is taken before they are queued, so they share nothing with it.
"""
from __future__ import annotations

import logging
import queue
import signal
import threading
from typing import Callable

log = logging.getLogger(__name__)


class Writer:
    def __init__(self) -> None:
        self._jobs: "queue.Queue[Callable[[], None]]" = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="ledger-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        """Run JOB after those submitted before it."""
        self._jobs.put(job)

    def wait(self) -> None:
        """Until every job submitted so far has been run (a clean stop, before it leaves)."""
        self._jobs.join()

    def _work(self) -> None:
        # Signals are the main thread's: one sent to the process goes to a thread that does
        # not block it, and taken here it would interrupt nothing (the loop's select sleeps
        # on through a SIGTERM; a far waiter's SIGIO, blocked where it waits, is lost).
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception:  # a full disk: the next write tries again, the loop goes on
                log.exception("the ledger's writer")
            finally:
                self._jobs.task_done()
