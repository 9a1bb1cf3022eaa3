"""install.sh: a --prefix install, a wrap, an upgrade and an uninstall; every refusal; the system install.

The --prefix tests run install.sh for real in a temporary directory, offline from a
wheelhouse fetched once per session. The system install (root, and only in CI or with
CUDAWRAP_SYSTEM_TESTS=1) changes this machine's /opt, /etc, /var, /run and /usr/local.
"""
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

import pytest

from cudawrap import __version__
from cudawrap.base.audit import channel_problem
from cudawrap.policy.config import DEFAULTS, load_config
from cudawrap.install.installation import (
    Layout, MONITOR_UNIT, SERVICE_UNIT, UNIT_NAME, completion_file, manifest_file, prepare_runtime,
    render_monitor_unit, render_tmpfiles, render_unit, shim_version, tmpfiles_file, unit_file, wheel_dir,
)
from cudawrap.cli.installer import render_bash_completion
from cudawrap.cli.manpages import PAGES, man_path, render as render_man
from support.machine import FAKECUDA, LIBNAME, FakeMachine, session_topology
from cudawrap.base.daemon import running
from cudawrap import locations as loc
from support.installsh import (
    INSTALL_SH, SOURCE, STOCK_SUDO_PATH, clean_env, install_sh, process_gone, snapshot, source_commit, wheel_args,
)

PACKAGING = SOURCE / "packaging"
IS_ROOT = os.geteuid() == 0


