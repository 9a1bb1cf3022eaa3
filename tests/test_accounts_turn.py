"""The service's ledger in one turn of its loop (service/bookkeeping.py): one lock, one read and one
write of the state for however many grants and ends, each grant appended as it happens (before
its send), each end at the turn's end (after the sends), and a look that comes meanwhile waits
for the state to name them; a turn carried on to the next keeps all of that until released."""
from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

from cudawrap.install.installation import prepare
from cudawrap.service import bookkeeping as accounts, ledgerturn
from cudawrap.ledger import files as ledgerfile
from cudawrap.ledger.writer import Writer
from cudawrap.paths import Layout
from support.procs import Spawned


def _layout(tmp_path: Path) -> Layout:
    layout = Layout(tmp_path / "root")
    prepare(layout, sys.executable)
    return layout


def _records(layout: Layout) -> List[dict]:
    path = ledgerfile.ledger_path(layout)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _state(layout: Layout) -> dict:
    path = layout.state_dir / ledgerfile.STATE
    return json.loads(path.read_text()) if path.exists() else {"open": {}}


def _grant(layout: Layout, pid: int, device: str = "GPU-a", send=lambda: True):  # type: ignore[no-untyped-def]
    return accounts.grant(layout, pid, os.getuid(), [device], "/bin/recon", 0.0, None, send)


def _clients(spawned: Spawned, n: int) -> List[int]:
    """N live pids to grant to (sleeps, reaped when the test ends)."""
    return [spawned(["sleep", "30"]).pid for _ in range(n)]


@pytest.fixture(autouse=True)
def _nothing_carried() -> Iterator[None]:
    yield
    ledgerturn.release()  # a turn a test left carried holds the ledger's lock


