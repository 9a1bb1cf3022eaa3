"""The admin commands as users run them: create-cudawrap, cudawrap wrap/list/unwrap.

Every refusal: its exit code, one clear line on stderr naming the path, and the whole
tree (install root and programs) exactly as before.
"""
import json
import os
import shutil
from pathlib import Path
from typing import Callable, List

import pytest

from support.admin import Admin, install, make_program, run_as, snapshot
from support.procs import one_line, root_only
from cudawrap.policy import registry
from cudawrap.errors import NotPermitted
from cudawrap.paths import Layout

NOBODY = 65534


def test_create_then_list(admin: Admin) -> None:
    prog = admin.program("recon")
    result = admin.create("--gpus", "2", "--wait", "90", "--placement", "pack", str(prog))
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"wrapped {prog} (real program: {admin.bindir / 'CUDAWRAP_recon'}, renamed)\n"
    listed = admin.cli("list")
    assert listed.returncode == 0
    header, row = listed.stdout.splitlines()
    assert header.split()[:3] == ["STATE", "PROGRAM", "POLICY"]
    assert row.startswith("ok") and str(prog) in row and "gpus=2 placement=pack wait=90" in row
    (data,) = json.loads(admin.cli("list", "--json").stdout)
    assert data["link"] == str(prog) and data["state"] == "ok" and data["diverted"] is False
    assert data["policy"] == {"gpus": 2, "wait": 90, "placement": "pack"}
    assert data["wrapped_by"] and data["sha256"] and data["mode"] == "0755"


def test_wrap_subcommand_and_policy_forms(admin: Admin) -> None:
    a, b = admin.program("a"), admin.program("b")
    result = admin.cli("wrap", "--wait", "forever", "--foreign", "ignore", "--busy-memory-mib", "0",
                       "--no-driver", "fail", "--multi-mig", "whole-gpus", str(a), str(b))
    assert result.returncode == 0, result.stderr
    assert registry.read_policy(admin.layout, str(a)) == {
        "wait": "forever", "foreign": "ignore", "busy_memory_mib": 0, "no_driver": "fail",
        "multi_mig": "whole-gpus"}
    assert admin.cli("wrap", "--wait", "2.5", str(admin.program("c"))).returncode == 0
    assert registry.read_policy(admin.layout, str(admin.bindir / "c")) == {"wait": 2.5}


def test_sudo_user_is_recorded(admin: Admin) -> None:
    prog = admin.program()
    assert admin.create(str(prog), SUDO_USER="alice").returncode == 0
    assert registry.load(admin.layout).entries[0].wrapped_by == "alice"


def test_list_with_nothing_wrapped(admin: Admin) -> None:
    result = admin.cli("list")
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "no programs are wrapped\n")
    assert json.loads(admin.cli("list", "--json").stdout) == []


def test_list_shows_each_state(admin: Admin) -> None:
    progs = {n: admin.program(n) for n in ("ok1", "gone", "replaced", "changed", "unlinked")}
    assert admin.create(*map(str, progs.values())).returncode == 0
    (admin.bindir / "CUDAWRAP_gone").unlink()
    progs["replaced"].unlink()
    make_program(admin.bindir, "replaced", "#!/bin/sh\necho new\n")
    (admin.bindir / "CUDAWRAP_changed").write_text("#!/bin/sh\necho changed\n")
    progs["unlinked"].unlink()
    states = {Path(r["link"]).name: r["state"] for r in json.loads(admin.cli("list", "--json").stdout)}
    assert states == {"ok1": "ok", "gone": "real-missing", "replaced": "shim-replaced",
                      "changed": "binary-changed", "unlinked": "not-a-cudawrap-link"}
    listed = admin.cli("list")
    assert listed.returncode == 0
    assert f"{progs['gone']}: the real program" in listed.stderr


# --- refusals of create-cudawrap --------------------------------------------------------


def _missing(a: Admin) -> List[str]:
    return [str(a.bindir / "nothere")]


def _directory(a: Admin) -> List[str]:
    (a.bindir / "adir").mkdir()
    return [str(a.bindir / "adir")]


def _not_executable(a: Admin) -> List[str]:
    return [str(a.program("data", mode=0o644))]


