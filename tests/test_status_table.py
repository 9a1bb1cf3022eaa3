"""`cudawrap status` as a table: 80 columns, the holder's program by name, the install root."""
import json
import subprocess
import sys

import pytest

from support.installed import ready_line
from support.procs import wait_for
from support.machine import FAKECUDA
from cudawrap.ops.status import program_name, render


@pytest.mark.parametrize("argv, name", [
    (["/opt/app/bin/CUDAWRAP_recon", "in.dat"], "recon"),
    (["/usr/bin/python3.11", "-IS", "/opt/app/bin/CUDAWRAP_recon", "--hold", "5"], "recon"),
    (["/home/ann/.conda/envs/t/bin/python", "-u", "train.py", "--lr", "3"], "train.py"),
    (["python3", "-m", "torch.distributed.run"], "torch.distributed.run"),
    (["/bin/sh", "-e", "/opt/run.sh"], "run.sh"),
    (["/usr/local/bin/blender", "-b", "scene.blend"], "blender"),
    ([""], "?"),
], ids=["wrapped-binary", "wrapped-script", "python-script", "python-module", "shell-script", "binary", "empty"])
def test_program_name(argv, name):
    assert program_name(argv) == name


def _device(n: int, holder=None) -> dict:
    return {"uuid": f"MIG-{n:08x}-1234-5678-9abc-def012345678", "name": "NVIDIA A100-SXM4-80GB MIG 1g.10gb",
            "gpu_index": 7, "parent": "GPU-x", "mig_slot": n, "memory_used_mib": 81000,
            "memory_total_mib": 81920, "lease_file": True, "holder": holder, "foreign_pids": [4194301, 4194302]}


def test_default_table_fits_80_columns():
    holder = {"pid": 4194303, "user": "annabelle", "command": "/root/.pyenv/versions/3.11.7/bin/python3.11 -u "
              "/home/annabelle/projects/segmentation/train_segmentation.py", "program": "train_segmentation.py",
              "since": "2026-01-02T03:04:05"}
    status = {"root": "/", "devices": [_device(n, holder if n % 2 else None) for n in range(7)],
              "waiting": [{"user": "bob", "pid": 4194300, "count": 2, "program": "recon", "position": 1,
                           "reason": "1 usable device free, 1 more needed; position 1 in line"}],
              "queue_lock_holder": None, "nvml_error": None}
    lines = render(status)
    assert lines[0] == "install root /: 7 devices, 3 leased, 1 waiting"
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    assert any("pid 4194303 annabel~ train_seg~" in line for line in lines), lines  # not the interpreter
    assert not any("pyenv" in line for line in lines)


def test_holder_is_shown_by_program_name(installed):
    inst = installed("four-gpus")
    recon = inst.wrap("recon")
    holder = inst.start(str(recon), "--hold", "30")
    try:
        ready_line(holder)
        r = inst.cli("status")
        assert r.returncode == 0, r.stderr
        lines = r.stdout.decode().splitlines()
        assert lines[0] == f"install root {inst.layout.root}: 4 devices, 1 leased, 0 waiting (runs daemonless)"
        assert any(f"pid {holder.pid} " in line and line.split()[6:7] == ["recon"] for line in lines), lines
        assert all(len(line) <= 80 for line in lines[1:]), lines  # the first names a long tmp_path
    finally:
        holder.kill()
        holder.wait()


# Wrapped programs that exec another program to do the work, as launchers do: the process
# that holds the lease is then `python3 …/fakecuda.py`, with no trace of recon in its argv.
LAUNCHERS = {
    "sh-script": '#!/bin/sh\nexec "{python}" -u "{fakecuda}" "$@"\n',
    "python-script": '#!{python}\nimport os, sys\n'
                     'os.execv(sys.executable, [sys.executable, "-u", "{fakecuda}"] + sys.argv[1:])\n',
}


