"""kill -9 at every step of ``create-cudawrap`` and ``cudawrap unwrap``, from outside.

Nothing in cudawrap knows it is being tested: strace runs the real command and delivers
SIGKILL on entry to its N-th call of one system call (``-e inject=SYSCALL:signal=KILL:when=N``).
A first, untouched run lists the command's file system calls (``strace -y``: with the
paths their descriptors name); then the command is killed at each call that touches the
install root or the program's directory, one run per call, until every one has been hit.

After each kill: the program still runs under its name; ``cudawrap doctor`` reports
the half-done operation (unhealthy, naming the program) unless the state is already clean;
``doctor --repair`` leaves a clean, consistent wrap (or none at all); and doctor is then
silent. Read-only opens and fsync are skipped by default: SIGKILL on entry to them leaves
exactly the state of the kill at the next call (the page cache survives a killed process);
``CUDAWRAP_CRASH_EVERY_CALL=1`` kills there as well.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List

import pytest

from cudawrap.policy import registry
from cudawrap.admin.divert import Dpkg
from cudawrap.admin.doctor import check, healthy
from cudawrap.admin.inspect_wraps import OK, inspect_entry
from cudawrap.policy.registry import WRAPPED
from cudawrap.admin.unwrap import unwrap_programs
from cudawrap.admin.shimlinks import TMP_PREFIX
from cudawrap.admin.wrap import wrap_programs
from support.admin import Admin, snapshot
from support.strace import Call, inject, needs_strace, traced

pytestmark = [needs_strace, pytest.mark.slow]

NO_DPKG = Dpkg(available=False)
EVERY_CALL = bool(os.environ.get("CUDAWRAP_CRASH_EVERY_CALL"))


def kill_points(calls: List[Call], *roots: Path) -> List[Call]:
    return [c for c in calls if c.touches(*roots)
            and (EVERY_CALL or not (c.is_read() or c.syscall in ("fsync", "fdatasync")))]


def doctor(admin: Admin, repair: bool = False):  # type: ignore[no-untyped-def]
    # PATH="" keeps the search for stray wraps to this install's directories.
    return check(admin.layout, repair=repair, dpkg=NO_DPKG, environ={"PATH": ""})


def state(admin: Admin, prog: Path, original: dict) -> str:
    """"unwrapped" (as before, no entry), "wrapped" (entry and disk agree) or "inconsistent"."""
    entry = registry.load(admin.layout).find(str(prog))
    strays = [n for n in os.listdir(admin.bindir) if n.startswith(TMP_PREFIX)]
    if entry is None:
        return "unwrapped" if snapshot(admin.bindir) == original else "inconsistent"
    if entry.phase == WRAPPED and inspect_entry(admin.layout, entry).state == OK and not strays:
        real = admin.bindir / f"CUDAWRAP_{prog.name}"
        if real.stat().st_ino == original[str(prog)][2] and os.readlink(prog) == str(admin.layout.program_shim(str(prog))):
            return "wrapped"
    return "inconsistent"


def sweep(admin: Admin, prog: Path, argv: List[str], before: Callable[[], None]) -> int:
    """Kill ARGV at each of its calls in turn, starting each time from BEFORE's state."""
    assert registry.load(admin.layout).find(str(prog)) is None
    original = snapshot(admin.bindir)  # PROG unwrapped: what "cleanly absent" looks like
    before()
    done, calls = traced(argv, admin.environ(), Path("/"))
    assert done.returncode == 0, done.stderr
    points = kill_points(calls, admin.layout.root, admin.bindir)
    assert len(points) >= 15, [c.text for c in calls]
    killed = 0
    retries = 0
    index = 0
    while index < len(points):
        call = points[index]
        before()
        result, hit = inject(argv, call, "signal=KILL", admin.environ(), Path("/"))
        if hit is None or hit.args() != call.args():
            # The command's calls shifted (a source file recompiled meanwhile): list them again.
            retries += 1
            assert retries <= 3, f"kill meant for {call.text} hit {hit and hit.text}"
            recover(admin, prog)
            before()
            done, calls = traced(argv, admin.environ(), Path("/"))
            points = kill_points(calls, admin.layout.root, admin.bindir)
            continue
        assert result.returncode == -9, (call.text, result.returncode, result.stderr)
        killed += 1
        where = f"killed at {call.syscall} #{call.nth}: {call.text}"
        ran = admin.run(prog, "x")
        assert (ran.returncode, ran.stdout) == (0, f"{prog.name} x\n"), (where, ran.stderr)

        now = state(admin, prog, original)
        findings = doctor(admin)
        if now == "inconsistent":
            assert not healthy(findings), (where, [f.line() for f in findings])
            named = [f for f in findings if f.level in ("error", "warning") and prog.name in f.line()]
            assert named, (where, [f.line() for f in findings])
        else:
            assert healthy(findings), (where, [f.line() for f in findings])
        repaired = doctor(admin, repair=True)
        assert healthy(repaired), (where, [f.line() for f in repaired])
        after = doctor(admin)
        loud = [f.line() for f in after if f.level in ("error", "warning", "fixed")]
        assert not loud, (where, loud)
        assert state(admin, prog, original) in ("wrapped", "unwrapped"), where
        ran = admin.run(prog, "y")
        assert (ran.returncode, ran.stdout) == (0, f"{prog.name} y\n"), (where, ran.stderr)
        index += 1
    return killed


