"""How often a waiter may act on what others can cause (pokes, lease files opened, newcomers):
a leaky bucket each, so that nobody can make a waiter spend CPU faster than its budget."""
from __future__ import annotations

import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Callable


class Budget:
    """A leaky bucket: BURST at once, then RATE a second (by CLOCK)."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.clock = clock
        self.at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now

    def pause(self) -> None:
        """Sleep until there is one to spend."""
        self._refill()
        if self.tokens < 1:
            time.sleep((1 - self.tokens) / self.rate)

    def spend(self) -> None:
        self._refill()
        self.tokens -= 1

    def ready_at(self) -> float:
        """When there is one to spend (by the clock)."""
        self._refill()
        return self.at + max(0.0, 1 - self.tokens) / self.rate
