"""An install that runs with the service (its recorded way), with real accounts: only the
service takes leases.

The lease, slot and queue directories are root's alone, so a user can neither flock a lease
file past the line nor queue a claim; their runs are granted through the service, and when
it does not answer they try again for connect_retry_s and exit 69 with one line.
"""
from __future__ import annotations

import os
import stat
import time
from typing import Iterator

import pytest

from support.installed import ready_line
from test_service import Served, _locks_of, ready_line_of, run_nested
from support.procs import cli_code, root_only

pytestmark = [pytest.mark.root, root_only]

ENFORCE = "[service]\nconnect_retry_s = {retry}\n"


def runs_with_the_service(inst) -> None:  # type: ignore[no-untyped-def]
    """INST's recorded way: the service, its only arbiter (as install.sh records it)."""
    from cudawrap.install.way import SERVICE, write_way

    write_way(inst.layout, SERVICE)


def _mode(path) -> int:  # type: ignore[no-untyped-def]
    return stat.S_IMODE(os.stat(path).st_mode)


def _enforced(mu, retry: float = 2):  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    inst.layout.config_file.write_text(ENFORCE.format(retry=retry))
    inst.layout.config_file.chmod(0o644)
    runs_with_the_service(inst)
    return inst


@pytest.fixture
def enforced(mu) -> Iterator[Served]:
    s = Served(_enforced(mu))
    yield s
    s.proc.terminate()
    s.proc.wait(timeout=10)


def test_the_directories_are_roots_and_a_users_run_holds_what_the_service_granted(enforced: Served) -> None:
    inst = enforced.inst
    layout = inst.layout
    assert (_mode(layout.lease_dir), _mode(layout.share_dir), _mode(layout.queue_dir)) == (0o700, 0o700, 0o1700)
    lease = next(layout.lease_dir.iterdir())
    # Alice cannot open a lease file to flock it past the line, nor write a queue entry.
    for code in (f"open({str(lease)!r})", f"open({str(layout.queue_dir / 'x')!r}, 'w')"):
        tried = inst.run(inst.world.alice, inst.world.python, "-I", "-c", code)
        assert tried.returncode != 0 and b"PermissionError" in tried.stderr, tried.stderr
    run = inst.start(inst.world.alice, "recon", "--hold", "30")
    hello = ready_line(run)
    assert len(hello["devices"]) == 1
    ino = os.stat(layout.lease_dir / hello["cvd"]).st_ino
    assert any(line.split()[5].endswith(f":{ino}") for line in _locks_of(run.pid))
    run.kill()
    run.wait()


def test_a_nested_wrapped_program_keeps_its_parents_lease_under_enforce(enforced: Served) -> None:
    run_nested(enforced.inst)


def test_without_the_service_a_users_run_exits_69_with_one_line_and_leaves_nothing(mu) -> None:
    inst = _enforced(mu, retry=1)
    inst.wrap("recon")
    done = inst.cli(None, "sync")
    assert done.returncode == 0, done.stderr
    assert _mode(inst.layout.lease_dir) == 0o700
    began = time.monotonic()
    run = inst.run(inst.world.alice, "recon", CUDAWRAP_WAIT="0")
    took = time.monotonic() - began
    lines = run.stderr.decode().strip().splitlines()
    assert run.returncode == 69, run.stderr
    # What it does meanwhile, then the error and its hint (the one-line error format).
    assert len(lines) == 3 and "trying again" in lines[0], lines
    assert lines[1] == "recon: the cudawrap service is not running", lines
    # The hint fits this machine: no systemd runs here, and a --prefix install has no unit.
    assert lines[2] == (f"recon: hint: ask the administrator to start it (CUDAWRAP_ROOT={inst.layout.root} "
                        "cudawrap serve --daemon)"), lines
    assert took >= 1.0  # it tried for connect_retry_s
    assert os.listdir(inst.layout.queue_dir) == []
    # Root may still decide for itself: a stopped service does not lock the admin out.
    assert inst.run(None, "recon", CUDAWRAP_WAIT="0").returncode == 0


