"""The audit trail's channel: a missing syslog socket is said once, and reported by doctor."""
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cudawrap.base.audit import channel_problem


def test_channel_problem_names_a_missing_or_wrong_socket(tmp_path: Path) -> None:
    path = tmp_path / "log"
    assert "missing" in channel_problem(str(path))
    path.write_text("")
    assert "not a socket" in channel_problem(str(path))
    path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    try:
        assert channel_problem(str(path)) is None
    finally:
        sock.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
@pytest.mark.parametrize("present", [True, False])
def test_doctor_reports_a_missing_audit_channel(installed, present: bool) -> None:  # type: ignore[no-untyped-def]
    inst = installed("four-gpus")
    # A private mount namespace with its own /dev: /dev/log there or not, whatever the host has.
    make = ("import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind('/dev/log'); "
            if present else "")
    code = (f"import subprocess, sys; {make}"
            "sys.exit(subprocess.run([sys.executable, '-c', 'from cudawrap.cli import main; main()', 'doctor']).returncode)")
    script = f"mount -t tmpfs none /dev && mknod -m 666 /dev/null c 1 3 && exec {sys.executable} -c \"{code}\""
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], env=inst.environ(), capture_output=True,
                          timeout=120, cwd=inst.bindir)
    lines = [line for line in done.stdout.decode().splitlines() if ": audit: " in line]
    assert len(lines) == 1, (done.stdout, done.stderr)
    if present:
        assert lines[0].startswith("ok: audit: syslog reachable at /dev/log")
    else:
        assert lines[0].startswith("note: audit: /dev/log is missing") and "ledger" in lines[0]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_drain_and_resume_do_not_repeat_the_missing_audit_channel(installed) -> None:  # type: ignore[no-untyped-def]
    """Where no syslog runs (a private /dev without /dev/log), an admin command says nothing
    of it: install.sh said it once, `cudawrap doctor` reports it."""
    inst = installed("four-gpus")
    cli = f"{sys.executable} -c 'from cudawrap.cli import main; main()'"
    script = (f"mount -t tmpfs none /dev && mknod -m 666 /dev/null c 1 3 && test ! -e /dev/log"
              f" && {cli} drain 0 --reason test && {cli} resume 0")
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], env=inst.environ(), capture_output=True,
                          timeout=120, cwd=inst.bindir)
    assert done.returncode == 0, done.stderr
    assert b"drained GPU-" in done.stdout and b"resumed GPU-" in done.stdout
    assert done.stderr == b""
