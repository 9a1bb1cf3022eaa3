"""[confine] in the configuration, `cudawrap config` and doctor: which mechanism would confine
runs here, or what is missing; Slurm's own confinement; what the NVIDIA driver publishes; and,
where no service runs for the install, one line saying that [confine] does nothing there."""
from pathlib import Path

import pytest

from cudawrap.base import cgroup
from cudawrap.errors import ConfigError
from cudawrap.policy.config import parse_config

from support.admin import Admin

P = Path("/etc/cudawrap/config.toml")
NOT_SERVED = "[confine] does nothing here (only the service confines)"


@pytest.mark.parametrize("text,message", [
    ('[confine]\ncgroup = "v3"\n', "2: bad value for 'cgroup': 'v3' is not one of auto, v1, v2"),
    ('[confine]\nruns = "yes"\n', "2: bad value for 'runs': "),
    ('[confine]\nnodes = "closed"\n', "2: bad value for 'nodes': 'closed' is not one of open, leased"),
    ('[confine]\nallow_users = ["dcgm", "bad name"]\n', "2: bad value for 'allow_users': 'bad name' is not an account name"),
    ('[confine]\nallow_users = "dcgm"\n', "2: bad value for 'allow_users': 'dcgm' is not a list of account names"),
    ('[confine]\nproc = "proc"\n', "2: bad value for 'proc': 'proc' is not an absolute path"),
    ('[confine]\ndev = "dev"\n', "2: bad value for 'dev': 'dev' is not an absolute path"),
], ids=["cgroup", "runs", "nodes", "allow-users-name", "allow-users-list", "proc-relative", "dev-relative"])
def test_confine_values_are_checked(text, message):
    with pytest.raises(ConfigError) as info:
        parse_config(P, text)
    assert info.value.message.startswith(f"{P}:{message}")


def test_confine_values_parse():
    got = parse_config(P, '[confine]\nruns = true\ncgroup = "v1"\nallow_users = ["nvidia-persistenced"]\n'
                          'proc = "/srv/proc"\n')
    assert (got["runs"], got["cgroup"], got["allow_users"], got["proc"]) == (True, "v1", ("nvidia-persistenced",),
                                                                              "/srv/proc")


def configure(admin: Admin, text: str) -> None:
    admin.layout.config_file.write_text(text)


def confine_lines(result):
    return [line for line in result.stdout.splitlines() if ": confine: " in line]


def test_config_says_confine_does_nothing_without_the_service_only_when_set(admin: Admin) -> None:
    assert NOT_SERVED not in admin.cli("config").stdout
    configure(admin, "[confine]\nruns = true\n")
    result = admin.cli("config")
    assert result.returncode == 0, result.stderr
    assert f"# note: confine: no `cudawrap serve` runs for this install: {NOT_SERVED}" in result.stdout.splitlines()
    assert "allow_users" in result.stdout and "[] (all devices)" not in [
        line.split()[1:] for line in result.stdout.splitlines() if line.startswith("allow_users")][0]


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_doctor_names_the_mechanism_and_how_leftovers_end(admin: Admin, kind: str) -> None:
    configure(admin, f'[confine]\nruns = true\ncgroup = "{kind}"\n')
    result = admin.cli("doctor")
    lines = confine_lines(result)
    assert f"note: confine: no `cudawrap serve` runs for this install: {NOT_SERVED}" in lines
    ok = [line for line in lines if line.startswith("ok: confine: runs = true: the service confines runs by")]
    assert len(ok) == 1, lines
    if cgroup.kernel() >= (6, 0) and not cgroup.favors_dynmods():  # this CI machine: 6.18, without it
        assert any(line.startswith("note: confine: moving a run into its cgroup can wait for an RCU grace period")
                   and f"mount -o remount,favordynmods {cgroup.mounts()['unified']}" in line
                   and "cgroup_favordynmods=true" in line for line in lines), lines
    mounts = cgroup.mounts()
    if kind == "v2":
        assert f"cgroup v2 at {mounts['unified']}, a BPF device program" in ok[0]
        assert ok[0].endswith("cgroup.kill" if cgroup.kernel() >= cgroup.KILL_KERNEL else "5.14)")
    else:
        assert f"v1 devices controller at {mounts['devices']}" in ok[0]
        assert f"the v1 freezer at {mounts['freezer']}" in ok[0]


