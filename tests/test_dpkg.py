"""Programs a dpkg package ships: wrapped with a diversion, so upgrades land at CUDAWRAP_<name>.

Each test installs throwaway packages into its own dpkg root (``dpkg --root``) and points
cudawrap at it with dpkg's own DPKG_ROOT; the system's package database is never touched.
"""
import os
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest

from support.admin import Admin, snapshot
from support.procs import one_line
from support.strace import needs_strace, strace_cli
from cudawrap.policy import registry
from cudawrap.admin.divert import Dpkg

pytestmark = pytest.mark.skipif(
    not all(shutil.which(t) for t in ("dpkg", "dpkg-deb", "dpkg-divert", "dpkg-query")), reason="needs dpkg")

PACKAGE = "cudawrap-test-fakeprog"


def build_deb(out: Path, version: str, path: str = "usr/bin/fakeprog", fields: str = "") -> Path:
    tree = out / f"tree-{version}-{path.replace('/', '_')}"
    (tree / "DEBIAN").mkdir(parents=True)
    prog = tree / path
    prog.parent.mkdir(parents=True)
    prog.write_text(f'#!/bin/sh\necho "fakeprog v{version} $*"\n')
    prog.chmod(0o755)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {PACKAGE}\nVersion: {version}\nArchitecture: all\n"
        f"Maintainer: cudawrap tests <tests@example.invalid>\n{fields}Description: a program to wrap\n")
    deb = out / f"fakeprog_{version}_{path.replace('/', '_')}.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(tree), str(deb)], check=True,
                   capture_output=True)
    return deb