def recover(admin: Admin, prog: Path) -> None:
    doctor(admin, repair=True)


def ensure_unwrapped(admin: Admin, prog: Path, original: dict) -> Callable[[], None]:
    def before() -> None:
        if registry.load(admin.layout).find(str(prog)) is not None:
            outcome = unwrap_programs(admin.layout, [str(prog)], dpkg=NO_DPKG)
            assert not outcome.failed, outcome.failed
        assert snapshot(admin.bindir) == original

    return before


def ensure_wrapped(admin: Admin, prog: Path) -> Callable[[], None]:
    def before() -> None:
        entry = registry.load(admin.layout).find(str(prog))
        if entry is None:
            outcome = wrap_programs(admin.layout, [str(prog)], {}, dpkg=NO_DPKG, user="root")
            assert not outcome.failed, outcome.failed
            entry = outcome.wrapped[0]
        assert inspect_entry(admin.layout, entry).state == OK

    return before


@pytest.fixture
def crash_admin(admin: Admin) -> Admin:
    # Another wrapped program, so that the registry holds more than the entry at stake.
    other = admin.program("other")
    assert not wrap_programs(admin.layout, [str(other)], {}, dpkg=NO_DPKG, user="root").failed
    return admin


def test_kill_9_at_every_step_of_create(crash_admin: Admin) -> None:
    admin = crash_admin
    prog = admin.program("recon")
    original = snapshot(admin.bindir)
    argv = admin.argv(str(prog), prog="create-cudawrap")
    killed = sweep(admin, prog, argv, ensure_unwrapped(admin, prog, original))
    assert killed >= 15
    assert admin.run(admin.bindir / "other").stdout == "other \n"  # the bystander never noticed


def test_kill_9_at_every_step_of_unwrap(crash_admin: Admin) -> None:
    admin = crash_admin
    prog = admin.program("recon")
    argv = admin.argv("unwrap", str(prog))
    killed = sweep(admin, prog, argv, ensure_wrapped(admin, prog))
    assert killed >= 15
    assert admin.run(admin.bindir / "other").stdout == "other \n"


def test_cli_doctor_reports_and_repairs_a_killed_create(crash_admin: Admin) -> None:
    """The same through the commands an admin types: doctor exits non-zero naming the
    program, doctor --repair fixes it, then doctor is clean and list shows it ok."""
    admin = crash_admin
    prog = admin.program("recon")
    argv = admin.argv(str(prog), prog="create-cudawrap")
    _, calls = traced(argv, admin.environ(), Path("/"))
    unwrap_programs(admin.layout, [str(prog)], dpkg=NO_DPKG)
    (link,) = [c for c in calls if c.syscall in ("link", "linkat") and c.touches(admin.bindir)]
    result, hit = inject(argv, link, "signal=KILL", admin.environ(), Path("/"))
    assert result.returncode == -9 and hit is not None
    assert admin.run(prog).returncode == 0
    found = admin.cli("doctor")
    assert found.returncode != 0
    assert any(str(prog) in line and line.startswith("error:") for line in found.stdout.splitlines()), found.stdout
    repaired = admin.cli("doctor", "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert admin.cli("doctor").returncode == 0
    listed = admin.cli("list")
    states = {line.split()[1]: line.split()[0] for line in listed.stdout.splitlines()[1:]}
    assert states == {str(prog): "ok", str(admin.bindir / "other"): "ok"}, listed.stdout
    assert admin.run(prog, "z").stdout == "recon z\n"
