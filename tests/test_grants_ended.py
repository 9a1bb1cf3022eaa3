"""When a grant of the service has ended (service/grants.py: Grants.check).

In a burst the next run is sent a freed device and locks it before the service reads the
previous client's exit: the lease then reads held, by the next run. Read as the previous
grant's, its end was recorded only at the next run's end (8 of 50 leases of a 50-job burst
lasted 2 s in the ledger for 1 s runs). A device the service sent to a later run was free
when it did: that grant has let go of it.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Iterator, Tuple

import pytest

from cudawrap.install.installation import prepare_runtime
from cudawrap.lease.files import LeaseFiles
from cudawrap.service.grants import Grants, Held, Pending
from cudawrap.ops.sync import sync_lease_files
from cudawrap.paths import Layout

UUID = "GPU-8e2c1f4a-0000-0000-0000-000000000001"


@pytest.fixture
def grants(tmp_path: Path) -> Iterator[Tuple[Grants, Path]]:
    layout = Layout(tmp_path)
    prepare_runtime(layout)
    layout.state_dir.mkdir(parents=True, exist_ok=True)
    sync_lease_files(str(layout.lease_dir), [UUID])
    yield Grants(LeaseFiles(str(layout.lease_dir)), layout), layout.lease_dir / UUID


def _held(grants: Grants, pid: int, since: float) -> Held:
    held = Held(1000, pid, os.open(os.devnull, os.O_RDONLY), [UUID], "recon", since, lease_id=f"lease-{pid}")
    grants.held[held.pidfd] = held
    return held


def _locked(lease: Path) -> int:
    fd = os.open(lease, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_grant_whose_device_the_next_run_holds_has_ended(grants: Tuple[Grants, Path]) -> None:
    g, lease = grants
    old, new = _held(g, 101, 1.0), _held(g, 102, 2.0)
    next_runs_lock = _locked(lease)  # the next run took it before the old client's exit was read
    try:
        assert g.check(old) and old.pidfd not in g.held
        assert not g.check(new)  # its own lock stands, and nobody was sent the device since
        assert new.pidfd in g.held and new.ended == []
    finally:
        os.close(next_runs_lock)
    assert g.check(new)  # let go now


def test_a_grant_whose_device_was_sent_and_not_yet_taken_has_ended(grants: Tuple[Grants, Path]) -> None:
    g, lease = grants
    old = _held(g, 103, 1.0)
    g.pending["k"] = Pending("k", 104, [UUID], [], float("inf"))
    taking = _locked(lease)
    try:
        assert g.check(old)
    finally:
        os.close(taking)


def test_a_grant_whose_device_someone_else_holds_has_not_ended(grants: Tuple[Grants, Path]) -> None:
    """Its client's child, say, holds the lease: nothing was sent since, so it stays open."""
    g, lease = grants
    old = _held(g, 105, 1.0)
    child = _locked(lease)
    try:
        assert not g.check(old) and old.pidfd in g.held
    finally:
        os.close(child)
    assert g.check(old)
