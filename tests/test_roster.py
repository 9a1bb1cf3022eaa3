"""The service's roster (cudawrap/service/roster.py): who waits, whose wait ends first, who has
not asked yet and how many hold tickets, kept as clients come and go. The loop asks these at
every wake-up instead of walking every connection; wrong answers here would end waits late
or early, keep idle connections open, or tell a restarted service to wait for the wrong
number of runs."""
import socket
from typing import List

import pytest

from cudawrap.service.connection import Client
from cudawrap.service.roster import NEVER, Roster


@pytest.fixture
def clients():
    made: List[socket.socket] = []

    def make(wait_until: float = NEVER) -> Client:
        a, b = socket.socketpair()
        made.extend((a, b))
        client = Client(a, None)  # type: ignore[arg-type]  # the roster never looks at the peer
        client.wait_until = wait_until
        return client

    yield make
    for s in made:
        s.close()


def _queue(roster: Roster, client: Client) -> None:
    roster.connected(client.sock.fileno(), client)
    client.ask = object()  # type: ignore[assignment]  # it asked: no longer fresh
    roster.queued(client.sock.fileno(), client)


def test_the_soonest_wait_is_the_soonest_of_those_still_in_line(clients):
    roster = Roster()
    a, b, c = clients(30.0), clients(10.0), clients(20.0)
    for client in (a, b, c):
        _queue(roster, client)
    assert roster.next_due() == 10.0
    roster.left(b.sock.fileno(), b)  # granted: its wait no longer ends anything
    assert roster.next_due() == 20.0
    roster.left(c.sock.fileno(), c)
    roster.left(a.sock.fileno(), a)
    assert roster.next_due() == NEVER
    assert not roster.waiting


def test_a_reused_descriptor_is_not_mistaken_for_the_client_that_had_it(clients):
    roster = Roster()
    old = clients(5.0)
    _queue(roster, old)
    fd = old.sock.fileno()
    roster.left(fd, old)
    old.sock.close()
    newcomer = clients(50.0)  # the kernel gives the lowest free descriptor: the old one
    assert newcomer.sock.fileno() == fd
    _queue(roster, newcomer)
    assert roster.next_due() == 50.0  # the old client's 5.0, under the same fd, is stale


def test_tickets_are_counted_once_per_waiting_client_and_uncounted_when_it_leaves(clients):
    roster = Roster()
    a, b = clients(), clients()
    for client in (a, b):
        _queue(roster, client)
    for renewed in (1.0, 2.0, 3.0):  # a ticket renewed is the same holder
        roster.ticket_given(a.sock.fileno(), a, renewed)
    assert roster.ticketed == 1 and a.ticket_at == 3.0
    roster.ticket_given(b.sock.fileno(), b, 2.0)
    assert roster.ticketed == 2
    roster.left(a.sock.fileno(), a)
    roster.left(a.sock.fileno(), a)  # left twice (served, then its connection dropped): once
    assert roster.ticketed == 1
    stranger = clients()  # connected, never in line
    roster.ticket_given(stranger.sock.fileno(), stranger, 4.0)
    assert roster.ticketed == 1


def test_only_clients_yet_to_ask_are_unasked(clients):
    roster = Roster()
    quiet, asking = clients(), clients()
    roster.connected(quiet.sock.fileno(), quiet)
    roster.connected(asking.sock.fileno(), asking)
    assert set(roster.unasked()) == {quiet, asking}
    asking.ask = object()  # type: ignore[assignment]
    assert roster.unasked() == [quiet]
    roster.left(quiet.sock.fileno(), quiet)
    assert roster.unasked() == []


def test_waits_that_never_run_out_do_not_pile_up(clients):
    """Waits with no end (or far ones) that end by a grant never reach the heap's top: it is
    rebuilt from those in line once it holds twice as many."""
    roster = Roster()
    keep = clients(NEVER)
    _queue(roster, keep)
    transient = clients(NEVER).sock  # one descriptor for them all: each leaves before the next comes
    for _ in range(2000):
        client = Client(transient, None)  # type: ignore[arg-type]
        _queue(roster, client)
        roster.left(client.sock.fileno(), client)
    assert len(roster._due) <= 2 * len(roster.waiting) + 64
    assert roster.next_due() == NEVER and list(roster.waiting.values()) == [keep]


class _Waiter:
    def __init__(self, key: str) -> None:
        self.key = key


def test_each_client_in_line_is_found_by_its_waiters_key_and_only_while_in_line(clients):
    """A release's grants name their runs by key: the roster finds each at once, and never one
    that has left the line (served or gone), nor one that has not asked."""
    roster = Roster()
    a, b, c = clients(), clients(), clients()
    for client, key in ((a, "k-a"), (b, "k-b")):
        client.waiter = _Waiter(key)  # type: ignore[assignment]
        _queue(roster, client)
    roster.connected(c.sock.fileno(), c)  # connected, not asked: no waiter, no key
    assert roster.by_key == {"k-a": a, "k-b": b}
    roster.left(a.sock.fileno(), a)
    assert roster.by_key == {"k-b": b}
    roster.left(a.sock.fileno(), a)  # twice (a drop after a grant): nothing else goes
    roster.left(c.sock.fileno(), c)
    assert roster.by_key == {"k-b": b}