def _already_wrapped(a: Admin) -> List[str]:
    prog = a.program("recon")
    assert a.create(str(prog)).returncode == 0
    return [str(prog)]


def _real_name(a: Admin) -> List[str]:
    return [str(a.program("CUDAWRAP_recon"))]


def _the_shim(a: Admin) -> List[str]:
    return [str(a.layout.shim)]


def _real_name_taken(a: Admin) -> List[str]:
    a.program("CUDAWRAP_recon")
    return [str(a.program("recon"))]


def _broken_symlink(a: Admin) -> List[str]:
    (a.bindir / "dangling").symlink_to("nowhere")
    return [str(a.bindir / "dangling")]


def _symlink_to_dir(a: Admin) -> List[str]:
    (a.bindir / "todir").symlink_to("/usr")
    return [str(a.bindir / "todir")]


def _link_to_shim(a: Admin) -> List[str]:
    (a.bindir / "byhand").symlink_to(a.layout.shim)
    return [str(a.bindir / "byhand")]


def _one_bad_of_three(a: Admin) -> List[str]:
    return [str(a.program("a")), str(a.bindir / "nothere"), str(a.program("b"))]


def _twice(a: Admin) -> List[str]:
    prog = a.program("recon")
    return [str(prog), str(a.bindir / "." / "recon")]


def _no_shim(a: Admin) -> List[str]:
    a.layout.shim.unlink()
    return [str(a.program("recon"))]


def _corrupt_registry(a: Admin) -> List[str]:
    a.layout.registry_file.write_text('{"version": 1, "entries": [')
    return [str(a.program("recon"))]


def _newer_registry(a: Admin) -> List[str]:
    a.layout.registry_file.write_text('{"version": 7, "entries": []}')
    return [str(a.program("recon"))]


REFUSED = [
    pytest.param(_missing, 65, "no such file", id="missing"),
    pytest.param(_directory, 65, "not a regular file", id="directory"),
    pytest.param(_not_executable, 65, "not executable", id="not-executable"),
    pytest.param(_already_wrapped, 65, "already wrapped", id="already-wrapped"),
    pytest.param(_real_name, 65, "prefix marks a program cudawrap already renamed", id="cudawrap-prefix"),
    pytest.param(_the_shim, 65, "a cudawrap shim itself", id="the-shim"),
    pytest.param(_real_name_taken, 65, "CUDAWRAP_recon already exists", id="real-name-taken"),
    pytest.param(_broken_symlink, 65, "broken symlink", id="broken-symlink"),
    pytest.param(_symlink_to_dir, 65, "not a regular file (a symlink to /usr)", id="symlink-to-dir"),
    pytest.param(_link_to_shim, 65, "already wrapped", id="link-to-shim"),
    pytest.param(_one_bad_of_three, 65, "nothere: no such file", id="one-bad-of-three"),
    pytest.param(_twice, 64, "given twice", id="same-path-twice"),
    pytest.param(_no_shim, 65, "shim", id="shim-not-installed"),
    pytest.param(_corrupt_registry, 65, "registry.json: not valid JSON", id="corrupt-registry"),
    pytest.param(_newer_registry, 65, "newer cudawrap", id="newer-registry"),
]


@pytest.mark.parametrize("setup, code, words", REFUSED)
def test_create_refusals_change_nothing(admin: Admin, setup: Callable[[Admin], List[str]], code: int,
                                        words: str) -> None:
    paths = setup(admin)
    before = admin.snapshot()
    result = admin.create(*paths)
    assert result.returncode == code, result.stderr
    line = one_line(result)
    assert line.startswith("create-cudawrap: ") and words in line
    assert result.stdout == ""
    assert admin.snapshot() == before


BAD_SWITCHES = [
    pytest.param(["--gpus", "two"], "--gpus: 'two' is not a whole number", id="gpus-word"),
    pytest.param(["--gpus", "0"], "--gpus: bad value for 'gpus': 0 is not between 1 and 64", id="gpus-zero"),
    pytest.param(["--wait", "soon"], "--wait: 'soon' is not a number of seconds or 'forever'", id="wait-word"),
    pytest.param(["--wait", "-5"], "--wait: ", id="wait-negative"),
    pytest.param(["--busy-memory-mib", "-1"], "--busy-memory-mib: bad value", id="busy-negative"),
    pytest.param(["--placement", "nowhere"], "--placement: bad value for 'placement': 'nowhere' is not one of "
                 "spread, pack, random", id="placement"),
    pytest.param(["--bogus"], "bogus", id="unknown-switch"),
    pytest.param(["--gpus"], "--gpus", id="missing-value"),
]