def _look_would_wait(layout: Layout) -> bool:
    fd = os.open(layout.state_dir / ledgerfile.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_a_turn_appends_each_record_at_once_and_writes_the_state_once_at_its_end(
        tmp_path: Path, spawned: Spawned) -> None:
    layout = _layout(tmp_path)
    pids = _clients(spawned, 3)
    sent: List[int] = []
    first = _grant(layout, pids[0])
    assert first is not None and first in _state(layout)["open"]  # alone: a turn of its own
    with ledgerturn.turn(layout):
        accounts.end(layout, first)
        ids = [_grant(layout, pid, f"GPU-{pid}", lambda pid=pid: sent.append(pid) or True) for pid in pids[1:]]
        # Appended as they happened, the grants before their descriptors left (send)...
        assert [r["event"] for r in _records(layout)] == ["grant", "grant", "grant"]
        assert sent == pids[1:]
        # ...while the state is written once, at the end, and a look waits for it.
        assert first in _state(layout)["open"]
        assert _look_would_wait(layout)
    assert not _look_would_wait(layout)
    assert sorted(_state(layout)["open"]) == sorted(i for i in ids if i)
    # ...and the end after them, at the turn's end, with the time end() was called.
    records = _records(layout)
    assert [r["event"] for r in records] == ["grant", "grant", "grant", "end"]
    assert records[-1]["id"] == first and records[-1]["end"] < records[-2]["seen"] + 1e-3


def test_a_turns_grants_are_sent_before_the_state_is_read_and_entered_open_at_its_end(
        tmp_path: Path, spawned: Spawned, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven releases at once are seven grants in one turn: none waits for the state's read
    (only the lock is taken before a send), and each is open in the state the turn writes;
    one ended in the same turn is not."""
    layout = _layout(tmp_path)
    pids = _clients(spawned, 3)
    assert _grant(layout, pids[0]) is not None  # the state is seen to be this boot's from now on
    loads: List[str] = []
    real_load = accounts.ledger.load_state
    monkeypatch.setattr(accounts.ledger, "load_state", lambda path: loads.append("load") or real_load(path))
    sent: List[str] = []
    with ledgerturn.turn(layout):
        ids = [_grant(layout, pid, f"GPU-{pid}", lambda pid=pid: sent.append(f"sent {pid}") or True)
               for pid in pids[1:]]
        assert loads == [] and len(sent) == 2  # both sent, the state not read yet
        accounts.end(layout, ids[0])  # the first of them ends within the same turn
    assert loads == ["load"]  # once, at the turn's end
    state = _state(layout)["open"]
    assert ids[1] in state and ids[0] not in state
    records = _records(layout)
    assert [(r["event"], r["id"]) for r in records[-3:]] == [("grant", ids[0]), ("grant", ids[1]), ("end", ids[0])]


def test_a_carried_turn_keeps_its_lock_and_state_until_released(tmp_path: Path, spawned: Spawned) -> None:
    """The service's loop carries its turn on (turn(carry=True)): the ends are written at
    each turn's end, the state once, when the loop is idle or the turn old (release)."""
    layout = _layout(tmp_path)
    pids = _clients(spawned, 2)
    with ledgerturn.turn(layout, carry=True):
        a = _grant(layout, pids[0])
    assert _look_would_wait(layout) and a not in _state(layout)["open"]  # carried: not written yet
    assert ledgerturn.idle_within(10.0) == ledgerturn.CARRY_IDLE_S
    with ledgerturn.turn(layout, carry=True):
        accounts.end(layout, a)
        b = _grant(layout, pids[1])
    assert [r["event"] for r in _records(layout)] == ["grant", "grant", "end"]  # the end: at its turn's end
    ledgerturn.release(older_than=60.0)
    assert _look_would_wait(layout)  # younger than that: still carried
    ledgerturn.idle()  # nothing happened for CARRY_IDLE_S: written once, let go
    assert not _look_would_wait(layout)
    assert list(_state(layout)["open"]) == [b]
    assert ledgerturn.idle_within(10.0) == ledgerturn.IDLE_SYNC_S  # the fsync's turn next
    with ledgerturn.turn(layout, carry=True):
        pass  # nothing recorded: nothing carried
    assert not _look_would_wait(layout) and ledgerturn.idle_within(10.0) == ledgerturn.IDLE_SYNC_S
    ledgerturn.idle()
    assert ledgerturn.idle_within(10.0) == 10.0


def test_a_carried_turn_is_not_carried_past_an_error(tmp_path: Path, spawned: Spawned) -> None:
    layout = _layout(tmp_path)
    (pid,) = _clients(spawned, 1)
    with pytest.raises(KeyboardInterrupt):
        with ledgerturn.turn(layout, carry=True):
            a = _grant(layout, pid)
            raise KeyboardInterrupt  # the service stopped by a signal mid-turn
    assert not _look_would_wait(layout) and a in _state(layout)["open"]


def test_a_restart_closes_in_the_state_what_the_ledger_ended_before_a_crash(tmp_path: Path, spawned: Spawned) -> None:
    """Killed after a turn's ends were written and before its state was (a carried turn):
    the state still names the lease open. accounts.recover closes it there, so nobody records
    its end a second time; a grant recorded and missing from the state is entered."""
    layout = _layout(tmp_path)
    pids = _clients(spawned, 2)
    a = _grant(layout, pids[0])
    state_before = (layout.state_dir / ledgerfile.STATE).read_bytes()
    with ledgerturn.turn(layout):
        accounts.end(layout, a)
        b = _grant(layout, pids[1], "GPU-b")
    (layout.state_dir / ledgerfile.STATE).write_bytes(state_before)  # as if killed before the state's write
    assert list(_state(layout)["open"]) == [a]
    assert accounts.recover(layout) == (1, 1)
    assert list(_state(layout)["open"]) == [b]
    assert accounts.recover(layout) == (0, 0)
    # A state of an earlier boot is left to a look (which ends what that boot held).
    state = _state(layout)
    state["boot"] = "an-earlier-boot"
    (layout.state_dir / ledgerfile.STATE).write_text(json.dumps(state))
    assert accounts.recover(layout) == (0, 0)
    assert list(_state(layout)["open"]) == [b]


def test_a_grant_whose_sending_fails_is_ended_at_once_and_never_open(tmp_path: Path, spawned: Spawned) -> None:
    layout = _layout(tmp_path)
    (pid,) = _clients(spawned, 1)
    with ledgerturn.turn(layout):
        assert _grant(layout, pid, send=lambda: False) is None
    records = _records(layout)
    assert [r["event"] for r in records] == ["grant", "end"]
    assert "not taken" in records[1]["how"] and _state(layout)["open"] == {}  # never entered


@pytest.fixture
def writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Tuple[Writer, threading.Event]]:
    """The service's writer (ledgerturn.background()), held up until the Event is set: what the
    loop does while the writer is inside a slow rename."""
    w = Writer()
    gate = threading.Event()
    w.submit(lambda: gate.wait(10))
    monkeypatch.setattr(ledgerturn, "_writer", w)
    yield w, gate
    gate.set()
    ledgerturn.finish()
    monkeypatch.setattr(ledgerturn, "_writing", None)


def test_in_the_service_the_writer_writes_the_state_and_then_lets_go_of_the_lock(
        tmp_path: Path, spawned: Spawned, writer: Tuple[Writer, threading.Event]) -> None:
    w, gate = writer
    layout = _layout(tmp_path)
    (pid,) = _clients(spawned, 1)
    with ledgerturn.turn(layout, carry=True):
        a = _grant(layout, pid)
    ledgerturn.release()  # returns at once: the writer is held up
    assert _look_would_wait(layout) and a not in _state(layout)["open"]
    ledgerturn.flush()
    gate.set()
    w.wait()
    # In that order: a look that got the lock would find the grant in the state.
    assert not _look_would_wait(layout) and list(_state(layout)["open"]) == [a]
    assert ledgerturn.idle_within(10.0) == 10.0  # the fsyncs were queued, nothing is left


def test_a_hand_over_while_the_writer_writes_takes_the_turn_back_without_waiting(
        tmp_path: Path, spawned: Spawned, writer: Tuple[Writer, threading.Event]) -> None:
    """Without a wait for the lock nor a read of the state: nobody could have written the
    ledger since its release, so the turn's state is still the truth."""
    w, gate = writer
    layout = _layout(tmp_path)
    pids = _clients(spawned, 2)
    with ledgerturn.turn(layout, carry=True) as first:
        a = _grant(layout, pids[0])
    ledgerturn.release()
    with ledgerturn.turn(layout, carry=True) as again:
        accounts.end(layout, a)
        b = _grant(layout, pids[1], "GPU-b")
    assert again is first
    gate.set()
    w.wait()
    # The release's state (a open) is written, and the lock kept: the turn goes on.
    assert _look_would_wait(layout) and list(_state(layout)["open"]) == [a]
    ledgerturn.release()
    w.wait()
    assert not _look_would_wait(layout) and list(_state(layout)["open"]) == [b]
    assert [r["event"] for r in _records(layout)] == ["grant", "grant", "end"]


def test_a_turn_released_long_after_its_lock_was_taken_is_not_taken_back(
        tmp_path: Path, spawned: Spawned, writer: Tuple[Writer, threading.Event],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A look waits for the lock at most CARRY_MAX_S while runs come and go: past that, the
    writer lets go of it, and the next turn takes it anew (and reads the state a look may
    have written)."""
    w, gate = writer
    layout = _layout(tmp_path)
    (pid,) = _clients(spawned, 1)
    with ledgerturn.turn(layout, carry=True) as first:
        a = _grant(layout, pid)
    monkeypatch.setattr(ledgerturn, "CARRY_MAX_S", 0.0)
    ledgerturn.release()
    with ledgerturn.turn(layout, carry=True) as then:
        assert then is not first and then.lock is None  # its lock taken only when it records
    gate.set()
    w.wait()
    assert not _look_would_wait(layout) and list(_state(layout)["open"]) == [a]