def test_doctor_refuses_runs_where_the_mechanism_is_missing(admin: Admin, tmp_path: Path) -> None:
    """No cgroup v1 freezer mounted where this doctor looks: runs = true cannot hold, an error;
    runs = false, a note. (The mounts are the doctor's own view: run in a mount namespace
    without /sys/fs/cgroup/freezer.)"""
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed")
    configure(admin, '[confine]\nruns = true\ncgroup = "v1"\n')
    argv = ["unshare", "-m", "--propagation", "private", "sh", "-c",
            'umount -l /sys/fs/cgroup/freezer && exec "$@"', "sh", *admin.argv("doctor")]
    result = subprocess.run(argv, env=admin.environ(), capture_output=True, text=True, timeout=120)
    assert ('error: confine: cgroup = "v1": runs cannot be confined here: no cgroup v1 freezer controller '
            "is mounted") in confine_lines(result), result.stdout + result.stderr
    assert result.returncode != 0


def fake_proc(tmp_path: Path, params: str = "", caps_major: bool = True) -> Path:
    proc = tmp_path / "proc"
    (proc / "driver/nvidia-caps").mkdir(parents=True)
    (proc / "devices").write_text("Character devices:\n195 nvidia\n" + ("236 nvidia-caps\n" if caps_major else "")
                                  + "\nBlock devices:\n")
    (proc / "driver/nvidia-caps/mig-minors").write_text("config 1\nmonitor 2\ngpu0/gi1/access 3\n")
    if params:
        (proc / "driver/nvidia").mkdir()
        (proc / "driver/nvidia/params").write_text(params)
    return proc


def test_doctor_reads_the_drivers_node_parameters_and_says_when_mig_cannot_be_confined(admin: Admin, tmp_path):
    proc = fake_proc(tmp_path, "ResmanDebugLevel: 4294967295\nDeviceFileUID: 0\nDeviceFileGID: 0\n"
                               "DeviceFileMode: 438\nModifyDeviceFiles: 1\n", caps_major=False)
    configure(admin, f'[confine]\nproc = "{proc}"\n')
    lines = confine_lines(admin.cli("doctor"))
    assert ("ok: confine: the driver makes its nodes with DeviceFileUID=0, DeviceFileGID=0, DeviceFileMode=438, "
            "ModifyDeviceFiles=1") in lines
    assert any(line.startswith("warning: confine: MIG capabilities are exposed through /proc") and
               "nv_cap_enable_devfs=1" in line for line in lines), lines
    proc2 = fake_proc(tmp_path / "devfs", "DeviceFileMode: 438\n")
    configure(admin, f'[confine]\nproc = "{proc2}"\n')
    assert not any("MIG capabilities" in line for line in confine_lines(admin.cli("doctor")))


def test_doctor_without_a_driver_says_its_parameters_were_not_checked(admin: Admin, tmp_path):
    configure(admin, f'[confine]\nproc = "{tmp_path}"\n')
    assert (f"note: confine: no NVIDIA driver loaded (no {tmp_path}/driver/nvidia/params): its node parameters "
            "not checked") in confine_lines(admin.cli("doctor"))


@pytest.mark.parametrize("setting,level", [("ConstrainDevices=yes", "ok"), ("ConstrainDevices=no", "warning"),
                                           ("ConstrainCores=yes", "warning")])
def test_doctor_says_whether_slurm_confines_its_jobs(admin: Admin, tmp_path: Path, setting: str, level: str):
    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm/cgroup.conf").write_text(f"# cgroup.conf\nConstrainRAMSpace=yes\n{setting}\n")
    lines = confine_lines(admin.cli("doctor", SLURM_CONF=str(tmp_path / "slurm/slurm.conf")))
    slurm = [line for line in lines if "Slurm" in line]
    assert len(slurm) == 1 and slurm[0].startswith(f"{level}: confine: Slurm's ConstrainDevices"), lines


