"""The monitor's look while the service records every lease itself (ledger.quiet): where a
look could record nothing it takes no lock, so that no grant waits for it; anything a look
could record (a lease taken past the service, a queue entry, a lease a look recorded, no
service, a last full look too old) makes it look in full, as before."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator, List

import pytest

from cudawrap import locations as loc
from cudawrap.install.installation import prepare
from cudawrap.lease.files import lock_table
from cudawrap.service import bookkeeping as accounts, ledgerturn
from cudawrap.ledger import looks as ledger, files as ledgerfile
from cudawrap.paths import Layout
from support.procs import Spawned

# Holds the lease files named on its command line (exclusive flocks) until killed.
HOLD = ("import fcntl, os, sys, time\n"
        "fds = [os.open(p, os.O_RDONLY) for p in sys.argv[1:]]\n"
        "for fd in fds:\n"
        "    fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n")


@pytest.fixture
def layout(tmp_path: Path) -> Iterator[Layout]:
    layout = Layout(tmp_path / "root")
    prepare(layout, sys.executable)
    yield layout
    ledgerturn.release()  # nothing carried past the test


@pytest.fixture
def service(layout: Layout) -> Iterator[int]:
    """The service's lock held as `cudawrap serve` holds it, so ledger.service_running says
    it runs; yields the descriptor (closing it stops "the service")."""
    fd = os.open(loc.under(str(layout.root), loc.SERVICE_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield fd
    finally:
        os.close(fd)


def _hold(spawned: Spawned, layout: Layout, *uuids: str) -> subprocess.Popen:
    paths = []
    for uuid in uuids:
        path = layout.lease_dir / uuid
        path.touch()
        paths.append(str(path))
    proc = spawned([sys.executable, "-c", HOLD, *paths], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "held\n"
    return proc


def _served(spawned: Spawned, layout: Layout, uuid: str) -> subprocess.Popen:
    """A run the service granted UUID: recorded as it records a grant, its lock then taken."""
    client = _hold(spawned, layout, uuid)
    assert accounts.grant(layout, client.pid, os.getuid(), [uuid], "/opt/app/bin/recon", 0.0, None, lambda: True)
    return client


def _state(layout: Layout) -> dict:
    return json.loads((layout.state_dir / ledgerfile.STATE).read_text())


def _records(layout: Layout) -> List[dict]:
    path = ledgerfile.ledger_path(layout)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _quiet(layout: Layout) -> bool:
    return ledger.quiet(layout, lock_table()) is not None


def test_a_monitors_look_while_the_service_recorded_every_lease_takes_no_lock(
        layout: Layout, service: int, spawned: Spawned) -> None:
    client = _served(spawned, layout, "GPU-a")
    ledger.observe(layout, "monitor")  # the last full look: the state's "looked"
    before = _records(layout)
    found: List[ledger.Observation] = []
    look = threading.Thread(target=lambda: found.append(ledger.observe(layout, "monitor", unless_quiet=True)))
    with ledgerfile.Locked(layout):  # a full look would wait for this lock
        look.start()
        look.join(30)
        waited = look.is_alive()
    look.join()
    assert not waited, "the monitor's look waited for the ledger's lock though it had nothing to record"
    assert [r["pid"] for r in found[0].open.values()] == [client.pid]
    assert found[0].grants == [] and found[0].ends == [] and _records(layout) == before


def test_whatever_a_look_could_record_makes_the_monitor_look_in_full(
        layout: Layout, service: int, spawned: Spawned) -> None:
    _served(spawned, layout, "GPU-a")
    ledger.observe(layout, "monitor")
    assert _quiet(layout)  # so that each refusal below is the case's own
    state = _state(layout)
    assert ledger.quiet(layout, lock_table(), now=state["looked"] + ledger.QUIET_MAX_S) is None

    entry = layout.queue_dir / "123.456.1.0.wait"
    entry.write_text("")
    assert not _quiet(layout)  # a run waiting in the queue directory
    entry.unlink()
    assert _quiet(layout)

    past = _hold(spawned, layout, "GPU-b")  # a lease taken past the service
    assert not _quiet(layout)
    obs = ledger.observe(layout, "monitor", unless_quiet=True)
    assert [(g["pid"], g["devices"]) for g in obs.grants] == [(past.pid, ["GPU-b"])]
    assert not _quiet(layout)  # the lease a look recorded is a look's to end
    past.kill()
    past.wait()
    assert not _quiet(layout)
    obs = ledger.observe(layout, "monitor", unless_quiet=True)
    assert [(e["pid"], e["how"]) for e in obs.ends] == [(past.pid, "ended")]
    assert _quiet(layout)


def test_without_the_service_the_monitor_always_looks_in_full(
        layout: Layout, service: int, spawned: Spawned) -> None:
    _served(spawned, layout, "GPU-a")
    ledger.observe(layout, "monitor")
    assert _quiet(layout)
    fcntl.flock(service, fcntl.LOCK_UN)  # the service is gone: its grants' ends are a look's to record
    assert not _quiet(layout)


def test_a_child_holding_a_lease_its_client_left_is_left_to_a_full_look(
        layout: Layout, service: int, spawned: Spawned) -> None:
    _served(spawned, layout, "GPU-a")
    heir = _hold(spawned, layout, "GPU-c")
    assert accounts.grant(layout, os.getpid(), os.getuid(), ["GPU-c"], "/opt/app/bin/recon", 0.0, None,
                          lambda: True)  # granted to this process, the lock taken by another
    ledger.observe(layout, "monitor")
    assert heir.poll() is None and not _quiet(layout)
