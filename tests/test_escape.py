"""Text chosen by users (program names, planted file names, reasons) never reaches an admin's
terminal or the audit log with its control characters: they are escaped, visibly."""
import syslog
from typing import List

import pytest

from support.admin import Admin
from cudawrap.base import audit
from cudawrap.base.text import printable

ESC = "\x1b]0;owned\x07\x1b[2J"  # set the terminal title, clear the screen


@pytest.mark.parametrize("text, shown", [
    ("recon", "recon"),
    ("my prog é 日本", "my prog é 日本"),
    ("a\x1b[2Jb", "a\\x1b[2Jb"),
    ("line\nfake: ok", "line\\nfake: ok"),
    ("evil\u202etxt.exe", "evil\\u202etxt.exe"),
    ("raw\udcffbyte", "raw\\xffbyte"),  # an undecodable byte of a file name (surrogateescape)
], ids=["plain", "unicode", "escape", "newline", "bidi", "raw-byte"])
def test_printable(text: str, shown: str) -> None:
    assert printable(text) == shown


def test_audit_lines_escape_what_users_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: List[str] = []
    monkeypatch.setattr(syslog, "syslog", lambda *args: sent.append(args[-1]))
    audit.log("grant", program=f"recon{ESC}\ngrant user=root", devices="GPU-1", reason='say "hi"')
    (line,) = sent
    assert line.isprintable(), line
    assert "\\x1b]0;owned\\x07\\x1b[2J" in line and "\\ngrant" in line
    # The forged "user=root" stays inside the quoted program value.
    assert 'program="recon\\x1b]0;owned\\x07\\x1b[2J\\ngrant user=root"' in line
    assert 'reason="say \\"hi\\""' in line and " devices=GPU-1" in line


def test_doctor_escapes_planted_names(admin: Admin) -> None:
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    planted = admin.bindir / f".cudawrap-tmp-x{ESC}"
    planted.symlink_to("/nonexistent")
    result = admin.cli("doctor")
    assert "\x1b" not in result.stdout + result.stderr and "\x07" not in result.stdout
    assert any(line.startswith(f"warning: {admin.bindir}/.cudawrap-tmp-x\\x1b]0;owned\\x07")
               for line in result.stdout.splitlines()), result.stdout


def test_list_escapes_program_names(admin: Admin) -> None:
    prog = admin.program(f"recon{ESC}")
    assert admin.create(str(prog)).returncode == 0
    prog.unlink()  # so that list also prints a detail line naming it
    result = admin.cli("list")
    assert result.returncode == 0
    assert "\x1b" not in result.stdout + result.stderr
    assert "recon\\x1b]0;owned\\x07\\x1b[2J" in result.stdout
    assert f"{admin.bindir}/recon\\x1b]0;owned\\x07\\x1b[2J is missing" in result.stderr