def test_favordynmods_is_read_from_the_cgroup_mounts_super_options(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text("30 25 0:26 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw\n"
                    "31 25 0:27 / /mnt rw - tmpfs tmpfs rw,favordynmods\n")
    assert cgroup.favors_dynmods(str(info)) is False
    info.write_text("30 25 0:26 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw,favordynmods\n")
    assert cgroup.favors_dynmods(str(info)) is True


def test_the_favordynmods_hint_remounts_cgroup2_and_names_the_boot_parameter(tmp_path):
    # The v1 hierarchies refuse the option at a remount: the cgroup2 mount takes it (the kernel's
    # flag holds for all), and only where there is one; the boot parameter keeps it in any case.
    from cudawrap.admin.confinecheck import favor_dynmods_hint

    info = tmp_path / "mountinfo"
    info.write_text("30 25 0:26 / /sys/fs/cgroup/unified rw shared:9 - cgroup2 cgroup2 rw\n"
                    "31 25 0:27 / /sys/fs/cgroup/devices rw shared:10 - cgroup cgroup rw,devices\n")
    hint = favor_dynmods_hint(str(info))
    assert hint.startswith("`mount -o remount,favordynmods /sys/fs/cgroup/unified` now"), hint
    assert "cgroup_favordynmods=true" in hint
    info.write_text("31 25 0:27 / /sys/fs/cgroup/devices rw shared:10 - cgroup cgroup rw,devices\n")
    hint = favor_dynmods_hint(str(info))
    assert "remount" not in hint and hint.startswith("cgroup_favordynmods=true"), hint


def test_kernel_versions_read_as_numbers():
    assert cgroup.kernel("6.18.44-fc-v595") == (6, 18)
    assert cgroup.kernel("5.4.0-150-generic") == (5, 4)
    assert cgroup.kernel("4.15rc1") == (4, 15)
    assert cgroup.kernel("weird") == (0, 0)


@pytest.mark.parametrize("can", [True, False], ids=["confinable", "not-confinable"])
def test_an_install_that_starts_the_service_sets_runs_where_the_host_can_confine(tmp_path, monkeypatch, can):
    import sys

    from cudawrap.install import installation
    from cudawrap.paths import Layout
    from cudawrap.policy.config import load_config

    assert cgroup.confinable() is True  # this host (CI) can: the v1 devices controller
    layout = Layout(tmp_path / "root")
    layout.venv_dir.mkdir(parents=True)
    monkeypatch.setattr(installation, "systemd_running", lambda _layout: True)
    monkeypatch.setattr(installation, "systemctl", lambda *args: None)
    if not can:
        monkeypatch.setattr(cgroup, "confinable", lambda setting="auto": False)
    said: list = []
    installation.install(layout, sys.executable, None, [], say=said.append, man_pages={}, refresh=lambda _: (),
                         way="service")
    config = load_config(layout.config_file)
    assert config["runs"] is can and config["nodes"] == "open"
    assert any("[confine] runs = true" in line for line in said) is can


def test_doctor_under_leased_names_the_modprobe_line_or_warns_without_a_driver(admin: Admin, tmp_path):
    """nodes = "leased": driver parameters that let nvidia-modprobe reopen the nodes are an
    error naming the line to add; no driver loaded, a warning (the service proceeds)."""
    proc = fake_proc(tmp_path, "DeviceFileUID: 0\nDeviceFileGID: 0\nDeviceFileMode: 438\nModifyDeviceFiles: 1\n")
    configure(admin, f'[confine]\nnodes = "leased"\nproc = "{proc}"\n')
    lines = confine_lines(admin.cli("doctor"))
    assert any(line.startswith('error: confine: nodes = "leased", but the NVIDIA driver makes its nodes with '
                               "DeviceFileMode=438") and "options nvidia NVreg_DeviceFileMode=0660 "
               "NVreg_DeviceFileUID=0 NVreg_DeviceFileGID=0" in line for line in lines), lines
    assert any(line.startswith('note: confine: nodes = "leased": GPU nodes are root:root 0660') and
               "while it is down, no user opens a GPU (root excepted)" in line for line in lines), lines
    configure(admin, f'[confine]\nnodes = "leased"\nproc = "{tmp_path / "none"}"\n')
    assert any(line.startswith("warning: confine: no NVIDIA driver loaded") and 'nodes = "leased"' in line
               for line in confine_lines(admin.cli("doctor")))
