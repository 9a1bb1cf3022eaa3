"""cudawrap doctor: one line per finding, exit 0 only when healthy; --repair fixes what it can."""
import os
import shutil
import subprocess
from pathlib import Path
from typing import List

import pytest

from support.admin import Admin, make_program, run_as, snapshot
from support.procs import root_only
import cudawrap
from cudawrap.policy import registry
from cudawrap.install.installation import shim_version
from cudawrap.admin.inspect_wraps import facts_of
from cudawrap.policy.registry import Entry


def lines(result, level: str) -> List[str]:
    return [line for line in result.stdout.splitlines() if line.startswith(level + ": ")]


def doctor(admin: Admin, *args: str, **env: str):
    return admin.cli("doctor", *args, **env)


def test_a_fresh_install_is_healthy(admin: Admin) -> None:
    result = doctor(admin)
    assert result.returncode == 0, result.stdout
    assert lines(result, "error") == []
    assert f"ok: shim: {admin.layout.shim}" in result.stdout.splitlines()
    assert any(line.startswith("ok: registry: ") for line in result.stdout.splitlines())
    # Without NVML, the lease files cannot be compared with the devices: said, not failed.
    assert any("lease files not checked" in line for line in lines(result, "note"))


def test_wrapped_programs_are_checked(admin: Admin) -> None:
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    result = doctor(admin)
    assert result.returncode == 0
    assert f"ok: {prog}: wrapped" in result.stdout.splitlines()


def test_shim_replaced_by_an_upgrade_is_rewrapped(admin: Admin) -> None:
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    prog.unlink()  # what a package upgrade without a diversion does
    make_program(admin.bindir, "recon", '#!/bin/sh\necho "recon v2 $*"\n')
    result = doctor(admin)
    assert result.returncode == 65
    assert any(str(prog) in line and "regular file again" in line for line in lines(result, "error"))
    assert "doctor --repair" in result.stderr
    repaired = doctor(admin, "--repair")
    assert repaired.returncode == 0, repaired.stdout
    (fixed,) = lines(repaired, "fixed")
    assert f"re-wrapped {prog}: the new binary there became {admin.bindir / 'CUDAWRAP_recon'}" in fixed
    assert "replacing the one wrapped" in fixed
    assert os.readlink(prog) == str(admin.layout.program_shim(str(prog)))
    assert (admin.bindir / "CUDAWRAP_recon").read_text() == '#!/bin/sh\necho "recon v2 $*"\n'
    # The build it replaced is kept, never overwritten silently.
    assert f"the previous real program (sha256 " in fixed and f"was kept as {prog}.cudawrap-saved" in fixed
    assert Path(f"{prog}.cudawrap-saved").read_text() == '#!/bin/sh\necho "recon $*"\n'
    assert doctor(admin).returncode == 0


def test_missing_link_is_recreated(admin: Admin) -> None:
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    prog.unlink()
    assert doctor(admin).returncode == 65
    repaired = doctor(admin, "--repair")
    assert f"recreated the shim link {prog}" in repaired.stdout and repaired.returncode == 0
    assert os.readlink(prog) == str(admin.layout.program_shim(str(prog)))


def test_entry_whose_program_is_gone_is_removed_after_saying_so(admin: Admin) -> None:
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    (admin.bindir / "CUDAWRAP_recon").unlink()  # the package was removed
    result = doctor(admin)
    assert result.returncode == 65 and "is gone" in result.stdout
    repaired = doctor(admin, "--repair")
    assert repaired.returncode == 0
    (fixed,) = lines(repaired, "fixed")
    assert f"removed the registry entry and the shim link of {prog}" in fixed
    assert not os.path.lexists(prog) and len(registry.load(admin.layout)) == 0


def test_changed_binary_is_a_warning_and_repair_records_it(admin: Admin) -> None:
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    (admin.bindir / "CUDAWRAP_recon").write_text("#!/bin/sh\necho upgraded\n")
    result = doctor(admin)
    assert result.returncode == 0
    assert any("changed since it was wrapped" in line for line in lines(result, "warning"))
    repaired = doctor(admin, "--repair")
    assert "recorded" in repaired.stdout and repaired.returncode == 0
    assert lines(doctor(admin), "warning") == []


def _intent(admin: Admin, prog: Path, phase: str = "wrapping") -> Entry:
    facts = facts_of(str(prog))
    entry = Entry(link=str(prog), real=str(prog.parent / ("CUDAWRAP_" + prog.name)), sha256=facts.sha256,
                  mode=facts.mode, uid=facts.uid, gid=facts.gid, policy={"gpus": 1}, wrapped_by="alice",
                  wrapped_at="2024-01-01T00:00:00Z", cudawrap_version="0.1.0", phase=phase)
    registry.update(admin.layout, lambda reg: reg.put(entry))
    return entry


