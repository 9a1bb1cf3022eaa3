"""`make deb`: build the Debian package, install it with apt-get, wrap and run a program as a
user, refuse removal while it is wrapped, purge it, and find nothing left behind; and the one
way from an install.sh install to the package, wrapped programs and configuration kept.

Changes this machine (/opt, /etc, /usr/bin, /var/lib, /run, dpkg's database): root only, and
only with CI=true or CUDAWRAP_SYSTEM_TESTS=1, like test_install.py's system install.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

from cudawrap import __version__, locations as loc, waiter_usable
from cudawrap.base.daemon import running
from cudawrap.install.installation import Layout, manifest_file, wheel_dir
from cudawrap.cli.manpages import PAGES
from support.installsh import (
    SOURCE, STOCK_SUDO_PATH, clean_env, install_sh, process_gone, snapshot, wheel_args,
)
from test_install import (  # noqa: F401 - fixtures
    acquire_from_user_venv, assert_build_shown, one_error, public_dir, public_machine, stand_in, start_monitor_daemon,
    system_python, system_tests_allowed, throwaway_user, wrap_and_run_as_user,
)

OWNED = ["/opt/cudawrap", "/etc/cudawrap", "/var/lib/cudawrap", "/run/cudawrap", "/usr/bin/cudawrap",
         "/usr/bin/create-cudawrap", "/lib/systemd/system/cudawrap-sync.service",
         "/lib/systemd/system/cudawrap-monitor.service", "/lib/systemd/system/cudawrap-mps.service",
         "/lib/systemd/system/cudawrap.service", "/usr/lib/tmpfiles.d/cudawrap.conf",
         "/usr/share/bash-completion/completions/cudawrap", "/usr/share/doc/cudawrap"]


def dpkg_query(field: str, package: str = "cudawrap") -> str:
    r = subprocess.run(["dpkg-query", "-W", f"-f={field}", package], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else ""


def dpkg_status(package: str = "cudawrap") -> str:
    status = dpkg_query("${Status}", package)
    return status if status and "not-installed" not in status else "not-installed"


CONFIG = "/etc/cudawrap/config.toml"
DEFAULT_CONFIG = "/usr/share/cudawrap/config.toml"
# What install.sh puts where the package puts nothing (the package's are in OWNED).
INSTALL_SH_OWNED = ["/usr/local/bin/cudawrap", "/usr/local/bin/create-cudawrap",
                    "/etc/systemd/system/cudawrap-sync.service", "/etc/systemd/system/cudawrap-monitor.service",
                    "/etc/tmpfiles.d/cudawrap.conf", "/etc/bash_completion.d/cudawrap"]


def nothing_installed() -> None:
    for path in OWNED + INSTALL_SH_OWNED:
        if os.path.lexists(path) or dpkg_status() != "not-installed":
            pytest.skip(f"{path} exists or the package is installed: not touching it")


def purge(env: dict) -> subprocess.CompletedProcess:
    return run("apt-get", "purge", "-y", "cudawrap", env=dict(env, CUDAWRAP_UNWRAP_ALL="1"))


def run(*argv: object, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def deb(wheelhouse) -> Path:
    """dist/cudawrap_VERSION_ARCH.deb, built by `make deb` (offline from the wheelhouse)."""
    system_tests_allowed()  # the build alone takes a minute: only where the test will run
    env = clean_env()
    if wheelhouse:
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse))
    r = subprocess.run(["make", "deb"], cwd=SOURCE, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    arch = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
    (built,) = (SOURCE / "dist").glob(f"cudawrap_*_{arch}.deb")
    return built


def contents(deb: Path) -> dict:
    r = subprocess.run(["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True)
    out = {}
    for line in r.stdout.splitlines():
        path = line.split(None, 5)[5].split(" -> ")[0]
        out[path.lstrip(".")] = line
    return out


@pytest.mark.root
@pytest.mark.slow
def test_deb_install_wrap_refuse_unwrap_purge(deb, public_dir, fakenvml_lib, wheelhouse,  # noqa: F811
                                              throwaway_user):  # noqa: F811
    system_tests_allowed()
    nothing_installed()

    files = contents(deb)
    wheel = f"/opt/cudawrap/wheels/cudawrap-{__version__}-py3-none-any.whl"
    assert CONFIG not in files  # not a conffile: postinst writes it where it is missing
    for path in ("/opt/cudawrap/venv/bin/cudawrap", "/usr/bin/cudawrap", "/usr/bin/create-cudawrap",
                 DEFAULT_CONFIG, wheel, "/lib/systemd/system/cudawrap-sync.service",
                 "/lib/systemd/system/cudawrap-monitor.service", "/lib/systemd/system/cudawrap-mps.service",
                 "/lib/systemd/system/cudawrap.service", "/usr/lib/tmpfiles.d/cudawrap.conf",
                 "/usr/share/bash-completion/completions/cudawrap", "/opt/cudawrap/bin/cudawrap-wait",
                 "/usr/share/doc/cudawrap/html/index.html", "/usr/share/doc/cudawrap/html/reference/commands.html",
                 "/usr/share/doc/cudawrap/html/assets/javascripts/mermaid.min.js"):
        assert path in files, path
    assert not any(f.startswith("/opt/cudawrap/venv/") and "mkdocs" in f for f in files)  # the site's tools stay out
    for page in PAGES:
        section = page.rsplit(".", 1)[1]
        assert f"/usr/share/man/man{section}/{page}.gz" in files, page

    fake = public_machine(public_dir, fakenvml_lib)  # dpkg's maintainer scripts see it too
    env = clean_env(fake.environ(), DEBIAN_FRONTEND="noninteractive")
    prog = stand_in(public_dir / "apps" / "recon", "/usr/bin/python3")
    original = prog.read_bytes()
    system = Layout(Path("/"))
    try:
        r = run("apt-get", "install", "-y", "--no-install-recommends", deb, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert dpkg_status() == "install ok installed"
        # postinst made the shim and ran `cudawrap sync`: a lease file per simulated GPU.
        assert system.shim.read_text().startswith("#!/opt/cudawrap/venv/bin/python -IS\n")
        # The waiter the package built: the shim's owner's, writable by nobody else (the shim
        # uses it then), and a program of this machine's (it refuses a start not the shim's).
        assert waiter_usable(os.stat(system.waiter), system.shim.stat().st_uid)
        waited = run(system.waiter, env=env)
        assert waited.returncode == 64 and "started by something other than the cudawrap shim" in waited.stderr
        assert sorted(os.listdir(system.lease_dir)) == sorted(fake.leaf_uuids())
        assert subprocess.run(["man", "-w", "cudawrap.toml"], capture_output=True).returncode == 0
        # The configuration is the commented default, written by postinst, not dpkg's.
        assert Path(CONFIG).read_bytes() == Path(DEFAULT_CONFIG).read_bytes()
        assert "wrote the default configuration" in r.stdout
        assert CONFIG not in dpkg_query("${Conffiles}")
        assert_build_shown(Path("/usr/bin/cudawrap"), env, "built")

        as_user = wrap_and_run_as_user("/usr/bin/create-cudawrap", prog, throwaway_user, fake, env)
        # The client wheel the package ships, in a user's own venv, leases from the package's install.
        acquire_from_user_venv(Path(wheel), system_python(), as_user, throwaway_user, public_dir, wheelhouse,
                               fake, env)

        # Removal is refused while a program is wrapped, and changes nothing (the monitor runs on).
        pid = start_monitor_daemon(Path("/usr/bin/cudawrap"), system, env)
        before = snapshot(Path("/opt/cudawrap"))
        r = run("apt-get", "purge", "-y", "cudawrap", env=env)
        assert r.returncode != 0
        assert "1 program(s) still wrapped" in r.stdout + r.stderr and "CUDAWRAP_UNWRAP_ALL=1" in r.stdout + r.stderr
        assert prog.is_symlink() and snapshot(Path("/opt/cudawrap")) == before
        assert running(loc.under("/", loc.MONITOR_PID)) == pid
        assert subprocess.run(["dpkg", "--configure", "-a"], env=env, capture_output=True).returncode == 0
        assert dpkg_status() == "install ok installed"

        # With the documented flag the programs are unwrapped first, the monitor stopped (it
        # would recreate /run/cudawrap), then everything goes.
        r = purge(env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"cudawrap: stopped `cudawrap monitor --daemon` (pid {pid})" in r.stdout
        assert process_gone(pid)
        assert os.listdir(fake.claims_dir) == []  # the install's device claims went with it (postrm)
    finally:
        if dpkg_status() != "not-installed":
            purge(env)
    assert dpkg_status() == "not-installed"
    assert not prog.is_symlink() and prog.read_bytes() == original
    assert os.listdir(prog.parent) == ["recon"]
    left = [path for path in OWNED if os.path.lexists(path)]
    assert left == [], left


@pytest.mark.root
@pytest.mark.slow
def test_from_install_sh_to_the_deb_keeps_wraps_config_and_leases(deb, public_dir, fakenvml_lib,  # noqa: F811
                                                                  wheelhouse, throwaway_user):  # noqa: F811
    """README's one way from install.sh to the package: `install.sh --uninstall --keep-wraps`, then
    a non-interactive apt-get install; both programs stay wrapped and run, the edited config stays."""
    system_tests_allowed()
    nothing_installed()
    python = system_python()
    fake = public_machine(public_dir, fakenvml_lib)
    env = clean_env(fake.environ(), DEBIAN_FRONTEND="noninteractive")
    progs = [stand_in(public_dir / "apps" / name, python) for name in ("recon", "train")]
    originals = {prog: prog.read_bytes() for prog in progs}
    system = Layout(Path("/"))
    edited = b""
    try:
        r = install_sh(*wheel_args(wheelhouse), env=dict(env, PATH=STOCK_SUDO_PATH))
        assert r.returncode == 0, r.stdout + r.stderr
        for prog in progs:
            as_user = wrap_and_run_as_user("/usr/local/bin/create-cudawrap", prog, throwaway_user, fake, env)
        written = Path(CONFIG).read_bytes()
        edited = written.replace(b'#wait = "forever"', b"wait = 30").replace(b"#[policy]", b"[policy]")
        assert edited != written
        Path(CONFIG).write_bytes(edited)
        leases = {name: os.stat(system.lease_file(name)).st_ino for name in fake.leaf_uuids()}

        # The package and install.sh name the same way, each at the other's refusal.
        r = run("apt-get", "install", "-y", "--no-install-recommends", deb, env=env)
        assert r.returncode != 0 and dpkg_status() == "not-installed"
        assert "run 'sudo ./install.sh --uninstall --keep-wraps' from its source" in r.stdout + r.stderr
        r = install_sh("--uninstall", env=env)
        one_error(r, 65, "2 program(s) still wrapped", "install.sh --uninstall --keep-wraps")

        r = install_sh("--uninstall", "--keep-wraps", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "now run `sudo apt-get install ./cudawrap_VERSION_ARCH.deb`" in r.stdout
        assert not manifest_file(system).exists() and not system.venv_dir.exists()
        assert [p for p in INSTALL_SH_OWNED if os.path.lexists(p)] == []
        assert not wheel_dir(system).exists()
        assert all(prog.is_symlink() for prog in progs) and Path(CONFIG).read_bytes() == edited

        # No conffile prompt: the edited file is the admin's, kept as it is.
        r = run("apt-get", "install", "-y", "--no-install-recommends", deb, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert dpkg_status() == "install ok installed"
        assert f"kept the configuration {CONFIG}" in r.stdout
        assert Path(CONFIG).read_bytes() == edited
        # Every device keeps its lease file. Those nobody held are fresh ones: the package's
        # service, taking the directories over, replaces each lease file it finds free, so a
        # descriptor opened before it (by anyone) guards nothing (a held one it leaves alone).
        after = {name: os.stat(system.lease_file(name)).st_ino for name in fake.leaf_uuids()}
        assert set(after) == set(leases)

        listed = run("/usr/bin/cudawrap", "list", "--json", env=env)
        assert sorted(row["link"] for row in json.loads(listed.stdout)) == sorted(map(str, progs))
        for prog in progs:
            r = run(*as_user, prog, env=dict(env, HOME="/nonexistent"))
            assert r.returncode == 0, r.stderr
            assert json.loads(r.stdout.splitlines()[0])["cvd"] in fake.leaf_uuids()
        r = run("/usr/bin/cudawrap", "doctor", env=env)
        assert r.returncode == 0, r.stdout + r.stderr

        r = purge(env)
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        if dpkg_status() != "not-installed":
            purge(env)
        if not manifest_file(system).exists() and any(prog.is_symlink() for prog in progs):
            install_sh(*wheel_args(wheelhouse), env=env)  # the way back, to unwrap below
        if manifest_file(system).exists():
            install_sh("--uninstall", "--unwrap-all", "--purge", env=env)
        if edited and os.path.isfile(CONFIG) and Path(CONFIG).read_bytes() == edited:
            os.unlink(CONFIG)  # kept by an uninstall as the admin's own edit: it is this test's
            os.rmdir(os.path.dirname(CONFIG))
    assert dpkg_status() == "not-installed"
    assert all(prog.read_bytes() == originals[prog] and not prog.is_symlink() for prog in progs)
    left = [path for path in OWNED + INSTALL_SH_OWNED if os.path.lexists(path)]
    assert left == [], left
