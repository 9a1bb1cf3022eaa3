"""The monitor's metrics file never goes where a user can make it first (real accounts).

node_exporter's textfile directory is the admin's choice; if a user may write it, a file
the user made there (the temporary name, the metrics file itself) must never become what
root writes into. A sticky directory of root's (like /tmp) is fine: nobody can replace
what root makes there.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.procs import cli_code, root_only
from support.users import MuInstall

pytestmark = [pytest.mark.root, root_only]

PLANT = r"""
import os, sys
for path in sys.argv[1:]:
    with open(path, "w") as f:
        f.write("alice was here\n")
    os.chmod(path, 0o666)
"""


def textfile(inst: MuInstall, mode: int) -> Path:
    directory = inst.dir / "textfile"
    directory.mkdir()
    directory.chmod(mode)
    path = directory / "cudawrap.prom"
    inst.layout.config_file.write_text(f'[metrics]\ntextfile = "{path}"\n')
    inst.layout.config_file.chmod(0o644)
    return path


def test_files_a_user_made_in_a_sticky_directory_are_never_written_into(mu) -> None:  # type: ignore[no-untyped-def]
    """alice makes the monitor's temporary file (its old name: the pid is known) and the
    metrics file itself in a sticky directory of root's. The monitor's cycle leaves her
    temporary file as it was and replaces the metrics file with one of root's."""
    from cudawrap.monitor.metrics import MonitorHook

    inst = mu("four-gpus")
    path = textfile(inst, 0o1777)
    planted = path.parent / f".{path.name}.{os.getpid()}.tmp"
    done = inst.py(inst.world.alice, PLANT, str(planted), str(path))
    assert done.returncode == 0, done.stderr
    MonitorHook(inst.layout).cycle()
    assert planted.read_text() == "alice was here\n" and planted.stat().st_uid == inst.world.alice.uid
    st = path.stat()
    assert st.st_uid == 0 and st.st_mode & 0o777 == 0o644 and "cudawrap_device_held" in path.read_text()
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, planted.name])


def test_a_directory_others_may_write_is_refused_and_doctor_says_so(mu) -> None:  # type: ignore[no-untyped-def]
    """In a directory anyone may write (not sticky), a user could have made the file root
    writes into: the monitor refuses to start (one line, exit 78), a running one writes
    nothing there, and doctor reports it."""
    from cudawrap.monitor.metrics import MonitorHook

    inst = mu("four-gpus")
    path = textfile(inst, 0o777)
    started = inst.run(None, inst.world.python, "-I", "-c",
                       cli_code(inst.path), "monitor", timeout=30)
    lines = started.stderr.decode().splitlines()
    assert started.returncode == 78, lines
    assert lines[0].startswith(f"cudawrap: [metrics] textfile {path}: its directory is not root's alone: ") and \
        "writable by its group and others" in lines[0], lines
    assert len(lines) == 2 and lines[1].startswith("hint: "), lines
    hook = MonitorHook(inst.layout)
    hook.cycle()
    assert list(path.parent.iterdir()) == []
    assert hook.last_error is not None and "not writing the metrics file" in hook.last_error
    report = inst.cli(None, "doctor").stdout.decode()
    findings = [line for line in report.splitlines() if line.startswith(("error: metrics:", "ok: metrics:"))]
    assert len(findings) == 1 and findings[0].startswith(f"error: metrics: [metrics] textfile {path}: "), report
    assert "the monitor refuses to write it" in findings[0]


READ = r"""
import sys
try:
    print("cudawrap_device_held" in open(sys.argv[1]).read())
except PermissionError:
    print("EACCES")
"""


def test_under_private_status_only_the_directorys_group_reads_the_metrics_file(mu) -> None:  # type: ignore[no-untyped-def]
    """The file names users, pids and programs: with [service] private_status it is root's
    and the group's of its directory (node_exporter's), mode 0640; alice stands in for the
    collector's group here, and bob, another user, reads nothing. Without it, everyone reads."""
    from cudawrap.monitor.metrics import MonitorHook

    inst = mu("four-gpus")
    path = textfile(inst, 0o755)
    os.chown(path.parent, 0, inst.world.alice.gid)
    config = inst.layout.config_file.read_text()
    inst.write_config(config + "[service]\nprivate_status = true\n")
    MonitorHook(inst.layout).cycle()
    st = path.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (0, inst.world.alice.gid, 0o640)
    assert [inst.py(u, READ, str(path)).stdout.decode().strip() for u in (inst.world.alice, inst.world.bob)] \
        == ["True", "EACCES"]
    inst.write_config(config)
    MonitorHook(inst.layout).cycle()
    assert path.stat().st_mode & 0o777 == 0o644
    assert inst.py(inst.world.bob, READ, str(path)).stdout.decode().strip() == "True"