def _only_intent(admin: Admin, prog: Path) -> None:
    _intent(admin, prog)


def _hard_link_made(admin: Admin, prog: Path) -> None:
    _intent(admin, prog)
    os.link(prog, prog.parent / "CUDAWRAP_recon")


def _link_in_place(admin: Admin, prog: Path) -> None:
    _hard_link_made(admin, prog)
    tmp = prog.parent / ".cudawrap-tmp-recon"
    tmp.symlink_to(admin.layout.shim)
    os.rename(tmp, prog)


def _tmp_link_left(admin: Admin, prog: Path) -> None:
    _hard_link_made(admin, prog)
    (prog.parent / ".cudawrap-tmp-recon").symlink_to(admin.layout.shim)


@pytest.mark.parametrize("interrupt", [_only_intent, _hard_link_made, _link_in_place, _tmp_link_left])
def test_interrupted_create_is_finished(admin: Admin, interrupt) -> None:
    prog = admin.program("recon")
    interrupt(admin, prog)
    assert admin.cli("list", "--json").stdout.count('"state": "interrupted"') == 1
    assert doctor(admin).returncode == 65
    repaired = doctor(admin, "--repair")
    assert repaired.returncode == 0, repaired.stdout
    assert f"finished the interrupted wrap of {prog}" in repaired.stdout
    assert doctor(admin).returncode == 0
    (e,) = registry.load(admin.layout)
    assert e.phase == "wrapped" and dict(e.policy) == {"gpus": 1}
    assert os.readlink(prog) == str(admin.layout.program_shim(str(prog)))
    assert not (prog.parent / ".cudawrap-tmp-recon").exists()


def test_interrupted_unwrap_is_finished(admin: Admin) -> None:
    prog = admin.program("recon")
    before = snapshot(admin.bindir)
    assert admin.create(str(prog)).returncode == 0
    (e,) = registry.load(admin.layout)
    registry.update(admin.layout, lambda reg: reg.put(e.replace(phase="unwrapping")))
    tmp = prog.parent / ".cudawrap-tmp-recon"
    os.link(prog.parent / "CUDAWRAP_recon", tmp)
    os.rename(tmp, prog)  # unwrap's first step, then "killed"
    repaired = doctor(admin, "--repair")
    assert repaired.returncode == 0 and "finished an interrupted unwrap" in repaired.stdout
    assert snapshot(admin.bindir) == before
    assert len(registry.load(admin.layout)) == 0


def test_unregistered_wrap_is_adopted(admin: Admin) -> None:
    """CUDAWRAP_x exists and x is a shim link, but the registry has no entry (lost or restored)."""
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    admin.layout.registry_file.unlink()
    result = doctor(admin)
    assert result.returncode == 65
    assert any(line.startswith(f"error: {prog}: a shim link with its real program") for line in result.stdout.splitlines())
    repaired = doctor(admin, "--repair")
    assert repaired.returncode == 0 and f"registered {prog}" in repaired.stdout
    (e,) = registry.load(admin.layout)
    assert e.wrapped_by == "cudawrap doctor" and e.phase == "wrapped"
    assert doctor(admin).returncode == 0


def test_leftover_second_name_without_entry_is_removed(admin: Admin) -> None:
    prog = admin.program("recon")
    os.link(prog, admin.bindir / "CUDAWRAP_recon")
    result = doctor(admin, PATH=f"{admin.bindir}:/usr/bin:/bin")
    assert result.returncode == 0 and "left by an interrupted create" in result.stdout
    repaired = doctor(admin, "--repair", PATH=f"{admin.bindir}:/usr/bin:/bin")
    assert "removed the second name" in repaired.stdout
    assert not (admin.bindir / "CUDAWRAP_recon").exists() and prog.read_text()


def test_real_program_without_its_name_is_put_back(admin: Admin) -> None:
    real = admin.program("CUDAWRAP_recon")
    env = {"PATH": f"{admin.bindir}:/usr/bin:/bin"}
    assert doctor(admin, **env).returncode == 65
    repaired = doctor(admin, "--repair", **env)
    assert f"put it back as {admin.bindir / 'recon'}" in repaired.stdout
    assert (admin.bindir / "recon").is_file() and not real.exists()


def _lock_file_exists(admin: Admin) -> None:
    """--repair takes the registry lock, which creates its (empty) file on first use."""
    with registry.lock(admin.layout):
        pass