@pytest.mark.parametrize("kind", list(LAUNCHERS))
def test_a_wrapped_script_is_known_by_its_wrapped_name_everywhere(installed, tmp_path, kind):
    inst = installed("four-gpus")
    launcher = tmp_path / kind
    launcher.write_text(LAUNCHERS[kind].format(python=sys.executable, fakecuda=FAKECUDA))
    recon = inst.wrap("recon", launcher)
    holder = inst.start(str(recon), "--hold", "60")
    try:
        ready_line(holder)
        lines = inst.cli("status").stdout.decode().splitlines()
        assert any(f"pid {holder.pid} " in line and line.split()[6:7] == ["recon"] for line in lines), lines
        held = [d["holder"] for d in json.loads(inst.cli("status", "--json").stdout)["devices"] if d["holder"]]
        assert [(h["pid"], h["program"]) for h in held] == [(holder.pid, "recon")]
        assert inst.cli("monitor", "--once").returncode == 0  # the ledger sees the grant
    finally:
        holder.kill()
        holder.wait()
    assert inst.cli("monitor", "--once").returncode == 0  # and the end
    done = inst.cli("usage", "--by", "program", "--since", "1h", "--json")
    assert done.returncode == 0, done.stderr
    assert [r["program"] for r in json.loads(done.stdout)] == ["recon"]


def test_a_drained_device_says_so_in_the_lease_column_with_its_reason(installed):
    inst = installed("four-gpus")
    recon = inst.wrap("recon")
    holder = inst.start(str(recon), "--hold", "60")
    try:
        held = ready_line(holder)["devices"][0]
        uuids = [d["uuid"] for d in json.loads(inst.cli("status", "--json").stdout)["devices"]]
        free = next(u for u in uuids if u != held)
        for uuid in (held, free):
            assert inst.cli("drain", uuid, "--reason", "fan swap").returncode == 0
        lines = inst.cli("status").stdout.decode().splitlines()
        row = {line.split()[1]: line for line in lines[2:] if line[:1].isdigit()}
        assert "drained: fan swap" in row[free[:12]] and " free" not in row[free[:12]], lines
        assert f"pid {holder.pid} " in row[held[:12]] and "; drained" in row[held[:12]], lines
    finally:
        holder.kill()
        holder.wait()


def test_long_cells_are_cut_for_a_terminal_only():
    reason = "1 usable device free, 1 more needed; position 1 in line, behind 3 runs of bob"
    status = {"root": "/", "devices": [], "queue_lock_holder": None, "nvml_error": None,
              "waiting": [{"user": "annabelle", "pid": 4194300, "count": 2, "program": "train_segmentation.py",
                           "position": 1, "reason": reason}]}
    assert not any(reason in line for line in render(status))  # a terminal: 80 columns
    piped = render(status, cut=False)
    assert any(line.endswith(reason) and "annabelle" in line and "train_segmentation.py" in line
               for line in piped), piped
    assert not any("~" in line for line in piped)


def test_status_piped_prints_whole_cells(installed):
    inst = installed("four-gpus")
    recon = inst.wrap("recon")
    holders = [inst.start(str(recon), "--hold", "60") for _ in range(4)]
    waiter = None
    try:
        for holder in holders:
            ready_line(holder)
        waiter = inst.start(str(recon))
        wait_for(lambda: json.loads(inst.cli("status", "--json").stdout)["waiting"])
        reason = json.loads(inst.cli("status", "--json").stdout)["waiting"][0]["reason"]
        assert len(reason) > 38  # wider than the WHY column on a terminal
        lines = inst.cli("status").stdout.decode().splitlines()  # a pipe, not a terminal
        assert any(line.endswith(reason) for line in lines), lines
    finally:
        for proc in holders + ([waiter] if waiter else []):
            proc.kill()
            proc.wait()


