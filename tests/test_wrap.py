"""Wrapping and unwrapping: the real program stays intact and runnable at every moment."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from support.admin import Admin, snapshot
from support.strace import needs_strace, strace_cli
from cudawrap.policy import registry
from cudawrap.admin.divert import Dpkg
from cudawrap.errors import StateError, UsageError
from cudawrap.admin.inspect_wraps import BINARY_CHANGED, INTERRUPTED, OK, inspect_entry
from cudawrap.admin.unwrap import unwrap_programs
from cudawrap.admin.wrap import wrap_programs
from cudawrap.admin.wrapcheck import check_wrap

NO_DPKG = Dpkg(available=False)


def wrap(admin: Admin, *paths, policy=None, user="alice"):
    return wrap_programs(admin.layout, [str(p) for p in paths], policy or {}, dpkg=NO_DPKG, user=user)


def unwrap(admin: Admin, *paths, force=False, everything=False):
    return unwrap_programs(admin.layout, [str(p) for p in paths], force=force, everything=everything, dpkg=NO_DPKG)


def run(path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAWRAP_")}
    return subprocess.run([str(path), *args], capture_output=True, text=True, timeout=60, env=env)


def test_wrap_keeps_the_real_program_intact(admin: Admin) -> None:
    prog = admin.program("recon")
    os.chown(prog, 0, 5678)  # another owner than root is refused (test_multiuser.py)
    prog.chmod(0o750)
    before = os.stat(prog)
    outcome = wrap(admin, prog, policy={"gpus": 2, "wait": "forever"})
    assert not outcome.failed
    real = admin.bindir / "CUDAWRAP_recon"
    assert os.readlink(prog) == str(admin.layout.program_shim(str(prog)))
    after = os.stat(real)
    # The very same inode: contents, mode and owner cannot have changed.
    assert (after.st_ino, after.st_mode, after.st_uid, after.st_gid) == (
        before.st_ino, before.st_mode, before.st_uid, before.st_gid)
    (e,) = registry.load(admin.layout)
    assert (e.link, e.real, e.mode, e.uid, e.gid) == (str(prog), str(real), 0o750, 0, 5678)
    assert e.wrapped_by == "alice" and e.wrapped_at.endswith("Z") and e.phase == "wrapped"
    assert dict(e.policy) == {"gpus": 2, "wait": "forever"} and e.diversion is None
    assert registry.read_policy(admin.layout, str(prog)) == {"gpus": 2, "wait": "forever"}
    result = run(prog, "a b")
    assert result.returncode == 0 and result.stdout == "recon a b\n"
    assert inspect_entry(admin.layout, e).state == OK


def test_unwrap_restores_the_same_file(admin: Admin) -> None:
    prog = admin.program("recon")
    before = snapshot(admin.bindir)
    wrap(admin, prog)
    outcome = unwrap(admin, prog)
    assert [u.message for u in outcome.unwrapped] == [f"unwrapped {prog}"]
    assert snapshot(admin.bindir) == before
    assert len(registry.load(admin.layout)) == 0


def test_unwrap_by_the_real_name_too(admin: Admin) -> None:
    prog = admin.program("recon")
    wrap(admin, prog)
    assert unwrap(admin, admin.bindir / "CUDAWRAP_recon").unwrapped[0].link == str(prog)


@pytest.mark.parametrize("name", ["my prog", "récon", "日本語 プログラム", "it's \"quoted\"", "-dash"])
def test_names_with_spaces_and_non_ascii(admin: Admin, name: str) -> None:
    prog = admin.program(name, text='#!/bin/sh\necho "prog $*"\n')
    before = snapshot(admin.bindir)
    assert not wrap(admin, prog).failed
    assert run(prog, "x").stdout == "prog x\n"
    assert registry.read_policy(admin.layout, str(prog)) == {}
    assert not unwrap(admin, prog).failed
    assert snapshot(admin.bindir) == before


def test_a_symlink_is_moved_as_it_is(admin: Admin) -> None:
    """The name is a relative symlink to a program elsewhere: CUDAWRAP_<name> becomes that
    same symlink, the target is untouched, and unwrap puts the symlink back."""
    target = admin.program("recon-2.1", text='#!/bin/sh\necho "recon-2.1 $*"\n')
    other = admin.tmp / "app" / "other"
    other.mkdir()
    target = Path(shutil.move(str(target), other / "recon-2.1"))
    alias = admin.bindir / "recon"
    alias.symlink_to("../other/recon-2.1")
    before = snapshot(admin.tmp / "app")
    assert not wrap(admin, alias).failed
    assert os.readlink(admin.bindir / "CUDAWRAP_recon") == "../other/recon-2.1"
    assert run(alias, "x").stdout == "recon-2.1 x\n"
    (e,) = registry.load(admin.layout)
    assert e.symlink == "../other/recon-2.1"
    assert inspect_entry(admin.layout, e).state == OK
    assert not unwrap(admin, alias).failed
    assert snapshot(admin.tmp / "app") == before


def test_symlink_and_its_target_in_one_command_is_refused(admin: Admin) -> None:
    admin.program("recon")
    (admin.bindir / "alias").symlink_to("recon")
    before = admin.snapshot()
    outcome = wrap(admin, admin.bindir / "recon", admin.bindir / "alias")
    assert not outcome.wrapped
    assert "which this command wraps" in outcome.failed[0].error.message
    assert admin.snapshot() == before


def test_target_of_a_wrapped_symlink_is_refused(admin: Admin) -> None:
    admin.program("recon")
    (admin.bindir / "alias").symlink_to("recon")
    wrap(admin, admin.bindir / "alias")
    before = admin.snapshot()
    outcome = wrap(admin, admin.bindir / "recon")
    assert "is a symlink to it" in outcome.failed[0].error.message
    assert admin.snapshot() == before


def test_several_paths_one_bad_changes_nothing(admin: Admin) -> None:
    a, b = admin.program("a"), admin.program("b")
    before = admin.snapshot()
    outcome = wrap(admin, a, admin.bindir / "missing", b)
    assert not outcome.wrapped
    assert [f.path for f in outcome.failed] == [str(admin.bindir / "missing")]
    assert admin.snapshot() == before


def test_several_paths_all_wrapped(admin: Admin) -> None:
    progs = [admin.program(n) for n in ("a", "b", "c")]
    outcome = wrap(admin, *progs)
    assert [e.link for e in outcome.wrapped] == [str(p) for p in progs]
    assert [run(p).stdout for p in progs] == ["a \n", "b \n", "c \n"]
    assert len(unwrap(admin, everything=True).unwrapped) == 3


def test_relative_paths_are_made_absolute(admin: Admin, monkeypatch: pytest.MonkeyPatch) -> None:
    admin.program("recon")
    monkeypatch.chdir(admin.bindir)
    (e,) = wrap(admin, "recon").wrapped
    assert e.link == str(admin.bindir / "recon")


def test_check_wrap_refusals(admin: Admin) -> None:
    reg = registry.load(admin.layout)
    with pytest.raises(UsageError):
        check_wrap(admin.layout, "", reg, NO_DPKG)
    with pytest.raises(UsageError, match="newline"):
        check_wrap(admin.layout, str(admin.bindir / "a\nb"), reg, NO_DPKG)
    with pytest.raises(StateError, match="too long"):
        check_wrap(admin.layout, str(admin.program("x" * 250)), reg, NO_DPKG)


def test_binary_changed_is_seen_even_with_the_same_size(admin: Admin) -> None:
    prog = admin.program("recon")
    (e,) = wrap(admin, prog).wrapped
    real = admin.bindir / "CUDAWRAP_recon"
    text = real.read_text()
    real.write_text(text.replace("echo", "ECHO"))
    status = inspect_entry(admin.layout, e)
    assert status.state == BINARY_CHANGED and "contents" in status.detail


# --- every moment of create and unwrap -------------------------------------------------

LOOP = """
while [ ! -e "$2" ]; do
    "$1" >/dev/null 2>&1
    echo $?