def test_the_hint_to_start_the_service_fits_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # systemd's unit only where install.sh enables one: a system install where systemd runs.
    from cudawrap.launch import client

    real = os.path.isdir
    for systemd in (True, False):
        monkeypatch.setattr(os.path, "isdir", lambda p: systemd if p == "/run/systemd/system" else real(p))
        assert client.start_command("/") == ("systemctl start cudawrap" if systemd else "cudawrap serve --daemon")
        assert client.start_command("/opt/c w") == "CUDAWRAP_ROOT='/opt/c w' cudawrap serve --daemon"


def test_a_run_that_finds_the_service_restarting_is_served_once_it_is_back(mu) -> None:
    inst = _enforced(mu, retry=20)
    inst.cli(None, "sync")
    inst.wrap("recon")
    run = inst.start(inst.world.alice, "recon", CUDAWRAP_WAIT="0")
    assert b"trying again" in run.stderr.readline()
    code = cli_code(inst.path)
    service = inst.start(None, inst.world.python, "-I", "-c", code, "serve")
    try:
        assert b"listening on" in service.stdout.readline()
        assert run.wait(timeout=30) == 0, run.stderr.read()
    finally:
        service.terminate()
        service.wait(timeout=10)


def test_enforce_false_does_nothing_and_switching_to_daemonless_gives_the_directories_back(mu) -> None:
    """The retired key still parses and changes nothing: sync, config and doctor say so in one
    line each; `cudawrap way daemonless` is what gives the directories back."""
    inst = _enforced(mu)
    inst.cli(None, "sync")
    inst.wrap("recon")
    inst.layout.config_file.write_text("[service]\nenforce = false\n")
    layout = inst.layout
    for command in (("sync",), ("config",), ("doctor",)):
        said = inst.cli(None, *command)
        notes = [line for line in said.stdout.decode().splitlines() if "enforce no longer does anything" in line]
        assert len(notes) == 1 and f"{layout.config_file}:2" in notes[0], (command, said.stdout, said.stderr)
    assert (_mode(layout.lease_dir), _mode(layout.share_dir), _mode(layout.queue_dir)) == (0o700, 0o700, 0o1700)
    switched = inst.cli(None, "way", "daemonless")
    assert switched.returncode == 0, switched.stderr
    assert (_mode(layout.lease_dir), _mode(layout.share_dir), _mode(layout.queue_dir)) == (0o755, 0o755, 0o1777)
    assert inst.run(inst.world.alice, "recon", CUDAWRAP_WAIT="0").returncode == 0


def test_status_for_a_user_comes_from_the_service_whole_and_says_so_without_it(enforced: Served) -> None:
    import json

    inst = enforced.inst
    run = inst.start(inst.world.alice, "recon", "--hold", "30")
    hello = ready_line(run)
    try:
        done = inst.cli(inst.world.bob, "status", "--json")
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        (held,) = [d for d in status["devices"] if d["uuid"] == hello["cvd"]]
        assert (held["holder"]["user"], held["holder"]["pid"]) == (inst.world.alice.name, run.pid)
        table = inst.cli(inst.world.bob, "status")
        assert table.returncode == 0 and inst.world.alice.name.encode() in table.stdout, table.stderr
    finally:
        run.kill()
        run.wait()
    enforced.proc.terminate()
    enforced.proc.wait(timeout=10)
    done = inst.cli(inst.world.bob, "status")
    assert done.returncode == 69, done.stderr
    assert b"the cudawrap service is not running" in done.stderr and b"Traceback" not in done.stderr


def test_bobs_hand_run_program_keeps_its_gpu_from_alice_under_enforce(enforced: Served) -> None:
    """Issue 51 item 1 with enforce on (without it, both ways: tests/test_both_ways.py): bob runs
    the real program past its shim on GPU 0 after the service read the machine; alice's run
    naming GPU 0 is refused as busy, one free to choose gets another GPU."""
    from support.ways import SERVED, Way

    inst = enforced.inst
    gpus = inst.machine.gpu_uuids()
    bobs = Way(SERVED, inst).by_hand(inst.world.bob, gpus[0])
    named = inst.run(inst.world.alice, "recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=gpus[0])
    assert named.returncode == 75 and "no free device: every device it may use is busy" in named.stderr.decode()
    for _ in range(3):
        free = inst.run(inst.world.alice, "recon", CUDAWRAP_WAIT="0")
        assert free.returncode == 0, free.stderr.decode()
        assert ready_line_of(free)["devices"] != [gpus[0]]
    bobs.kill()