@pytest.mark.parametrize("switches, words", BAD_SWITCHES)
def test_bad_switches_change_nothing(admin: Admin, switches: List[str], words: str) -> None:
    prog = admin.program("recon")
    before = admin.snapshot()
    result = admin.create(*switches, str(prog)) if switches != ["--gpus"] else admin.create(*switches)
    assert result.returncode == 64, result.stderr
    first, *rest = result.stderr.splitlines()
    assert first.startswith("create-cudawrap: ") and words in first
    assert rest in ([], ["hint: run 'create-cudawrap --help' for usage"])
    assert admin.snapshot() == before



def test_policy_switches_are_the_policy_keys_and_each_is_read() -> None:
    """create-cudawrap's switches are generated from the policy keys (all but reserve_after, which
    only the config sets), each with its key's description as help, and policy() reads every
    one of them: a key given a switch but left out of the reading would be dropped silently."""
    from cudawrap.cli.admin import POLICY, READ_ORDER, CreateCudawrap
    from cudawrap.cli.filterswitches import FILTERS
    from cudawrap.policy.config import DESCRIPTIONS, POLICY_KEYS

    app = CreateCudawrap("create-cudawrap")
    keys = set(POLICY_KEYS) - {"reserve_after"}
    assert set(POLICY) | set(FILTERS) == keys
    for key in keys:
        assert app._switches_by_name[key.replace("_", "-")].help == DESCRIPTIONS[key], key
    assert sorted(READ_ORDER) == sorted(keys)

def test_no_program_given(admin: Admin) -> None:
    before = admin.snapshot()
    result = admin.create("--gpus", "2")
    assert result.returncode == 64 and "no program given" in one_line(result)
    assert admin.snapshot() == before


@pytest.mark.parametrize("argv, said, guess", [
    (["stauts"], "cudawrap: unknown command 'stauts'", "did you mean 'cudawrap status'? "),
    (["mps", "strat"], "cudawrap: unknown command 'strat'", "did you mean 'cudawrap mps start'? "),
    (["frobnicate"], "cudawrap: unknown command 'frobnicate'", ""),
])
def test_a_mistyped_command_gets_a_did_you_mean_and_exit_64(admin: Admin, argv: List[str], said: str,
                                                               guess: str) -> None:
    before = admin.snapshot()
    result = admin.cli(*argv)
    group = " ".join(["cudawrap", *argv[:-1]])
    assert (result.returncode, result.stdout) == (64, "")
    assert result.stderr.splitlines() == [said, f"hint: {guess}run '{group} --help' for the commands"]
    assert admin.snapshot() == before


# --- unwrap ---------------------------------------------------------------------------


def test_unwrap_restores_the_original(admin: Admin) -> None:
    prog = admin.program("recon")
    before = snapshot(admin.bindir)
    assert admin.create(str(prog)).returncode == 0
    result = admin.cli("unwrap", str(prog))
    assert (result.returncode, result.stdout, result.stderr) == (0, f"unwrapped {prog}\n", "")
    assert snapshot(admin.bindir) == before
    assert len(registry.load(admin.layout)) == 0


def test_unwrap_all(admin: Admin) -> None:
    progs = [admin.program(n) for n in ("a", "b d", "é")]
    before = snapshot(admin.bindir)
    assert admin.create(*map(str, progs)).returncode == 0
    result = admin.cli("unwrap", "--all")
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 3
    assert snapshot(admin.bindir) == before
    again = admin.cli("unwrap", "--all")
    assert (again.returncode, again.stderr) == (0, "no programs are wrapped\n")


def _changed(a: Admin, prog: Path) -> None:
    (a.bindir / "CUDAWRAP_recon").write_text("#!/bin/sh\necho changed\n")


