"""`make deb`: build the Debian package, install it with apt-get, wrap and run a program as a
user, refuse removal while it is wrapped, purge it, and find nothing left behind.

Changes this machine (/opt, /etc, /usr/bin, /var/lib, /run, dpkg's database): root only, and
only with CI=true or CUDAWRAP_SYSTEM_TESTS=1, like test_install.py's system install.
"""
import os
import subprocess
from pathlib import Path

import pytest

from cudawrap.installation import Layout
from cudawrap.manpages import PAGES
from installfix import SOURCE, clean_env, snapshot
from test_install import (  # noqa: F401 - fixtures
    public_dir, public_machine, stand_in, system_tests_allowed, throwaway_user, wrap_and_run_as_user,
)

OWNED = ["/opt/cudawrap", "/etc/cudawrap", "/var/lib/cudawrap", "/run/cudawrap", "/usr/bin/cudawrap",
         "/usr/bin/create-cudawrap", "/lib/systemd/system/cudawrap-sync.service",
         "/lib/systemd/system/cudawrap-monitor.service", "/lib/systemd/system/cudawrap-mps.service",
         "/usr/lib/tmpfiles.d/cudawrap.conf",
         "/usr/share/bash-completion/completions/cudawrap", "/usr/share/doc/cudawrap"]


def dpkg_status(package: str = "cudawrap") -> str:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True, text=True)
    return r.stdout if r.returncode == 0 and "not-installed" not in r.stdout else "not-installed"


def run(*argv: object, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def deb(wheelhouse) -> Path:
    """dist/cudawrap_VERSION_all.deb, built by `make deb` (offline from the wheelhouse)."""
    system_tests_allowed()  # the build alone takes a minute: only where the test will run
    env = clean_env()
    if wheelhouse:
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse))
    r = subprocess.run(["make", "deb"], cwd=SOURCE, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    (built,) = (SOURCE / "dist").glob("cudawrap_*_all.deb")
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
def test_deb_install_wrap_refuse_unwrap_purge(deb, public_dir, fakenvml_lib, throwaway_user):  # noqa: F811
    system_tests_allowed()
    for path in OWNED:
        if os.path.lexists(path) or dpkg_status() != "not-installed":
            pytest.skip(f"{path} exists or the package is installed: not touching it")

    files = contents(deb)
    for path in ("/opt/cudawrap/venv/bin/cudawrap", "/usr/bin/cudawrap", "/usr/bin/create-cudawrap",
                 "/etc/cudawrap/config.toml", "/lib/systemd/system/cudawrap-sync.service",
                 "/lib/systemd/system/cudawrap-monitor.service", "/lib/systemd/system/cudawrap-mps.service",
                 "/usr/lib/tmpfiles.d/cudawrap.conf", "/usr/share/bash-completion/completions/cudawrap"):
        assert path in files, path
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
        assert sorted(os.listdir(system.lease_dir)) == sorted(fake.leaf_uuids())
        assert subprocess.run(["man", "-w", "cudawrap.toml"], capture_output=True).returncode == 0

        wrap_and_run_as_user("/usr/bin/create-cudawrap", prog, throwaway_user, fake, env)

        # Removal is refused while a program is wrapped, and changes nothing.
        before = snapshot(Path("/opt/cudawrap"))
        r = run("apt-get", "purge", "-y", "cudawrap", env=env)
        assert r.returncode != 0
        assert "1 program(s) still wrapped" in r.stdout + r.stderr and "CUDAWRAP_UNWRAP_ALL=1" in r.stdout + r.stderr
        assert prog.is_symlink() and snapshot(Path("/opt/cudawrap")) == before
        assert subprocess.run(["dpkg", "--configure", "-a"], env=env, capture_output=True).returncode == 0
        assert dpkg_status() == "install ok installed"

        # With the documented flag the programs are unwrapped first, then everything goes.
        r = run("apt-get", "purge", "-y", "cudawrap", env=dict(env, CUDAWRAP_UNWRAP_ALL="1"))
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        if dpkg_status() != "not-installed":
            run("apt-get", "purge", "-y", "cudawrap", env=dict(env, CUDAWRAP_UNWRAP_ALL="1"))
    assert dpkg_status() == "not-installed"
    assert not prog.is_symlink() and prog.read_bytes() == original
    assert os.listdir(prog.parent) == ["recon"]
    left = [path for path in OWNED if os.path.lexists(path)]
    assert left == [], left