def stand_in(path: Path, python: str = sys.executable) -> Path:
    """tests/support/fakecuda.py as an installed program with its interpreter baked in."""
    body = FAKECUDA.read_bytes().split(b"\n", 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(f"#!{python} -IS\n".encode() + body)
    path.chmod(0o755)
    return path


def run(*argv: object, env: dict, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=120, **kw)


def one_error(r: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """R failed with CODE and said so in exactly one line containing WORDS."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("install.sh: error: "), lines[0]
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]


# ---- the files install.sh puts in place ----------------------------------------------------


def test_packaging_files_are_generated_from_the_code():
    """packaging/ is what `make packaging` renders now; a new subcommand needs a re-render."""
    hint = "packaging/ is stale: run `make packaging`"
    assert (PACKAGING / "cudawrap.bash-completion").read_text() == render_bash_completion(), hint
    assert (PACKAGING / UNIT_NAME).read_text() == render_unit(Layout(Path("/"))), hint
    assert (PACKAGING / MONITOR_UNIT).read_text() == render_monitor_unit(Layout(Path("/"))), hint
    assert (PACKAGING / "cudawrap.tmpfiles").read_text() == render_tmpfiles(Layout(Path("/"))), hint


def test_tmpfiles_entry_matches_prepare_runtime(tmp_path):
    layout = Layout(tmp_path)
    prepare_runtime(layout)
    lines = [line.split() for line in render_tmpfiles(layout).splitlines() if line and not line.startswith("#")]
    assert {Path(f[1]) for f in lines} == {layout.runtime_dir, layout.lease_dir, layout.share_dir, layout.queue_dir,
                                         layout.queue_lock}
    for kind, path, mode, *_ in lines:
        st = os.lstat(path)
        assert (kind == "d") == stat.S_ISDIR(st.st_mode), path
        assert int(mode, 8) == stat.S_IMODE(st.st_mode), path


def test_boot_unit_runs_sync_after_the_driver():
    unit = render_unit(Layout(Path("/")))
    assert "ExecStart=/opt/cudawrap/venv/bin/cudawrap sync\n" in unit
    assert "After=nvidia-persistenced.service systemd-modules-load.service" in unit
    assert "Type=oneshot" in unit and "SuccessExitStatus=69" in unit and "WantedBy=multi-user.target" in unit


def test_bash_completion_loads_and_completes(tmp_path):
    script = (
        f"source {PACKAGING / 'cudawrap.bash-completion'}\n"
        "COMP_WORDS=(cudawrap un); COMP_CWORD=1; _cudawrap; echo \"${COMPREPLY[*]}\"\n"
        "complete -p create-cudawrap\n")
    r = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "unwrap"
    assert "-o default" in r.stdout  # program paths still complete as file names


# ---- a --prefix install, end to end -----------------------------------------------------


def test_prefix_install_wrap_upgrade_uninstall(tmp_path, machine, wheelhouse):
    fake = machine("four-gpus")
    env = clean_env(fake.environ())
    prefix = tmp_path / "cw"
    layout = Layout(prefix)
    r = install_sh("--prefix", str(prefix), "--python", sys.executable, *wheel_args(wheelhouse), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("==> ") and "==> done" in r.stdout
    # Issue 51 item 11: only what applies. A --prefix install runs daemonless: no word on the service.
    assert f"==> runs daemonless ({layout.way_file}; `cudawrap way` switches it)" in r.stdout, r.stdout
    assert f"{SERVICE_UNIT} not enabled" not in r.stdout and "serve --daemon" not in r.stdout
    assert [line for line in r.stdout.splitlines() if "monitor`" in line or f"{MONITOR_UNIT} not" in line] == []
    # Without a syslog socket the install says so once (admin commands later do not).
    assert r.stderr.count("syslog messages (the audit trail) are lost") == (1 if channel_problem() else 0), r.stderr

    # What is where.
    assert (layout.venv_dir / "cudawrap-root").read_text().strip() == str(prefix)
    assert "include-system-site-packages = false" in (layout.venv_dir / "pyvenv.cfg").read_text()
    assert layout.shim.read_text().startswith(f"#!{layout.venv_dir}/bin/python -IS\n")
    assert shim_version(layout.shim) == __version__
    for name in ("cudawrap", "create-cudawrap"):
        assert os.readlink(layout.bin_dir / name) == str(layout.venv_dir / "bin" / name)
    config = load_config(layout.config_file)
    assert {k: s.value for k, s in config.settings.items()} == DEFAULTS
    assert sorted(os.listdir(layout.lease_dir)) == sorted(fake.leaf_uuids())
    assert stat.S_IMODE(layout.queue_dir.stat().st_mode) == 0o1777
    for path in (tmpfiles_file(layout), unit_file(layout), completion_file(layout), manifest_file(layout)):
        assert path.is_file(), path
    assert str(prefix / "run/cudawrap/leases") in tmpfiles_file(layout).read_text()
    for page in PAGES:
        assert man_path(prefix, page).read_text() == render_man(page), page
    assert [w.name for w in wheel_dir(layout).iterdir()] == [f"cudawrap-{__version__}-py3-none-any.whl"]

    # The prefix's own command finds its root through the marker, with no variable.
    cudawrap = layout.bin_dir / "cudawrap"
    r = run(cudawrap, "config", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config_file"] == str(layout.config_file)
    assert_build_shown(cudawrap, env, "installed")

    # Wrap the stand-in with the prefix's create-cudawrap and run it on the simulated machine.
    prog = stand_in(tmp_path / "apps" / "recon")
    original, mode = prog.read_bytes(), stat.S_IMODE(prog.stat().st_mode)
    r = run(layout.bin_dir / "create-cudawrap", prog, env=env)
    assert r.returncode == 0, r.stderr
    assert prog.is_symlink() and prog.resolve() == layout.program_shim(str(prog))
    r = run(prog, "--exit", "0", env=env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["cvd"] in fake.leaf_uuids()

    # Upgrade: a stale shim is refreshed, the edited config is kept, the wrap still works; a
    # program wrapped before each had its own shim (its link leads to the shared one) gets one.
    layout.shim.write_text(layout.shim.read_text().replace(f"version {__version__}", "version 0.0.1"))
    assert shim_version(layout.shim) == "0.0.1"
    prog.unlink()
    prog.symlink_to(layout.shim)
    layout.program_shim(str(prog)).unlink()
    written = layout.config_file.read_bytes()
    edited = written.replace(b'#wait = "forever"', b"wait = 30").replace(b"#[policy]", b"[policy]")
    assert edited != written
    layout.config_file.write_bytes(edited)
    served = run(cudawrap, "way", "service", env=env)  # where the service runs, the upgrade keeps it and says so
    assert served.returncode == 0, served.stderr
    service = running(loc.under(str(prefix), loc.SERVICE_PID))
    r = install_sh("--prefix", str(prefix), "--python", sys.executable, *wheel_args(wheelhouse), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "upgrading in place" in r.stdout and "kept the configuration" in r.stdout
    assert f"==> runs with the service as its only arbiter ({layout.way_file}" in r.stdout, r.stdout
    assert (f"==> the cudawrap service runs (pid {service}), the monitor's loop with it; restart it to run this "
            f"version: `{cudawrap} serve --stop`, then `{cudawrap} serve --daemon`") in r.stdout, r.stdout
    assert "not enabled (a --prefix install); start the service" not in r.stdout
    stopped = run(cudawrap, "serve", "--stop", env=env)
    assert stopped.returncode == 0 and f"stopped the service (pid {service})" in stopped.stdout, stopped.stderr
    assert shim_version(layout.shim) == __version__
    assert f"==> wrote its own shim {layout.program_shim(str(prog))} and pointed {prog} at it" in r.stdout
    assert prog.resolve() == layout.program_shim(str(prog))
    assert shim_version(layout.program_shim(str(prog))) == __version__
    assert layout.config_file.read_bytes() == edited
    r = run(prog, env=env)
    assert r.returncode == 0, r.stderr
    layout.config_file.write_bytes(written)  # as installed again: the uninstall may remove it

    # Uninstall refuses while a program is wrapped, and changes nothing; it names both ways on.
    before = snapshot(prefix)
    r = install_sh("--uninstall", "--prefix", str(prefix), env=env)
    one_error(r, 65, "1 program(s) still wrapped", str(prog), "--uninstall --unwrap-all",
              "--uninstall --keep-wraps")
    assert snapshot(prefix) == before

    # A monitor started without systemd is stopped by the uninstall (it would recreate run/cudawrap).
    pid = start_monitor_daemon(cudawrap, layout, env)

    # --unwrap-all: the real program is back under its name, byte for byte; the install's
    # device claims are gone; its state (registry, ledger) is kept until --purge (issue 51 item 7).
    claimed = sorted(p.name for p in fake.claims_dir.iterdir() if p.read_text().strip() == str(prefix))
    assert claimed == sorted(fake.leaf_uuids())
    try:
        r = install_sh("--uninstall", "--unwrap-all", "--prefix", str(prefix), env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"==> stopped `cudawrap monitor --daemon` (pid {pid})" in r.stdout
        assert process_gone(pid)
    finally:
        if not process_gone(pid):
            os.kill(pid, 9)
    assert sorted(os.listdir(fake.claims_dir)) == []
    assert f"==> released the claims on {len(claimed)} device(s) in {fake.claims_dir}" in r.stdout
    assert (f"==> kept {layout.state_dir}/ (the registry, the ledger and the usage history), as a reinstall takes "
            f"it up again; remove it with: install.sh --uninstall --purge --prefix {prefix}") in r.stdout
    assert {p.split("/")[0] for p in snapshot(prefix)} == {"var"}
    assert (layout.state_dir / "registry.json").is_file() and (layout.state_dir / "ledger.state").is_file(), \
        snapshot(prefix)
    r = install_sh("--uninstall", "--purge", "--prefix", str(prefix), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"==> removed {layout.state_dir}/" in r.stdout
    assert not prefix.exists(), snapshot(prefix)
    assert not prog.is_symlink() and prog.read_bytes() == original
    assert stat.S_IMODE(prog.stat().st_mode) == mode
    assert os.listdir(prog.parent) == ["recon"]


def assert_build_shown(cudawrap: Path, env: dict, when: str) -> None:
    """`cudawrap --version` and doctor name the build: the checkout's commit and WHEN's date."""
    commit = source_commit()
    r = run(cudawrap, "--version", env=env)
    assert r.returncode == 0, r.stderr
    if commit:
        assert re.search(rf"^cudawrap {re.escape(__version__)} \(commit {commit}(?: with uncommitted changes)?, "
                         rf"{when} \d{{4}}-\d\d-\d\d\)$", r.stdout.strip()), r.stdout
    else:
        assert re.search(rf"\({when} \d{{4}}-\d\d-\d\d\)$", r.stdout.strip()), r.stdout
    version = r.stdout.strip().split(None, 1)[1]
    r = run(cudawrap, "doctor", env=env)
    assert f"ok: version: cudawrap {version}\n" in r.stdout, r.stdout


def start_monitor_daemon(cudawrap: Path, layout: Layout, env: dict) -> int:
    r = run(cudawrap, "monitor", "--daemon", env=env)
    assert r.returncode == 0, r.stderr
    pid = running(loc.under(str(layout.root), loc.MONITOR_PID))
    assert pid and pid > 0
    return pid


def test_uninstall_keeps_an_edited_config_and_what_was_there(tmp_path, machine, wheelhouse):
    fake = machine("four-gpus")
    fake.set_fault("driver_not_loaded")
    env = clean_env(fake.environ())
    prefix = tmp_path / "cw"
    (prefix / "usr" / "local" / "bin").mkdir(parents=True)
    (prefix / "notes.txt").write_text("mine\n")
    (prefix / "usr" / "local" / "bin" / "tool").write_text("#!/bin/sh\n")
    r = install_sh("--prefix", str(prefix), "--python", sys.executable, *wheel_args(wheelhouse), env=env)
    # No driver: a warning, not a failure.
    assert r.returncode == 0, r.stdout + r.stderr
    assert "install.sh: warning: no NVIDIA driver" in r.stderr
    layout = Layout(prefix)
    layout.config_file.write_text(layout.config_file.read_text().replace("#gpus = 1", "gpus = 2").replace("#[policy]", "[policy]"))

    r = install_sh("--uninstall", "--prefix", str(prefix), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"kept {layout.config_file}: it was edited" in r.stdout
    mine = {"notes.txt", "usr", "usr/local", "usr/local/bin", "usr/local/bin/tool"}
    assert {p for p in snapshot(prefix) if not p.startswith("var/lib/cudawrap/")} == mine | {
        "etc", "etc/cudawrap", "etc/cudawrap/config.toml", "var", "var/lib", "var/lib/cudawrap"}
    # Installed again, it takes both up; --purge then removes them too (the state is not in
    # this install's manifest), and what was there stays.
    r = install_sh("--prefix", str(prefix), "--python", sys.executable, *wheel_args(wheelhouse), env=env)
    assert r.returncode == 0 and f"kept the configuration {layout.config_file}" in r.stdout, r.stdout + r.stderr
    r = install_sh("--uninstall", "--purge", "--prefix", str(prefix), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"==> removed {layout.state_dir}/" in r.stdout and f"==> removed {layout.config_file}" in r.stdout
    assert set(snapshot(prefix)) == mine


def test_uninstall_puts_back_the_nodes_a_leased_service_closed(tmp_path, machine, wheelhouse):
    """[confine] nodes = "leased" left GPU nodes closed (the service stopped): uninstall puts
    each back as the state file says it was (a node made with mknod, major 195)."""
    import stat

    from cudawrap.base import nodemodes

    fake = machine("four-gpus")
    fake.set_fault("driver_not_loaded")
    env = clean_env(fake.environ())
    prefix = tmp_path / "cw"
    r = install_sh("--prefix", str(prefix), "--python", sys.executable, *wheel_args(wheelhouse), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    node = str(tmp_path / "nvidia0")
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, 0))
    os.chmod(node, 0o666)
    state = str(Layout(prefix).state_dir / "nodes.saved")
    nodemodes.save(state, {node: nodemodes.snapshot(node)})
    nodemodes.close(node, [12345])
    assert stat.S_IMODE(os.lstat(node).st_mode) == 0o660 and nodemodes.read_acl(node) is not None
    r = install_sh("--uninstall", "--prefix", str(prefix), env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "==> put back 1 GPU node(s) as they were" in r.stdout
    assert stat.S_IMODE(os.lstat(node).st_mode) == 0o666 and nodemodes.read_acl(node) is None
    assert not os.path.exists(state)


TRY = SOURCE / "docs" / "try.md"  # the "Try it without a GPU" walk-throughs


def walk_through(name: str) -> str:
    text = TRY.read_text(encoding="utf-8")
    block = text.split(f"<!-- {name}:start -->\n")[1].split(f"<!-- {name}:end -->")[0]
    return "\n".join(line for line in block.splitlines() if not line.startswith("```"))


def own_machine(script: str, directory: Path) -> Tuple[str, List[str]]:
    """SCRIPT, a README walk-through, on this session's own simulated GPUs (issue 51 item 12):
    device claims are machine-wide, so README's UUIDs would collide with another session's
    walk-through, or README's run by hand, at the same time. Its cleanup purges what the
    uninstall keeps, where README does not say so yet (the state, issue 51 item 7). The
    script, and the UUIDs, whose claims must be gone once it has run."""
    source = "tests/fakenvml/topologies/four-gpus.topo"
    assert source in script, script
    topology = directory / "four-gpus.topo"
    topology.write_text(session_topology("four-gpus"))
    topology.chmod(0o644)
    if "--purge" not in script:
        script = script.replace(" --uninstall ", " --uninstall --purge ")
    uuids = re.findall(r"uuid=(\S+)", topology.read_text())
    return script.replace(source, str(topology)), uuids


def no_claims_left(uuids: List[str]) -> None:
    """The walk-through's uninstall took its install's claims on UUIDS with it."""
    left = [u for u in uuids if os.path.lexists(os.path.join(loc.CLAIMS_DIR, u))]
    assert left == [], f"claims left in {loc.CLAIMS_DIR}: {left}"


def run_walk_through(script: str, env: Dict[str, str]) -> subprocess.CompletedProcess:
    """SCRIPT, a walk-through of docs/try.md, run with bash -e; its exit 0 asserted, and on a failure
    or a hang its output shown (a hang: a run that failed before its ready line)."""
    try:
        r = subprocess.run(["bash", "-e", "-c", script], cwd=SOURCE, env=env, stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        out = [s.decode(errors="replace") if isinstance(s, bytes) else (s or "") for s in (exc.stdout, exc.stderr)]
        pytest.fail(f"the walk-through hung for 300 s; its output:\n{out[0][-3000:]}\n{out[1][-3000:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.slow
def test_try_it_without_a_gpu_works_as_written(tmp_path, tmp_path_factory, wheelhouse):
    """docs/try.md's walk-through, run as one script with `bash -e`, in tmp_path instead of /tmp,
    on GPUs of this session's own (own_machine)."""
    text = TRY.read_text(encoding="utf-8")
    script = walk_through("try")
    assert "./install.sh --prefix /tmp/cw" in script and "--uninstall" in script
    # Every command of the install by its path there: after a failed install, a bare
    # `cudawrap` would quietly answer from another install on PATH.
    bare = [line for line in script.splitlines() if re.match(r"\s*(cudawrap|create-cudawrap)\b", line)]
    assert bare == [] and "export PATH" not in script, bare
    script = script.replace("/tmp/", f"{tmp_path}/")
    script, uuids = own_machine(script, tmp_path_factory.mktemp("topology"))
    if wheelhouse:
        script = script.replace("./install.sh ", f"./install.sh --wheelhouse {wheelhouse} ", 1)
    # Under the stock PATH of a Debian/Ubuntu server, as a new admin runs it: python3 is then
    # the system's own, the case that once failed (issue 28), whatever this machine's PATH.
    r = run_walk_through(script, clean_env(PATH=STOCK_SUDO_PATH))
    assert "exit 75" in r.stdout
    # What the text after the walk-through quotes is what the commands said.
    after = text.split("<!-- try:end -->", 1)[1].split("\n## ", 1)[0]
    quoted = re.findall(r"`(recon: [^`]*)`", after)
    assert len(quoted) >= 2, after
    for line in quoted:
        assert line.split("…")[0] in r.stderr, line
    assert re.search(r"^0 GPU-\w+ .* pid \d+ \S+ recon ", r.stdout, re.M), r.stdout
    assert "recon: waiting for a device: every device it may use is busy; position 1 in line (pid" in r.stderr
    assert "recon: got GPU-" in r.stderr
    assert os.listdir(tmp_path) == []  # step 5 removed everything
    no_claims_left(uuids)


@pytest.mark.slow
@pytest.mark.root
def test_try_it_with_several_users_works_as_written(mu_world, tmp_path_factory, wheelhouse):
    """docs/try.md's several-users walk-through, run by root with two real accounts for alice and
    bob (`sudo -u NAME` as runuser, `sudo` itself as root already), in a directory all can reach."""
    script = walk_through("try-users")
    alice, bob = mu_world.alice, mu_world.bob
    public = Path(tempfile.mkdtemp(prefix="cudawrap-try-"))
    try:
        public.chmod(0o755)
        script = script.replace("/tmp/", f"{public}/")
        script, uuids = own_machine(script, tmp_path_factory.mktemp("topology"))
        script = script.replace("sudo -u alice ", f"runuser -u {alice.name} -- ")
        script = script.replace("sudo -u bob ", f"runuser -u {bob.name} -- ")
        script = script.replace("sudo ", "")
        if wheelhouse:
            script = script.replace("./install.sh ", f"./install.sh --wheelhouse {wheelhouse} ", 1)
        r = run_walk_through(script, clean_env(PATH=STOCK_SUDO_PATH))
        tables = [t for t in r.stdout.split("install root ")[1:]]
        bobs, roots = tables[-2], tables[-1]  # the two status tables of step 3
        assert bobs.count("held (holder not visible to you)") == 4, r.stdout
        assert len(re.findall(rf"pid \d+ {alice.name} recon", roots)) == 4, r.stdout
        assert "recon: waiting for a device: every device it may use is busy; position 1 in line (pid" in r.stderr
        assert "recon: got GPU-" in r.stderr
        assert os.listdir(public) == []  # step 4 removed everything
        no_claims_left(uuids)
    finally:
        shutil.rmtree(public, ignore_errors=True)


# ---- refusals: one line, a distinct exit code, nothing changed --------------------------


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory everyone can read (tmp_path is private), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="cudawrap-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_nobody() -> List[str]:
    """The command prefix that runs something unprivileged (nothing when we are not root)."""
    if not IS_ROOT:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to drop root")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def public_script(public_dir: Path) -> Path:
    """install.sh where an unprivileged user can read it (with a pyproject.toml beside it)."""
    shutil.copy2(INSTALL_SH, public_dir / "install.sh")
    (public_dir / "pyproject.toml").write_text("")
    return public_dir / "install.sh"


@pytest.mark.parametrize("args, code, words", [
    (["--frobnicate"], 64, ["unknown option '--frobnicate'", "--help"]),
    (["stray"], 64, ["unexpected argument 'stray'"]),
    (["--prefix"], 64, ["--prefix needs a value"]),
    (["--prefix="], 64, ["--prefix needs a value"]),
    (["--unwrap-all", "--prefix", "X"], 64, ["--unwrap-all goes with --uninstall"]),
    (["--keep-wraps", "--prefix", "X"], 64, ["--keep-wraps goes with --uninstall"]),
    (["--uninstall", "--keep-wraps", "--unwrap-all", "--prefix", "X"], 64, ["exclude each other"]),
    (["--purge", "--prefix", "X"], 64, ["--purge goes with --uninstall"]),
    (["--uninstall", "--keep-wraps", "--purge", "--prefix", "X"], 64, ["--purge and --keep-wraps exclude each other"]),
    (["--uninstall", "--wheelhouse", "/tmp", "--prefix", "X"], 64, ["not with --uninstall"]),
    (["--prefix", "X", "--wheelhouse", "/nonexistent-wheels"], 66, ["--wheelhouse /nonexistent-wheels: no such directory"]),
    (["--prefix", "X", "--python", "/nonexistent/python3"], 69, ["--python /nonexistent/python3: no such file"]),
    (["--prefix", "X", "--python", "/bin/true"], 69, ["/bin/true does not run as a Python interpreter"]),
    (["--uninstall", "--prefix", "X"], 66, ["cudawrap is not installed in"]),
    (["--service", "--no-service", "--prefix", "X"], 64, ["--service and --no-service exclude each other"]),
    (["--uninstall", "--no-service", "--prefix", "X"], 64, ["not with --uninstall"]),
], ids=["unknown-option", "stray-argument", "prefix-without-value", "empty-prefix", "unwrap-all-alone",
        "keep-wraps-alone", "keep-and-unwrap", "purge-alone", "keep-and-purge", "uninstall-with-wheelhouse", "no-wheelhouse", "no-such-python", "not-a-python", "nothing-to-uninstall",
        "service-and-not", "uninstall-with-a-way"])
def test_refusals(tmp_path, args, code, words):
    args = [str(tmp_path / "cw") if a == "X" else a for a in args]
    r = install_sh(*args, env=clean_env())
    one_error(r, code, *words)
    assert r.stdout == ""
    assert not (tmp_path / "cw").exists()


def test_help():
    r = install_sh("--help", env=clean_env())
    assert r.returncode == 0 and r.stderr == ""
    for word in ("--prefix DIR", "--service", "--no-service", "--python PATH", "--wheelhouse DIR", "--uninstall",
                 "--unwrap-all", "Exit codes"):
        assert word in r.stdout


def test_system_install_needs_root(public_dir):
    script = public_script(public_dir)
    r = subprocess.run(as_nobody() + ["bash", str(script)], env=clean_env(), capture_output=True, text=True,
                       cwd=public_dir)
    one_error(r, 77, "needs root", "sudo ./install.sh", "--prefix DIR")


def test_unwritable_prefix(public_dir, tmp_path):
    script = public_script(public_dir)
    if IS_ROOT:
        locked = public_dir / "root-owned"  # root's, mode 0755: nobody may write there
    else:
        locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555 if not IS_ROOT else 0o755)
    r = subprocess.run(as_nobody() + ["bash", str(script), "--prefix", str(locked / "cw")], env=clean_env(),
                       capture_output=True, text=True, cwd=public_dir)
    one_error(r, 73, f"{locked} is not writable by", "--prefix")
    assert os.listdir(locked) == []


def tools_without_python(tmp_path: Path) -> Path:
    """A PATH directory with every system tool except python*."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for top in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
        for name in (os.listdir(top) if os.path.isdir(top) else []):
            if not name.startswith("python") and not (tools / name).exists():
                (tools / name).symlink_to(os.path.join(top, name))
    return tools


def without_system_python() -> List[str]:
    """A command prefix under which /usr/bin/python3 is /bin/true (a private mount namespace),
    as on a machine with no system Python; this machine's /usr/bin is untouched."""
    if not IS_ROOT or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (util-linux) to hide /usr/bin/python3")
    if not os.path.exists("/usr/bin/python3"):
        return []
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            'mount --bind /bin/true /usr/bin/python3 && exec "$@"', "sh"]