def _replaced(a: Admin, prog: Path) -> None:
    prog.unlink()
    make_program(a.bindir, "recon", "#!/bin/sh\necho new\n")


def _real_gone(a: Admin, prog: Path) -> None:
    (a.bindir / "CUDAWRAP_recon").unlink()


def _link_gone(a: Admin, prog: Path) -> None:
    prog.unlink()


def _link_elsewhere(a: Admin, prog: Path) -> None:
    prog.unlink()
    prog.symlink_to("/bin/true")


# state, what is at the name afterwards with --force, and what the message says
FORCED = [
    pytest.param(_changed, "binary-changed", "changed", "unwrapped {prog}\n", id="binary-changed"),
    pytest.param(_replaced, "shim-replaced", "new", "the wrapped program was kept as {prog}.cudawrap-saved",
                 id="shim-replaced"),
    pytest.param(_real_gone, "real-missing", None, "removed the shim link", id="real-missing"),
    pytest.param(_link_gone, "not-a-cudawrap-link", "recon", "unwrapped {prog}\n", id="link-missing"),
    pytest.param(_link_elsewhere, "not-a-cudawrap-link", "/bin/true",
                 "the wrapped program was kept as {prog}.cudawrap-saved", id="link-elsewhere"),
]


@pytest.mark.parametrize("damage, state, now, says", FORCED)
def test_unwrap_refuses_when_disk_differs_and_force_decides(admin: Admin, damage, state, now, says) -> None:
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    damage(admin, prog)
    before = admin.snapshot()
    refused = admin.cli("unwrap", str(prog))
    assert refused.returncode == 65
    line = one_line(refused)
    assert line.startswith(f"cudawrap: {prog}: {state}: ") and "nothing was changed" in line
    assert "'cudawrap unwrap --force'" in line
    assert admin.snapshot() == before

    forced = admin.cli("unwrap", "--force", str(prog))
    assert forced.returncode == 0, forced.stderr
    assert says.format(prog=prog) in forced.stdout
    assert len(registry.load(admin.layout)) == 0
    assert not (admin.bindir / "CUDAWRAP_recon").exists()
    if now is None:
        assert not os.path.lexists(prog)
    elif now.startswith("/"):
        assert os.readlink(prog) == now
    else:
        assert now in prog.read_text().splitlines()[1]
    if "saved" in says:  # never a program deleted: the wrapped one is kept beside
        assert Path(f"{prog}.cudawrap-saved").read_text() == "#!/bin/sh\necho \"recon $*\"\n"


def test_unwrap_refusals(admin: Admin) -> None:
    prog = admin.program("recon")
    before = admin.snapshot()
    for args, code, words in [
        ([str(prog)], 65, "not wrapped by cudawrap"),
        ([], 64, "no program given"),
        (["--all", str(prog)], 64, "not both"),
    ]:
        result = admin.cli("unwrap", *args)
        assert result.returncode == code
        assert words in one_line(result)
    assert admin.snapshot() == before


def test_unwrap_one_refused_of_two_changes_nothing(admin: Admin) -> None:
    a, b = admin.program("a"), admin.program("b")
    assert admin.create(str(a), str(b)).returncode == 0
    (admin.bindir / "CUDAWRAP_b").write_text("#!/bin/sh\n")
    before = admin.snapshot()
    result = admin.cli("unwrap", str(a), str(b))
    assert result.returncode == 65 and str(b) in one_line(result)
    assert admin.snapshot() == before


def test_corrupt_registry_stops_every_command_and_is_kept(admin: Admin) -> None:
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    admin.layout.registry_file.write_text('{"version": 1, "entries": [{"link": 5}]}')
    before = admin.snapshot()
    for args in (["list"], ["list", "--json"], ["unwrap", str(prog)], ["unwrap", "--all"]):
        result = admin.cli(*args)
        assert result.returncode == 65, args
        line = one_line(result)
        assert str(admin.layout.registry_file) in line and "registry.json.bak" in line
    assert admin.snapshot() == before
    # Restoring the copy, as the message says, brings everything back.
    shutil.copy(str(admin.layout.registry_file) + ".bak", admin.layout.registry_file)
    assert admin.cli("unwrap", str(prog)).returncode == 0