@pytest.mark.root
def test_what_an_ordinary_user_sees_as_the_docs_say(mu):
    """docs/reference/status.md: your own runs in full, other users' holders hidden, every waiter and drain."""
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    theirs = [inst.start(alice, "recon", "--hold", "60") for _ in range(3)]
    got = [ready_line(p)["devices"][0] for p in theirs]
    mine = inst.start(bob, "recon", "--hold", "60")
    my_device = ready_line(mine)["devices"][0]
    waiter = inst.start(alice, "recon")
    wait_for(lambda: json.loads(inst.cli(None, "status", "--json").stdout)["waiting"])
    assert inst.cli(None, "drain", got[0], "--reason", "fan swap").returncode == 0
    done = inst.cli(bob, "status")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.decode().splitlines()
    rows = {line.split()[1]: line for line in lines[2:6]}
    assert f"pid {mine.pid} {bob.name} recon" in rows[my_device[:12]], lines
    for uuid in got:
        assert "held (holder not visible to you)" in rows[uuid[:12]] and rows[uuid[:12]].endswith("unknown"), lines
        assert str(theirs[got.index(uuid)].pid) not in rows[uuid[:12]]
    assert "held (holder not visible to you); drained" in rows[got[0][:12]], lines
    assert any(line.startswith(got[0][:16]) and line.endswith("fan swap") for line in lines), lines
    assert any(line.split()[1:4] == [alice.name, str(waiter.pid), "1"] for line in lines[7:]), lines
    # Root sees every holder.
    root_lines = inst.cli(None, "status").stdout.decode()
    assert all(f"pid {p.pid} {alice.name} recon" in root_lines for p in theirs), root_lines
    from pathlib import Path

    page = " ".join((Path(__file__).parent.parent / "docs" / "reference" / "status.md").read_text().split())
    assert "another user's run shows as `held (holder not visible to you)`" in page


def test_status_on_a_broken_config_says_what_is_wrong_and_exits_78(installed):
    # Every run exits 78 on this config: status must not look healthy.
    inst = installed("four-gpus")
    recon = inst.wrap("recon")
    inst.write_config("[policy]\ngpus = \n")
    run = inst.run(str(recon))
    assert run.returncode == 78, run.stderr
    for argv in (["status"], ["status", "--json"]):
        r = inst.cli(*argv)
        err = r.stderr.decode().splitlines()
        assert r.returncode == 78, (argv, r.stderr)
        assert err[0].startswith(f"cudawrap: {inst.layout.config_file}"), err
        assert len(err) <= 2 and "Traceback" not in r.stderr.decode(), err


def test_status_where_no_install_is_says_so_and_exits_non_zero(installed, tmp_path):
    inst = installed("four-gpus")
    nowhere = tmp_path / "no-install"
    for root, command in ((nowhere, "status"), (tmp_path, "status"), (tmp_path, "why")):
        # A root that does not exist, one that is no install; why reads the same status.
        env = dict(inst.environ(), CUDAWRAP_ROOT=str(root))
        r = subprocess.run(inst._cli_argv([command], "cudawrap"), env=env, capture_output=True, timeout=60)
        err = r.stderr.decode().splitlines()
        assert r.returncode == 72, r
        assert r.stdout == b"" and b"no lease file" not in r.stderr, r
        assert err[0] == f"cudawrap: no cudawrap install at {root}", err
        assert err[1].startswith("hint: CUDAWRAP_ROOT names the install root"), err


@pytest.mark.root
def test_root_sees_whose_a_process_holding_no_lease_is_and_its_command(mu):
    # bob runs the real program by hand: on GPU 0 without a lease (a process cudawrap did not start).
    inst = mu("four-gpus")
    bob = inst.world.bob
    inst.wrap("recon")
    gpu = inst.machine.leaf_uuids()[0]
    real = inst.bindir / "CUDAWRAP_recon"
    by_hand = inst.start(bob, str(real), "--hold", "60", CUDA_VISIBLE_DEVICES=gpu)
    ready_line(by_hand)
    try:
        done = inst.cli(None, "status")
        assert done.returncode == 0, done.stderr
        lines = done.stdout.decode().splitlines()
        row = next(line for line in lines if line.split()[1:2] == [gpu[:12]])
        assert row.split()[-1] == str(by_hand.pid), lines  # OTHERS: the pid
        assert f"{gpu}: pid {by_hand.pid} of {bob.name} holds no lease here: " in "\n".join(lines), lines
        (line,) = [line for line in lines if line.startswith(f"{gpu}: pid {by_hand.pid}")]
        assert line.endswith(f"{real} --hold 60"), line
        # The same in --json, for a script (and for private_status to withhold).
        (device,) = [d for d in inst.status(None)["devices"] if d["uuid"] == gpu]
        assert device["foreign_pids"] == [by_hand.pid]
        (proc,) = [p for p in device["processes"] if p["pid"] == by_hand.pid]
        assert proc["user"] == bob.name and proc["command"].endswith(f"{real} --hold 60")
    finally:
        by_hand.kill()
        by_hand.wait()