class Sandbox:
    def __init__(self, admin: Admin) -> None:
        self.admin = admin
        self.root = admin.tmp / "dpkgroot"
        for sub in ("var/lib/dpkg/updates", "var/lib/dpkg/info", "usr/bin"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "var/lib/dpkg/status").touch()
        admin.env_extra["DPKG_ROOT"] = str(self.root)
        self.prog = self.root / "usr/bin/fakeprog"
        self.real = self.root / "usr/bin/CUDAWRAP_fakeprog"

    def dpkg(self, *args: str) -> subprocess.CompletedProcess:
        result = subprocess.run(["dpkg", f"--root={self.root}", "--force-not-root", *args],
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        return result

    def diversions(self) -> List[str]:
        out = subprocess.run(["dpkg-divert", f"--root={self.root}", "--list"], capture_output=True,
                             text=True, check=True).stdout
        return out.splitlines()

    def owner(self, name: str) -> str:
        return subprocess.run(["dpkg-query", f"--root={self.root}", "-S", name], capture_output=True,
                              text=True).stdout


@pytest.fixture
def sandbox(admin: Admin) -> Sandbox:
    return Sandbox(admin)


@pytest.fixture
def debs(tmp_path: Path):
    out = tmp_path / "debs"
    out.mkdir()
    return {v: build_deb(out, v) for v in ("1", "2", "3")}


def run(path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDAWRAP_", "DPKG_"))}
    result = subprocess.run([str(path)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout


DIVERSION = "diversion of /usr/bin/fakeprog to /usr/bin/CUDAWRAP_fakeprog by cudawrap"


def test_upgrade_lands_at_the_real_name_and_unwrap_removes_the_diversion(sandbox: Sandbox, debs) -> None:
    admin = sandbox.admin
    sandbox.dpkg("-i", str(debs["1"]))
    created = admin.create("--gpus", "1", str(sandbox.prog))
    assert created.returncode == 0, created.stderr
    assert created.stdout == (f"wrapped {sandbox.prog} (real program: {sandbox.real}, "
                              f"diverted from package {PACKAGE})\n")
    assert sandbox.diversions() == [DIVERSION]
    (e,) = registry.load(admin.layout)
    assert (e.package, e.diversion) == (PACKAGE, "/usr/bin/fakeprog")
    assert run(sandbox.prog) == "fakeprog v1 \n"

    sandbox.dpkg("-i", str(debs["2"]))  # the upgrade writes through the diversion
    assert os.readlink(sandbox.prog) == str(admin.layout.program_shim(str(sandbox.prog)))
    assert sandbox.real.read_text() == '#!/bin/sh\necho "fakeprog v2 $*"\n'
    assert run(sandbox.prog) == "fakeprog v2 \n"
    assert '"state": "binary-changed"' in admin.cli("list", "--json").stdout
    checked = admin.cli("doctor")
    assert checked.returncode == 0 and f"warning: {sandbox.prog}: " in checked.stdout

    before = admin.snapshot()
    refused = admin.cli("unwrap", str(sandbox.prog))
    assert refused.returncode == 65 and "binary-changed" in one_line(refused)
    assert admin.snapshot() == before and sandbox.diversions() == [DIVERSION]

    done = admin.cli("unwrap", "--force", str(sandbox.prog))
    assert done.returncode == 0, done.stderr
    assert sandbox.diversions() == []
    assert not sandbox.prog.is_symlink() and not sandbox.real.exists()
    assert run(sandbox.prog) == "fakeprog v2 \n"
    assert sandbox.owner("/usr/bin/fakeprog") == f"{PACKAGE}: /usr/bin/fakeprog\n"
    sandbox.dpkg("-i", str(debs["3"]))  # no diversion any more: straight to the name
    assert run(sandbox.prog) == "fakeprog v3 \n"
    sandbox.dpkg("--purge", PACKAGE)


def test_wrap_then_unwrap_is_exact_and_leaves_no_diversion(sandbox: Sandbox, debs) -> None:
    admin = sandbox.admin
    sandbox.dpkg("-i", str(debs["1"]))
    before = snapshot(sandbox.root / "usr")
    assert admin.create(str(sandbox.prog)).returncode == 0
    assert sandbox.prog.is_symlink() and sandbox.diversions() == [DIVERSION]
    result = admin.cli("unwrap", str(sandbox.prog))
    assert result.returncode == 0, result.stderr
    assert snapshot(sandbox.root / "usr") == before
    assert sandbox.diversions() == []


def test_doctor_accepts_an_upgrade_then_plain_unwrap_works(sandbox: Sandbox, debs) -> None:
    admin = sandbox.admin
    sandbox.dpkg("-i", str(debs["1"]))
    assert admin.create(str(sandbox.prog)).returncode == 0
    sandbox.dpkg("-i", str(debs["2"]))
    assert "recorded" in admin.cli("doctor", "--repair").stdout
    assert admin.cli("unwrap", str(sandbox.prog)).returncode == 0
    assert run(sandbox.prog) == "fakeprog v2 \n" and sandbox.diversions() == []


def test_removed_package_is_cleaned_up_by_doctor(sandbox: Sandbox, debs) -> None:
    admin = sandbox.admin
    sandbox.dpkg("-i", str(debs["1"]))
    assert admin.create(str(sandbox.prog)).returncode == 0
    sandbox.dpkg("--remove", PACKAGE)  # removes the diverted file, CUDAWRAP_fakeprog
    assert not sandbox.real.exists()
    assert '"state": "real-missing"' in admin.cli("list", "--json").stdout
    repaired = admin.cli("doctor", "--repair")
    assert repaired.returncode == 0, repaired.stdout
    assert f"removed the registry entry and the shim link of {sandbox.prog}" in repaired.stdout
    assert sandbox.diversions() == [] and not os.path.lexists(sandbox.prog)


def test_a_program_diverted_by_another_package_is_refused(sandbox: Sandbox, debs) -> None:
    admin = sandbox.admin
    sandbox.dpkg("-i", str(debs["1"]))
    subprocess.run(["dpkg-divert", f"--root={sandbox.root}", "--package", "someone-else", "--no-rename",
                    "--divert", "/usr/bin/fakeprog.other", "--add", "/usr/bin/fakeprog"], check=True,
                   capture_output=True)
    before = admin.snapshot()
    result = admin.create(str(sandbox.prog))
    assert result.returncode == 65
    assert "already diverted by someone-else" in one_line(result)
    assert admin.snapshot() == before


def test_orphan_diversion_is_removed_by_doctor(sandbox: Sandbox, debs) -> None:
    admin = sandbox.admin
    sandbox.dpkg("-i", str(debs["1"]))
    subprocess.run(["dpkg-divert", f"--root={sandbox.root}", "--package", "cudawrap", "--no-rename",
                    "--divert", "/usr/bin/CUDAWRAP_fakeprog", "--add", "/usr/bin/fakeprog"], check=True,
                   capture_output=True)
    refused = admin.create(str(sandbox.prog))
    assert refused.returncode == 65 and "doctor --repair" in one_line(refused)
    result = admin.cli("doctor")
    assert result.returncode == 65 and "nothing is wrapped there" in result.stdout
    repaired = admin.cli("doctor", "--repair")
    assert "removed the diversion" in repaired.stdout and repaired.returncode == 0
    assert sandbox.diversions() == []
    assert admin.create(str(sandbox.prog)).returncode == 0


def test_diversion_lost_is_restored_by_doctor(sandbox: Sandbox, debs) -> None:
    admin = sandbox.admin
    sandbox.dpkg("-i", str(debs["1"]))
    assert admin.create(str(sandbox.prog)).returncode == 0
    subprocess.run(["dpkg-divert", f"--root={sandbox.root}", "--package", "cudawrap", "--no-rename",
                    "--remove", "/usr/bin/fakeprog"], check=True, capture_output=True)
    result = admin.cli("doctor")
    assert result.returncode == 65 and "diversion of /usr/bin/fakeprog is gone" in result.stdout
    assert admin.cli("doctor", "--repair").returncode == 0
    assert sandbox.diversions() == [DIVERSION]


def test_merged_usr_alias(admin: Admin, tmp_path: Path) -> None:
    """The package lists /bin/fakeprog; on disk that is /usr/bin/fakeprog, the path given."""
    sandbox = Sandbox(admin)
    (sandbox.root / "bin").symlink_to("usr/bin")
    out = tmp_path / "debs"
    out.mkdir()
    v1, v2 = build_deb(out, "1", "bin/fakeprog"), build_deb(out, "2", "bin/fakeprog")
    sandbox.dpkg("-i", str(v1))
    assert sandbox.prog.is_file()
    assert admin.create(str(sandbox.prog)).returncode == 0
    assert sandbox.diversions() == ["diversion of /bin/fakeprog to /bin/CUDAWRAP_fakeprog by cudawrap"]
    sandbox.dpkg("-i", str(v2))
    assert run(sandbox.prog) == "fakeprog v2 \n" and sandbox.prog.is_symlink()
    assert admin.cli("unwrap", "--force", str(sandbox.prog)).returncode == 0
    assert sandbox.diversions() == []


def test_owner_lookup(sandbox: Sandbox, debs) -> None:
    sandbox.dpkg("-i", str(debs["1"]))
    dpkg = Dpkg.from_environment({"DPKG_ROOT": str(sandbox.root)})
    assert dpkg.owner(str(sandbox.prog)) == (PACKAGE, "/usr/bin/fakeprog")
    assert dpkg.owner(str(sandbox.root / "usr/bin/other")) is None
    assert dpkg.owner("/outside/the/root") is None
    assert Dpkg(available=False).owner(str(sandbox.prog)) is None


@pytest.mark.slow
@needs_strace
def test_kill_9_while_wrapping_a_packaged_program(sandbox: Sandbox, debs) -> None:
    """SIGKILL at each step, dpkg-divert's own included: the program runs throughout, and
    doctor --repair leaves a wrap whose diversion matches the registry (or neither)."""
    admin = sandbox.admin
    sandbox.dpkg("-i", str(debs["1"]))
    original = snapshot(sandbox.root / "usr")
    killed = 0
    for syscall in ("linkat", "link", "symlink", "rename", "unlink"):
        for when in range(1, 30):
            result = strace_cli(admin, syscall, when, str(sandbox.prog))
            if result.returncode == 0:
                assert admin.cli("unwrap", str(sandbox.prog)).returncode == 0
                assert snapshot(sandbox.root / "usr") == original and sandbox.diversions() == []
                break
            killed += 1
            assert run(sandbox.prog) == "fakeprog v1 \n", (syscall, when)
            repaired = admin.cli("doctor", "--repair")
            assert "error:" not in repaired.stdout, (syscall, when, repaired.stdout)
            wrapped = registry.load(admin.layout).find(str(sandbox.prog)) is not None
            assert sandbox.diversions() == ([DIVERSION] if wrapped else []), (syscall, when)
            if wrapped:
                assert admin.cli("unwrap", str(sandbox.prog)).returncode == 0
            assert snapshot(sandbox.root / "usr") == original, (syscall, when)
    assert killed >= 5


@pytest.mark.parametrize("fields, why", [
    ("Essential: yes\n", "marked Essential"),
    ("Priority: required\n", "of Priority required"),
    ("Priority: important\n", "of Priority important"),
], ids=["essential", "required", "important"])
def test_a_base_system_program_is_refused_unless_forced(sandbox: Sandbox, tmp_path: Path, fields: str,
                                                        why: str) -> None:
    """Every `true` on the machine taking a GPU lease is not what an admin means by default."""
    sandbox.dpkg("-i", str(build_deb(tmp_path, "1", fields=fields)))
    admin = sandbox.admin
    before = snapshot(sandbox.root)
    refused = admin.create(str(sandbox.prog))
    assert refused.returncode == 65
    assert one_line(refused) == (
        f"create-cudawrap: {sandbox.prog}: belongs to {PACKAGE}, a package {why} (part of the base system), so "
        "every run of fakeprog on this machine, by any user or script, would take a device; wrap a CUDA "
        "program, or give --force if that is meant")
    assert snapshot(sandbox.root) == before and sandbox.diversions() == []
    forced = admin.create("--force", str(sandbox.prog))
    assert forced.returncode == 0, forced.stderr
    assert sandbox.diversions() == [DIVERSION] and run(sandbox.prog) == "fakeprog v1 \n"

