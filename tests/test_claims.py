"""Two installs on one machine never hand out the same GPU: each device is claimed machine-wide
by one install, and the other install's sync leaves it alone, saying so."""
import json
import os
import shutil
import sys
from pathlib import Path

from support.installed import Installed, ready_line
from cudawrap.lease.claims import CLAIMS_ENV, claims_dir
from cudawrap.install.installation import prepare
from cudawrap.paths import Layout
from cudawrap.ops.sync import sync


def second_install(inst: Installed, tmp_path: Path) -> Installed:
    """Another install root (a prefix install beside the first) on the same simulated machine."""
    layout = Layout(tmp_path / "other-root")
    prepare(layout, sys.executable)
    bindir = tmp_path / "other-bin"
    bindir.mkdir()
    return Installed(layout, inst.machine, bindir)


def test_the_claims_are_the_machines(installed) -> None:
    inst = installed("four-gpus")
    assert claims_dir() == os.environ[CLAIMS_ENV] == str(inst.machine.claims_dir)
    claims = inst.machine.claims_dir
    assert sorted(p.name for p in claims.iterdir()) == sorted(inst.machine.leaf_uuids())
    assert all((claims / u).read_text() == f"{inst.layout.root}\n" for u in inst.machine.leaf_uuids())
    assert claims.stat().st_mode & 0o7777 == 0o1777  # every install's owner may claim, as in /tmp


def test_a_second_install_leaves_the_devices_of_the_first_alone(installed, tmp_path: Path) -> None:
    first = installed("four-gpus")
    first.wrap("recon")
    holders = [first.start("recon", "--hold", "30") for _ in range(4)]  # every GPU held by the first
    try:
        held = sorted(ready_line(p)["cvd"] for p in holders)
        assert held == sorted(first.machine.leaf_uuids())
        other = second_install(first, tmp_path)
        report = sync(other.layout)
        assert report.created == [] and sorted(report.elsewhere) == held
        for uuid in held:
            assert (f"warning: {uuid} is managed by the cudawrap install at {first.layout.root} "
                    f"(claimed in {first.machine.claims_dir}); not leased here") in report.lines
        assert os.listdir(other.layout.lease_dir) == []
        # A run of the second install cannot be given a GPU the first one leased.
        other.wrap("recon")
        r = other.run("recon", CUDAWRAP_WAIT="0")
        assert r.returncode != 0 and b'"cvd"' not in r.stdout, r.stdout
        doctor = other.cli("doctor")
        assert f"note: leases: 4 device(s) managed by another cudawrap install: " in doctor.stdout.decode()
        assert "error: leases" not in doctor.stdout.decode()
    finally:
        for p in holders:
            p.kill()
            p.wait()


def test_claims_of_a_removed_install_are_taken_over(installed, tmp_path: Path) -> None:
    first = installed("four-gpus")
    other = second_install(first, tmp_path)
    assert sync(other.layout).created == []
    shutil.rmtree(first.layout.runtime_dir)  # uninstalled (or its /run gone): its claims are stale
    report = sync(other.layout)
    assert sorted(report.created) == sorted(first.machine.leaf_uuids()) and report.elsewhere == []
    claims = first.machine.claims_dir
    assert all((claims / u).read_text() == f"{other.layout.root}\n" for u in first.machine.leaf_uuids())
    other.wrap("recon")
    r = other.run("recon")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["cvd"] in first.machine.leaf_uuids()


def test_release_removes_only_this_installs_own_claims(tmp_path: Path) -> None:
    """An uninstall's release (issue 51 item 7): its root's claims go; another install's claim,
    a claim another user made naming it, and a link to one of its claims stay."""
    from cudawrap.lease.claims import release

    claims = tmp_path / "claims"
    claims.mkdir()
    for name, root in (("GPU-mine-1", "/opt/a"), ("GPU-mine-2", "/opt/a"), ("GPU-other", "/opt/b"),
                       ("GPU-theirs", "/opt/a")):
        (claims / name).write_text(f"{root}\n")
    os.chown(claims / "GPU-theirs", 65534, 65534)
    (claims / "GPU-link").symlink_to(claims / "GPU-mine-1")
    assert release("/opt/a", str(claims)) == ["GPU-mine-1", "GPU-mine-2"]
    assert sorted(os.listdir(claims)) == ["GPU-link", "GPU-other", "GPU-theirs"]
    assert release("/opt/a", str(tmp_path / "none")) == []