done
"""


@pytest.mark.parametrize("shim", ["stand-in", "installed"])
def test_programs_run_throughout_wrapping(admin: Admin, shim: str) -> None:
    """Users running programs in loops never see 'not found' while they are wrapped."""
    # "installed": the kernel starts `sh /d/prog` for a #!/bin/sh program and sh opens
    # /d/prog by name a moment later; the shim's second line is shell as well as Python so a
    # wrap landing in between still runs the program.
    if shim == "stand-in":  # the bare minimum a shim does: exec CUDAWRAP_<name> beside the link
        admin.layout.shim.write_text('#!/bin/sh\nexec "$(dirname "$0")/CUDAWRAP_$(basename "$0")" "$@"\n')
    progs = [admin.program(f"prog{i}") for i in range(6)]
    stop = admin.tmp / "stop"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAWRAP_")}
    loops = [subprocess.Popen(["sh", "-c", LOOP, "sh", str(p), str(stop)], stdout=subprocess.PIPE,
                              text=True, env=env) for p in progs]
    try:
        time.sleep(0.3)
        for prog in progs:
            assert not wrap(admin, prog).failed
            time.sleep(0.1)
        time.sleep(0.3)
    finally:
        stop.touch()
        codes: List[str] = []
        for loop in loops:
            out, _ = loop.communicate(timeout=60)
            codes.extend(out.split())
    assert len(codes) > 30, "the loops should have run the programs many times"
    assert set(codes) == {"0"}, f"exit codes seen: {sorted(set(codes))}"


WATCH = """
import os, sys
name, stop = sys.argv[1], sys.argv[2]
seen = 0
while not os.path.exists(stop):
    os.stat(name)  # FileNotFoundError here would be the gap
    seen += 1