# --- who may do what ---------------------------------------------------------------------


@root_only
@pytest.mark.root
def test_others_may_list_but_not_change(shared_tmp: Path) -> None:
    admin = Admin(shared_tmp)
    prog = admin.program("recon")
    assert admin.create(str(prog), "--gpus", "2").returncode == 0
    other = admin.program("other")
    before = admin.snapshot()
    env = admin.environ()
    code, out, err = run_as(NOBODY, NOBODY, ["cudawrap", "list"], env)
    assert code == 0 and "ok" in out and str(prog) in out, err
    for argv in (["create-cudawrap", str(other)], ["cudawrap", "wrap", str(other)],
                 ["cudawrap", "unwrap", str(prog)], ["cudawrap", "unwrap", "--all"],
                 ["cudawrap", "doctor", "--repair"]):
        code, out, err = run_as(NOBODY, NOBODY, argv, env)
        assert code == 77, (argv, err)
        (line,) = err.splitlines()
        # a prefix install root made: root named once, not "only root or root (owner of …)"
        assert ": only root may " in line and " or root" not in line and "you are nobody" in line, line
    assert admin.snapshot() == before


@root_only
@pytest.mark.root
def test_owner_of_a_prefix_install_may_wrap(shared_tmp: Path) -> None:
    admin = Admin(shared_tmp)
    prog = admin.program("recon")
    for path in (admin.layout.state_dir, admin.layout.shim_dir, admin.bindir, prog):
        os.chown(path, NOBODY, NOBODY)
    code, out, err = run_as(NOBODY, NOBODY, ["create-cudawrap", str(prog)], admin.environ())
    assert code == 0, err
    assert registry.load(admin.layout).entries[0].wrapped_by == "nobody"
    code, out, err = run_as(12345, 12345, ["cudawrap", "unwrap", str(prog)], admin.environ())
    assert code == 77 and "only root or nobody" in err
    code, out, err = run_as(NOBODY, NOBODY, ["cudawrap", "unwrap", str(prog)], admin.environ())
    assert code == 0, err


@root_only
@pytest.mark.root
def test_a_system_install_needs_root() -> None:
    from cudawrap.base.privilege import require_admin

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setuid(NOBODY)
            try:
                require_admin(Layout(Path("/")))
            except NotPermitted as exc:
                code = 0 if "only root may" in exc.message and "sudo" in exc.message else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    require_admin(Layout(Path("/")))  # root passes


def test_layout_helper_matches_install(tmp_path: Path) -> None:
    # The fixture's layout is the product's own (installation.prepare when available).
    layout = Layout(tmp_path / "r")
    install(layout)
    assert os.access(layout.shim, os.X_OK) and layout.state_dir.is_dir()


FAKERPM = Path(__file__).resolve().parent / "fakerpm"


def test_rpm_owned_programs_are_refused_unless_forced(admin: Admin) -> None:
    """rpm has no diversions: an update would silently put the unwrapped program back."""
    prog, other = admin.program("recon"), admin.program("train")
    db = admin.tmp / "rpm-files"
    db.write_text(f"{prog} recon-tools\n")
    env = {"PATH": f"{FAKERPM}:{os.environ['PATH']}", "FAKERPM_DB": str(db)}
    before = admin.snapshot()
    refused = admin.create(str(prog), **env)
    assert refused.returncode == 65
    assert one_line(refused) == (
        f"create-cudawrap: {prog}: belongs to the RPM package recon-tools, and rpm cannot divert files: "
        "an update of recon-tools would silently unwrap it; wrap a copy outside the package's files, or "
        "give --force and wrap it again after every update")
    assert admin.snapshot() == before
    plain = admin.create(str(other), **env)  # a program no package owns wraps as always
    assert plain.returncode == 0 and plain.stderr == ""
    forced = admin.create("--force", str(prog), **env)
    assert forced.returncode == 0, forced.stderr
    assert one_line(forced) == (
        f"create-cudawrap: warning: {prog} belongs to the RPM package recon-tools: an update of recon-tools "
        f"silently unwraps it; run 'create-cudawrap --force {prog}' again after every update")
    assert os.readlink(prog) == str(admin.layout.program_shim(str(prog)))
