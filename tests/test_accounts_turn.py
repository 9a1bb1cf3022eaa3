"""The service's ledger in one turn of its loop (ops/accounts.py): one lock, one read and one
write of the state for however many grants and ends, each record appended as it happens, and
a look that comes meanwhile waits for the state to name them."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

from cudawrap.install.installation import prepare
from cudawrap.ops import accounts, ledgerfile
from cudawrap.paths import Layout


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


def _look_would_wait(layout: Layout) -> bool:
    fd = os.open(layout.state_dir / ledgerfile.LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_a_turn_appends_each_record_at_once_and_writes_the_state_once_at_its_end(tmp_path: Path) -> None:
    layout = _layout(tmp_path)
    sleepers = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]  # the clients: live pids
    sent: List[int] = []
    try:
        first = accounts.grant(layout, sleepers[0].pid, os.getuid(), ["GPU-a"], "/bin/recon", 0.0, None,
                               lambda: True)
        assert first is not None and first in _state(layout)["open"]  # alone: a turn of its own
        with accounts.turn(layout):
            accounts.end(layout, first)
            ids = [accounts.grant(layout, p.pid, os.getuid(), [f"GPU-{p.pid}"], "/bin/recon", 0.0, None,
                                  lambda p=p: sent.append(p.pid) or True) for p in sleepers[1:]]
            # Appended as they happened, the grants before their descriptors left (send)...
            assert [r["event"] for r in _records(layout)] == ["grant", "end", "grant", "grant"]
            assert sent == [p.pid for p in sleepers[1:]]
            # ...while the state is written once, at the end, and a look waits for it.
            assert first in _state(layout)["open"]
            assert _look_would_wait(layout)
        assert not _look_would_wait(layout)
        assert sorted(_state(layout)["open"]) == sorted(i for i in ids if i)
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_a_grant_whose_sending_fails_is_ended_at_once_and_never_open(tmp_path: Path) -> None:
    layout = _layout(tmp_path)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        with accounts.turn(layout):
            assert accounts.grant(layout, sleeper.pid, os.getuid(), ["GPU-a"], "/bin/recon", 0.0, None,
                                  lambda: False) is None
        records = _records(layout)
        assert [r["event"] for r in records] == ["grant", "end"]
        assert "not taken" in records[1]["how"] and _state(layout)["open"] == {}  # never entered
    finally:
        sleeper.kill()
        sleeper.wait()
