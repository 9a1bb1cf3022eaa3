"""The service's clients given devices that do not take them, passed over as runs deciding
for themselves pass each other over (sched/turns.py), with the same bounds.

A grant sent is judged as turns.Offers judges an offer: a client stopped (SIGSTOP) ignores
it at once, one asleep after GRACE_S, one busy after BUSY_S, any after LONGEST_S. One that
ignores it loses its grant ("not taken" in the ledger) and its turn: it and its user's other
runs are passed over for STALL_S (service/waitline.py), and the runs behind them are served. Before
this, the grant lapsed after 2 s and went to the same client again: a stopped client first
in line kept a device from everyone behind it, with a "not taken" record every 2 s.

A client passed over is in a stall until it takes a grant or goes. While it stays stopped it
is passed over again as its time runs out, without a grant (a record each time would grow
the ledger without bound: one "not taken" a stall). One that ignores a grant again while not
stopped (a client that never locks what it is sent: a real run takes its grant in
milliseconds of CPU) is not given one more: its connection ends with an error line.
"""
from __future__ import annotations

from typing import Dict, Iterable, List

from ..base.proc import state
from ..sched.turns import Offers
from .connection import Client
from .waitline import Line

NEVER = float("inf")


def stopped(pid: int) -> bool:
    """Whether PID is stopped (SIGSTOP, a debugger): it cannot take a grant now."""
    return state(pid) in (b"T", b"t")


class Stalls:
    def __init__(self) -> None:
        self.offers = Offers()  # grants sent and not yet taken, by the waiter's key
        self.stalled: Dict[str, Client] = {}  # key -> a client passed over, in its stall

    def offered(self, client: Client, now: float) -> None:
        """CLIENT was just sent a grant."""
        assert client.waiter is not None
        self.offers.drop(client.waiter.key)  # a grant before, lapsed or lost: judged from this one
        self.offers.offer(client.waiter.key, client.peer.pid, now, own=False)

    def ignored(self, pending: Iterable[str], now: float) -> List[str]:
        """The keys of the grants sent (PENDING: those not yet taken nor void) whose clients
        ignore them now."""
        self.offers.keep(set(pending))
        # Judged once its grace is over (due()), as a waiting run judges others: the kernel
        # is not asked of every grant at every step of a burst.
        return [key for key, (when, _pid, _busy, grace) in list(self.offers.since.items())
                if now - when >= grace and self.offers.ignored(key, now)]

    def due(self, now: float) -> float:
        """When the grants sent should be judged again."""
        return self.offers.due(now) if self.offers else NEVER

    def passed(self, key: str, client: Client) -> bool:
        """CLIENT ignored the grant KEY and is passed over: False where it is in a stall already
        and is not stopped (it is given no more)."""
        self.offers.drop(key)
        if key in self.stalled and not stopped(client.peer.pid):
            return False
        self.stalled[key] = client
        return True

    def end(self, key: str) -> None:
        """KEY took its grant, or is gone: its stall, if any, is over."""
        self.stalled.pop(key, None)
        self.offers.drop(key)

    def renew(self, line: Line, now: float) -> None:
        """Those in a stall whose time passed over ran out and that are still stopped are
        passed over again, with no grant (a stopped client ignores one at once), and alone:
        while it costs the others nothing, its user's other runs take their turns."""
        for key, client in self.stalled.items():
            if not line.passed_over(key, now) and stopped(client.peer.pid):
                line.pass_over(key, None, now)