def private_python(tmp_path: Path) -> Path:
    """A working python3 in a directory only its owner may enter (like root's pyenv build)."""
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    real = hidden / "python-real"
    shutil.copy2(os.path.realpath("/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable),
                 real)
    return fake_python(hidden / "python3", f"""\
case "$*" in
    *realpath*) echo "$0"; exit 0 ;;
esac
exec {real} "$@"
""")


def test_no_python_at_all(tmp_path):
    tools = tools_without_python(tmp_path)
    r = run(*without_system_python(), "bash", INSTALL_SH, "--prefix", tmp_path / "cw", env=clean_env(PATH=str(tools)))
    one_error(r, 69, "no Python 3.9 or newer", "no python3 on PATH", "/usr/bin/python3 does not run as a Python",
              "apt-get install python3 python3-venv", "--python PATH")
    assert not (tmp_path / "cw").exists()


def test_path_python_every_user_can_run_is_taken(tmp_path):
    tools = tools_without_python(tmp_path)
    system = os.path.realpath("/usr/bin/python3")
    (tools / "python3").symlink_to(system)
    empty = tmp_path / "no-wheels"  # pip fails at once: the choice is what this test is about
    empty.mkdir()
    r = install_sh("--prefix", str(tmp_path / "cw"), "--wheelhouse", str(empty), env=clean_env(PATH=str(tools)))
    assert r.returncode == 1, r.stdout + r.stderr
    ver = "%d.%d" % sys.version_info[:2]
    lines = [line for line in r.stdout.splitlines() if line.startswith("==> Python: ")]
    assert lines and lines[0].startswith(f"==> Python: {system} (Python "), r.stdout
    assert lines[0].endswith(", python3 on PATH)"), lines
    assert not (tmp_path / "cw").exists()


def test_private_path_python_gives_way_to_the_system_one(tmp_path):
    """Root's PATH with a pyenv build first: the README's commands still work, and say why."""
    private = private_python(tmp_path)
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    path = f"{private.parent}:{os.environ['PATH']}"
    r = install_sh("--prefix", str(tmp_path / "cw"), "--wheelhouse", str(empty), env=clean_env(PATH=path))
    assert r.returncode == 1, r.stdout + r.stderr
    system = os.path.realpath("/usr/bin/python3")
    assert (f"==> Python: {system} (Python " in r.stdout and "the system's /usr/bin/python3), because "
            f"{private} cannot be run by other users ({private.parent} is not open to them)" in r.stdout), r.stdout
    assert f"creating the virtual environment {tmp_path}/cw/opt/cudawrap/venv with {system} " in r.stdout
    assert "warning" not in r.stderr.split("    pip: ")[0]
    assert not (tmp_path / "cw").exists()


def test_prefix_install_takes_a_private_python_when_there_is_no_other(tmp_path):
    """Nobody else can run it: a prefix install (one person's) goes ahead and says so; a system
    install refuses (test_system_install_refuses_an_interpreter_users_cannot_run)."""
    private = private_python(tmp_path)
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    r = run(*without_system_python(), "bash", INSTALL_SH, "--prefix", tmp_path / "cw", "--wheelhouse", empty,
            env=clean_env(PATH=f"{private.parent}:{tools_without_python(tmp_path)}"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert (f"install.sh: warning: {private} cannot be run by other users ({private.parent} is not open to "
            f"them): only you can run the programs wrapped in {tmp_path}/cw") in r.stderr
    assert f"==> Python: {private} (Python " in r.stdout
    assert not (tmp_path / "cw").exists()


def fake_python(path: Path, body: str) -> Path:
    """A stand-in interpreter: BODY is shell that answers install.sh's probes."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def test_python_too_old(tmp_path):
    old = fake_python(tmp_path / "python3.8", 'echo 3.8\n')
    r = install_sh("--prefix", str(tmp_path / "cw"), "--python", str(old), env=clean_env())
    one_error(r, 69, f"{old} is Python 3.8", "3.9 or newer", "--python PATH")
    assert not (tmp_path / "cw").exists()


def test_python_without_venv_module(tmp_path):
    """As on Debian without python3-venv: `import ensurepip` fails."""
    real = os.path.realpath(sys.executable)
    py = fake_python(tmp_path / "python3", f"""\
case "$*" in
    *ensurepip*) echo "ModuleNotFoundError: No module named 'ensurepip'" >&2; exit 1 ;;
    *realpath*) echo "$0"; exit 0 ;;
esac
exec {real} "$@"
""")
    r = install_sh("--prefix", str(tmp_path / "cw"), "--python", str(py), env=clean_env())
    ver = "%d.%d" % sys.version_info[:2]
    line = one_error(r, 69, f"{py} (Python {ver}) has no venv/ensurepip module")
    if os.path.exists("/etc/debian_version"):
        assert "apt-get install python3-venv" in line and f"python{ver}-venv" in line
    assert not (tmp_path / "cw").exists()


def test_pip_failure_shows_its_last_lines_and_leaves_nothing(tmp_path):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    prefix = tmp_path / "cw"
    r = install_sh("--prefix", str(prefix), "--python", sys.executable, "--wheelhouse", str(empty), env=clean_env())
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert any(line.startswith("    pip: ") for line in lines), r.stderr
    assert lines[-1].startswith("install.sh: error: pip could not install cudawrap"), lines[-1]
    assert str(empty) in lines[-1]
    assert not prefix.exists(), snapshot(prefix)


def test_foreign_command_on_path_is_not_overwritten(tmp_path):
    prefix = tmp_path / "cw"
    other = prefix / "usr" / "local" / "bin" / "cudawrap"
    other.parent.mkdir(parents=True)
    other.write_text("#!/bin/sh\necho another cudawrap\n")
    before = snapshot(prefix)
    r = install_sh("--prefix", str(prefix), "--python", sys.executable, env=clean_env())
    one_error(r, 73, f"{other} exists and is not cudawrap's link", "move it aside")
    assert snapshot(prefix) == before


# ---- the real thing: a system install (root; CI or CUDAWRAP_SYSTEM_TESTS=1 only) -----------


def system_tests_allowed() -> None:
    if not IS_ROOT:
        pytest.skip("needs root")
    if os.environ.get("CI") != "true" and os.environ.get("CUDAWRAP_SYSTEM_TESTS") != "1":
        pytest.skip("changes this machine's /opt, /etc, /var and /usr/local: runs with CI=true or "
                    "CUDAWRAP_SYSTEM_TESTS=1 only")
    system = Layout(Path("/"))
    for path in (system.venv_dir, system.bin_dir / "cudawrap", system.state_dir, system.config_file):
        if os.path.lexists(path):
            pytest.skip(f"cudawrap is already installed here ({path} exists); not touching it")


def system_python() -> str:
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(candidate):
            r = subprocess.run([candidate, "-c", "import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 9))"],
                               capture_output=True)
            if r.returncode == 0:
                return candidate
    pytest.skip("no system python3 (3.9+ with venv) that every user can run")


def wrap_and_run_as_user(create: str, prog: Path, user: pwd.struct_passwd, fake: FakeMachine,
                         env: dict) -> List[str]:
    """Wrap PROG with CREATE (root), run it as USER on a device; the command prefix for USER."""
    r = run(create, prog, env=env)
    assert r.returncode == 0, r.stderr
    as_user = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    r = run(*as_user, prog, env=dict(env, HOME="/nonexistent"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["cvd"] in fake.leaf_uuids()
    return as_user


def public_machine(public_dir: Path, fakenvml_lib: Path) -> FakeMachine:
    """A simulated four-GPU machine every user can reach: library and topology in PUBLIC_DIR."""
    (public_dir / "lib").mkdir()
    shutil.copy2(fakenvml_lib / LIBNAME, public_dir / "lib" / LIBNAME)
    fake = FakeMachine(public_dir / "machine", public_dir / "lib").without_costs()
    fake.load("four-gpus")
    for path in (fake.root, fake.state_dir):
        path.chmod(0o755)
    fake.topology.chmod(0o644)  # written through mkstemp: 0600
    return fake


def acquire_from_user_venv(wheel: Path, python: str, as_user: List[str], user: pwd.struct_passwd,
                           public_dir: Path, wheelhouse: Optional[Path], fake: FakeMachine, env: dict) -> None:
    """USER pip-installs WHEEL into a venv of their own and leases a device with cudawrap.acquire()."""
    mine = public_dir / "user-venv"
    mine.mkdir()
    os.chown(mine, user.pw_uid, user.pw_gid)
    links = []
    if wheelhouse:
        shutil.copytree(wheelhouse, public_dir / "wheels")
        (public_dir / "wheels").chmod(0o755)  # a copy of a private directory
        links = ["--no-index", "--find-links", str(public_dir / "wheels")]
    user_env = dict(env, HOME=str(mine))
    r = run(*as_user, python, "-m", "venv", mine / "venv", env=user_env)
    assert r.returncode == 0, r.stderr
    r = run(*as_user, mine / "venv" / "bin" / "pip", "install", "-q", *links, wheel, env=user_env)
    assert r.returncode == 0, r.stdout + r.stderr
    code = "import os, cudawrap; print(cudawrap.acquire()[0], os.environ['CUDA_VISIBLE_DEVICES'])"
    r = run(*as_user, mine / "venv" / "bin" / "python", "-c", code, env=user_env, cwd=mine)
    assert r.returncode == 0, r.stderr
    uuid_, cvd = r.stdout.split()
    assert uuid_ == cvd and uuid_ in fake.leaf_uuids()


@pytest.fixture
def throwaway_user() -> Iterator[pwd.struct_passwd]:
    name = "cwtest" + uuid.uuid4().hex[:8]
    subprocess.run(["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/bin/sh", name],
                   check=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=False)


@pytest.mark.root
@pytest.mark.slow
def test_system_install_wrap_run_as_user_uninstall(public_dir, fakenvml_lib, wheelhouse, throwaway_user):
    system_tests_allowed()
    python = system_python()
    system = Layout(Path("/"))
    watched = [system.venv_dir, system.lib_dir, system.etc_dir, system.state_dir, system.runtime_dir,
               system.bin_dir / "cudawrap", system.bin_dir / "create-cudawrap", tmpfiles_file(system),
               unit_file(system), completion_file(system), Path("/etc/bash_completion.d"),
               Path("/etc/tmpfiles.d"), Path("/etc/systemd/system")]
    existed = {p: os.path.lexists(p) for p in watched}

    fake = public_machine(public_dir, fakenvml_lib)
    env = clean_env(fake.environ())
    prog = stand_in(public_dir / "apps" / "recon", python)
    original = prog.read_bytes()
    installed = False
    try:
        # README's command as written, `sudo ./install.sh`: no --python, sudo's stock PATH, so
        # install.sh finds the system's python3 by itself.
        assert shutil.which("python3", path=STOCK_SUDO_PATH) == python
        r = install_sh(*wheel_args(wheelhouse), env=dict(env, PATH=STOCK_SUDO_PATH))
        installed = True
        assert r.returncode == 0, r.stdout + r.stderr
        assert os.readlink(system.bin_dir / "cudawrap") == str(system.venv_dir / "bin" / "cudawrap")
        assert sorted(os.listdir(system.lease_dir)) == sorted(fake.leaf_uuids())
        if os.path.isdir("/run/systemd/system"):
            assert f"enabled {UNIT_NAME}" in r.stdout
        else:
            assert f"{UNIT_NAME} not enabled: systemd is not running here" in r.stdout
            assert (f"{SERVICE_UNIT} not enabled (systemd is not running here); start the service, which runs "
                    "the monitor's loop too, with `cudawrap serve --daemon`") in r.stdout
            assert f"{MONITOR_UNIT} not enabled" not in r.stdout

        as_user = wrap_and_run_as_user("/usr/local/bin/create-cudawrap", prog, throwaway_user, fake, env)
        r = run(*as_user, "/usr/local/bin/create-cudawrap", public_dir / "apps" / "other", env=env)
        assert r.returncode == 77, r.stderr  # users may not wrap

        # The user's own venv with the client wheel install.sh left: it leases from the system
        # install with no CUDAWRAP_ROOT, queued with the wrapped programs.
        (wheel,) = wheel_dir(system).glob("cudawrap-*.whl")
        acquire_from_user_venv(wheel, python, as_user, throwaway_user, public_dir, wheelhouse, fake, env)

        r = install_sh("--uninstall", "--unwrap-all", "--purge", env=env)
        installed = r.returncode != 0
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        if installed:
            install_sh("--uninstall", "--unwrap-all", "--purge", env=env)
    assert prog.read_bytes() == original and not prog.is_symlink()
    assert {p: os.path.lexists(p) for p in watched} == existed


@pytest.mark.root
def test_system_install_refuses_an_interpreter_users_cannot_run(public_dir):
    system_tests_allowed()
    real = os.path.realpath(sys.executable)
    hidden = public_dir / "private"
    hidden.mkdir(mode=0o700)
    py = fake_python(hidden / "python3", f"""\
case "$*" in
    *realpath*) echo "$0"; exit 0 ;;
    *"-m venv"*) exit 1 ;;
esac
exec {real} "$@"
""")
    r = install_sh("--python", str(py), env=clean_env())
    one_error(r, 69, f"{py} cannot be run by other users", f"{hidden} is not open to them", "--python")
    assert not os.path.lexists(Layout(Path("/")).venv_dir)
