"""A pipe whose one job is to wake a select loop: from another thread, or from a signal
handler (signal.set_wakeup_fd writes the signal's byte into it)."""
from __future__ import annotations

import os


class WakePipe:
    def __init__(self) -> None:
        # Non-blocking both ways: a full pipe wakes the loop already, and drain() ends at empty.
        self.r, self.w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def fileno(self) -> int:
        return self.r

    def wake(self) -> None:
        try:
            os.write(self.w, b"!")
        except BlockingIOError:
            pass  # full: the loop wakes anyway

    def drain(self) -> None:
        """Empty it, so that the next select sleeps until the next wake."""
        try:
            while os.read(self.r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)
