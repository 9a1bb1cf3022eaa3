"""The service's watch on the files (service/filewatch.py): what wakes a decision, and what does not.

A listing of a watched directory (the monitor's loop lists the lease and slot directories
every pass) used to read as a close, so each one woke a decision over every waiter, during
hand-overs too. Only a lease or slot file's close, a lease file made or removed, a queue
entry, or a drain is news.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from cudawrap import locations as loc
from cudawrap.service.filewatch import FileWatch


@pytest.fixture()
def watched(tmp_path: Path) -> tuple:
    root = str(tmp_path)
    lease_dir, queue_dir = loc.under(root, loc.LEASE_DIR), loc.under(root, loc.QUEUE_DIR)
    for d in (lease_dir, queue_dir, loc.under(root, loc.SHARE_DIR), os.path.dirname(loc.under(root, loc.DRAINS))):
        os.makedirs(d, exist_ok=True)
    lease = Path(lease_dir) / "GPU-1"
    lease.write_text("")
    watch = FileWatch(root, lease_dir, queue_dir)
    yield watch, Path(lease_dir), lease, Path(loc.under(root, loc.SHARE_DIR))
    watch.watch.close()


def test_a_listing_of_the_lease_or_slot_directory_is_no_news(watched: tuple) -> None:
    watch, lease_dir, _lease, share_dir = watched
    os.listdir(lease_dir)
    os.listdir(share_dir)
    news = watch.read()
    assert not news.decide
    assert news.touched == [] and news.closed == set() and not news.renamed


def test_a_lease_files_close_is_news_and_its_open_alone_is_not(watched: tuple) -> None:
    watch, lease_dir, lease, _share = watched
    fd = os.open(lease, os.O_RDONLY)
    opened = watch.read()
    assert not opened.decide and opened.touched == ["GPU-1"]
    os.listdir(lease_dir)  # a listing between the two changes nothing
    os.close(fd)
    closed = watch.read()
    assert closed.decide and closed.closed == {"GPU-1"}


def test_a_slot_files_close_and_a_lease_file_made_are_news(watched: tuple) -> None:
    watch, lease_dir, _lease, share_dir = watched
    (share_dir / "GPU-1.2").write_text("")
    assert watch.read().closed == {"GPU-1"}
    (lease_dir / "GPU-2").write_text("")
    news = watch.read()
    assert news.decide and news.renamed


def test_the_ledgers_writes_beside_the_drains_wake_nothing_and_a_drain_is_news(watched: tuple, tmp_path: Path) -> None:
    """The ledger is written in the drains' directory: each grant appended to it, and its lock
    taken and let go, closed a file open for writing there, and woke the service's loop once
    more while the run it had just granted started."""
    import select

    from cudawrap.ledger import files as ledgerfile
    from cudawrap.paths import Layout
    from cudawrap.sched.drains import drain, resume

    watch = watched[0]
    layout = Layout(tmp_path)
    with ledgerfile.Locked(layout):
        ledgerfile.append(ledgerfile.ledger_path(layout), [{"v": 1, "event": "grant", "id": "x"}], 1 << 20, 4)
    assert select.select([watch.fileno()], [], [], 0)[0] == []
    drain(str(tmp_path), ["GPU-1"], "maintenance", "root")
    news = watch.read()
    assert news.decide and news.elsewhere
    resume(str(tmp_path), ["GPU-1"])
    assert watch.read().decide