def test_dangling_shim_link_is_reported_not_guessed(admin: Admin) -> None:
    (admin.bindir / "orphan").symlink_to(admin.layout.shim)
    env = {"PATH": f"{admin.bindir}:/usr/bin:/bin"}
    _lock_file_exists(admin)
    before = admin.snapshot()
    repaired = doctor(admin, "--repair", **env)
    assert repaired.returncode == 65
    assert any("without a real program" in line for line in lines(repaired, "error"))
    assert admin.snapshot() == before


def test_an_alias_of_a_wrapped_program_is_not_a_stray(admin: Admin) -> None:
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    elsewhere = admin.tmp / "local-bin"
    elsewhere.mkdir()
    (elsewhere / "recon").symlink_to(prog)
    result = doctor(admin, PATH=f"{elsewhere}:/usr/bin:/bin")
    assert result.returncode == 0 and str(elsewhere) not in result.stdout


def test_corrupt_registry_is_reported_and_kept(admin: Admin) -> None:
    admin.layout.registry_file.write_text("garbage")
    _lock_file_exists(admin)
    before = admin.snapshot()
    for args in ((), ("--repair",)):
        result = doctor(admin, *args)
        assert result.returncode == 65
        (error,) = lines(result, "error")
        assert str(admin.layout.registry_file) in error and "registry.json.bak" in error
    assert admin.snapshot() == before


def test_broken_config_is_reported(admin: Admin) -> None:
    admin.layout.config_file.write_text("[policy]\nwait = \"soon\"\n")
    result = doctor(admin)
    assert result.returncode == 65
    (error,) = lines(result, "error")
    assert error.startswith(f"error: config: {admin.layout.config_file}:2: bad value for 'wait'")


def test_missing_runtime_directory_is_recreated(admin: Admin) -> None:
    import shutil

    shutil.rmtree(admin.layout.runtime_dir)
    result = doctor(admin)
    assert result.returncode == 65 and "run/cudawrap is missing" in result.stdout
    repaired = doctor(admin, "--repair")
    assert repaired.returncode == 0, repaired.stdout
    assert admin.layout.lease_dir.is_dir()


def test_missing_shim_is_reinstalled(admin: Admin) -> None:
    admin.layout.shim.unlink()
    assert doctor(admin).returncode == 65
    repaired = doctor(admin, "--repair")
    assert repaired.returncode == 0 and "reinstalled the shim" in repaired.stdout
    assert os.access(admin.layout.shim, os.X_OK)


def test_a_missing_waiter_is_a_note_and_repair_builds_it(admin: Admin) -> None:
    admin.layout.waiter.unlink(missing_ok=True)
    result = doctor(admin)
    assert result.returncode == 0, result.stdout
    assert any("cudawrap-wait is missing" in line for line in lines(result, "note"))
    repaired = doctor(admin, "--repair")
    assert any("built the waiter" in line for line in lines(repaired, "fixed")), repaired.stdout
    assert os.access(admin.layout.waiter, os.X_OK)
    assert any("runs told to wait wait in it" in line for line in lines(doctor(admin), "ok"))


def test_a_waiter_the_shim_would_not_use_is_a_warning(admin: Admin) -> None:
    admin.cli("doctor", "--repair")
    admin.layout.waiter.chmod(0o777)
    result = doctor(admin)
    assert any("not the install's own" in line for line in lines(result, "warning")), result.stdout


def test_shim_with_a_missing_interpreter(admin: Admin) -> None:
    admin.layout.shim.write_text("#!/nonexistent/python -IS\n")
    result = doctor(admin)
    assert result.returncode == 65
    assert any("interpreter '/nonexistent/python'" in line for line in lines(result, "error"))


def test_lease_files_for_every_device(admin: Admin, machine) -> None:
    fake = machine("four-gpus")
    env = fake.env
    result = doctor(admin, **env)
    assert result.returncode == 65
    (error,) = lines(result, "error")
    assert error.startswith("error: leases: no lease file for 4 device(s)")
    repaired = doctor(admin, "--repair", **env)
    assert repaired.returncode == 0, repaired.stdout
    assert sorted(os.listdir(admin.layout.lease_dir)) == sorted(fake.leaf_uuids())
    assert "ok: leases: a lease file for each of 4 device(s)" in doctor(admin, **env).stdout


@root_only
@pytest.mark.root
def test_anyone_may_check_only_admins_repair(shared_tmp: Path) -> None:
    admin = Admin(shared_tmp)
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    code, out, err = run_as(65534, 65534, ["cudawrap", "doctor"], admin.environ())
    # (The test interpreter under /root is out of nobody's reach, which doctor rightly
    # reports for the shim; the wraps are checked all the same.)
    assert code in (0, 65) and f"ok: {prog}: wrapped" in out, out + err
    code, out, err = run_as(65534, 65534, ["cudawrap", "doctor", "--repair"], admin.environ())
    assert code == 77 and out == ""