print(seen)
"""


def test_the_name_never_disappears(admin: Admin) -> None:
    """Through wrap and unwrap, the name always leads to a program (stat never fails)."""
    prog = admin.program("recon")
    stop = admin.tmp / "stop"
    watcher = subprocess.Popen([sys.executable, "-c", WATCH, str(prog), str(stop)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.2)
        for _ in range(8):
            assert not wrap(admin, prog).failed
            assert not unwrap(admin, prog).failed
    finally:
        stop.touch()
        out, err = watcher.communicate(timeout=60)
    assert watcher.returncode == 0, err
    assert int(out) > 1000


# kill -9 at each step of create and unwrap: tests/test_crash.py (every call that touches the
# install or the program's directory, the CLI's doctor included).


# The calls of create, in order: rename 1 (registry: "wrapping"), rename 2 (its .bak
# copy), linkat (CUDAWRAP_x), symlink (the new link), rename 3 (link over the name),
# rename 4 and 5 (registry: "wrapped", and its copy), rename 6 (the launch cache).
@needs_strace
@pytest.mark.parametrize("syscall, when, outcome", [
    # renames: 1-2 the registry (and its backup), 3 the program's own shim, 4 the link,
    # 5-6 the registry again, 7 the launch cache
    ("rename", 1, "undone"), ("linkat", 1, "undone"), ("symlink", 1, "undone"), ("rename", 3, "undone"),
    ("rename", 4, "undone"), ("rename", 5, "doctor"), ("rename", 2, "wrapped"), ("rename", 6, "wrapped"),
    ("rename", 7, "wrapped"),
])
def test_a_failing_step(admin: Admin, syscall: str, when: int, outcome: str) -> None:
    """An I/O error at one step of create: undone with one line, or (after the wrap is in
    place) reported for doctor to record, or (a copy or a cache) a warning only."""
    prog = admin.program("recon")
    before = snapshot(admin.bindir)
    result = strace_cli(admin, syscall, when, str(prog), fault="error=EIO")
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert run(prog).returncode == 0
    if outcome == "undone":
        assert result.returncode != 0 and str(prog) in result.stderr
        assert "nothing was changed" in result.stderr
        assert snapshot(admin.bindir) == before
        assert list(admin.layout.shim_dir.iterdir()) == []
        assert len(registry.load(admin.layout)) == 0
    elif outcome == "doctor":
        assert result.returncode != 0 and "cudawrap doctor --repair" in result.stderr
        assert admin.cli("doctor", "--repair").returncode == 0
        assert registry.load(admin.layout).entries[0].phase == "wrapped"
    else:
        assert result.returncode == 0, result.stderr
        assert registry.load(admin.layout).entries[0].phase == "wrapped"
        assert admin.cli("doctor").returncode == 0


def test_interrupted_entry_is_reported(admin: Admin) -> None:
    prog = admin.program("recon")
    (e,) = wrap(admin, prog).wrapped
    registry.update(admin.layout, lambda reg: reg.put(e.replace(phase="wrapping")))
    assert inspect_entry(admin.layout, registry.load(admin.layout).entries[0]).state == INTERRUPTED


def test_wrapping_a_script_without_a_shebang_says_it_runs_with_sh(admin: Admin) -> None:
    """Issue 51 item 4: such a script ran fine from a shell; wrapped, each run fails 126 with
    Exec format error unless the shim runs it with /bin/sh, as execvp does. Wrapping says so
    (and says nothing of a script with a #! line or a binary)."""
    plain = admin.program("plain", text='echo "plain $*"\n')
    shebang = admin.program("bang", text='#!/bin/sh\necho "bang $*"\n')
    binary = admin.bindir / "true"
    shutil.copy2("/bin/true", binary)
    outcome = wrap(admin, plain, shebang, binary)
    assert not outcome.failed and len(outcome.wrapped) == 3
    assert outcome.warnings == (f"note: {plain} has no #! line, so each run runs it with /bin/sh, as a shell runs "
                                "such a script; give it a #! line (such as #!/bin/bash) if it needs another "
                                "interpreter",)
    result = run(plain, "a b")  # no device needed to be told it: the machine has no GPU here
    assert "Exec format error" not in result.stderr, result.stderr
    assert result.returncode == 0 and result.stdout == "plain a b\n", result.stderr
    assert run(binary).returncode == 0


def test_a_binary_the_kernel_cannot_run_is_not_run_as_a_script(admin: Admin) -> None:
    """A file with a NUL in its first line (a binary for another machine) fails 126 as it is:
    /bin/sh would only add syntax errors."""
    odd = admin.program("odd")
    odd.write_bytes(b"\xca\xfe\xba\xbe\x00\x00\x00\x02 not for this machine\n")
    outcome = wrap(admin, odd)
    assert not outcome.failed and outcome.warnings == ()
    result = run(odd)
    assert result.returncode == 126 and "Exec format error" in result.stderr, result.stderr