def run_plain(path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAWRAP_")}
    return subprocess.run([str(path)], capture_output=True, text=True, env=env, timeout=60).stdout


def test_a_build_copied_through_one_link_stays_with_that_program(admin: Admin) -> None:
    recon, train = admin.program("recon"), admin.program("train")
    assert admin.create(str(recon), str(train)).returncode == 0
    build = make_program(admin.tmp / "build", "recon", '#!/bin/sh\necho "recon v2 $*"\n')
    shutil.copyfile(build, recon)  # what `cp newbuild /opt/app/bin/recon` does: writes through the link
    assert run_plain(train) == "train \n"  # every other wrapped program is untouched
    result = doctor(admin)
    assert result.returncode == 65
    (error,) = lines(result, "error")
    own = admin.layout.program_shim(str(recon))
    assert error == (f"error: {recon}: the shim of {recon} ({own}) was overwritten by another file: a deploy "
                     "copied a new build through the link? It now runs without a lease")
    assert admin.cli("list").stdout.count("shim-overwritten") == 1
    repaired = doctor(admin, "--repair")
    assert repaired.returncode == 0, repaired.stdout
    (fixed,) = lines(repaired, "fixed")
    assert f"made the new build {admin.bindir / 'CUDAWRAP_recon'} and restored the shim" in fixed
    assert f"was kept as {recon}.cudawrap-saved" in fixed
    assert (admin.bindir / "CUDAWRAP_recon").read_bytes() == build.read_bytes()
    assert os.access(admin.bindir / "CUDAWRAP_recon", os.X_OK)
    assert Path(f"{recon}.cudawrap-saved").read_text() == '#!/bin/sh\necho "recon $*"\n'
    assert os.readlink(recon) == str(own) and shim_version(own) == cudawrap.__version__
    assert run_plain(recon) == "recon v2 \n" and run_plain(train) == "train \n"
    assert doctor(admin).returncode == 0


def test_links_to_the_shared_shim_get_their_own(admin: Admin) -> None:
    """Programs wrapped before each had its own shim lead to the shared one: doctor says what
    that risks, and --repair moves them over."""
    prog = admin.program("recon")
    assert admin.create(str(prog)).returncode == 0
    prog.unlink()
    prog.symlink_to(admin.layout.shim)
    admin.layout.program_shim(str(prog)).unlink()
    result = doctor(admin)
    assert result.returncode == 0  # it works: a warning, not an error
    (warning,) = lines(result, "warning")
    assert "shared before each got its own" in warning
    repaired = doctor(admin, "--repair")
    assert f"wrote its own shim {admin.layout.program_shim(str(prog))}" in repaired.stdout
    assert os.readlink(prog) == str(admin.layout.program_shim(str(prog)))
    assert run_plain(prog) == "recon \n"
    assert lines(doctor(admin), "warning") == []


@root_only
@pytest.mark.root
def test_doctor_says_the_services_state_and_fails_where_runs_need_it(mu) -> None:  # type: ignore[no-untyped-def]
    from test_service import Served

    inst = mu("four-gpus")
    found = inst.cli(None, "doctor")
    assert "ok: service: this install runs daemonless: runs decide for themselves" in found.stdout.decode()
    # Run with the service, with no service, every user's run fails: doctor says so, how to start
    # it here (no systemd on this machine, a --prefix root), and exits non-zero.
    from cudawrap.install.way import SERVICE, write_way

    write_way(inst.layout, SERVICE)
    inst.layout.config_file.write_text("[service]\nconnect_retry_s = 1\n")
    inst.layout.config_file.chmod(0o644)
    assert inst.cli(None, "sync").returncode == 0
    found = inst.cli(None, "doctor")
    (line,) = [line for line in found.stdout.decode().splitlines() if line.startswith("error: service: ")]
    assert found.returncode == 65, found.stdout
    assert line == ("error: service: this install runs with the service, its only arbiter, and it is not running: "
                    "every run of a user other than root fails after 1 s (exit 69); start it: "
                    f"CUDAWRAP_ROOT={inst.layout.root} cudawrap serve --daemon")
    served = Served(inst)
    try:
        found = inst.cli(None, "doctor")
        out = found.stdout.decode()
        assert ("ok: service: this install runs with the service, its only arbiter: answering on "
                f"{inst.layout.runtime_dir / 'cudawrap.sock'}\n") in out
        # (The fixture wraps recon by hand, without a registry entry: doctor's only error.)
        assert [line for line in out.splitlines() if line.startswith("error: ")] == [
            f"error: {served.link}: a shim link with its real program {inst.bindir / 'CUDAWRAP_recon'} but no "
            "registry entry"], out
    finally:
        served.proc.terminate()
        served.proc.wait(timeout=10)
