"""`cudawrap status`, `run`, `sync` and the Python API."""
import json
import os
import subprocess
import sys

from support.installed import ready_line


def test_status_shows_holder_and_foreign_processes(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    holder = inst.start("recon", "--hold", "30", CUDA_VISIBLE_DEVICES=gpus[0])
    ready_line(holder)
    inst.machine.add_process(4242, gpus[2], 1024)
    r = inst.cli("status", "--json")
    assert r.returncode == 0, r.stderr
    status = {d["uuid"]: d for d in json.loads(r.stdout)["devices"]}
    assert status[gpus[0]]["holder"]["pid"] == holder.pid
    assert "CUDAWRAP_recon" in status[gpus[0]]["holder"]["command"]
    assert status[gpus[1]]["holder"] is None
    assert status[gpus[2]]["foreign_pids"] == [4242]
    table = inst.cli("status")
    assert table.returncode == 0
    assert f"pid {holder.pid}" in table.stdout.decode()
    holder.kill()


HANDOVER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)   # the kernel records this pid as the lock's taker
child = os.fork()
if child == 0:
    time.sleep(60)               # holds the lease through the inherited descriptor
    os._exit(0)
os.close(fd)                     # this process holds nothing any more, and lives on
print(child, flush=True)
sys.stdin.read()
os.kill(child, 9)
"""


def test_status_names_the_process_that_holds_the_lock_now(installed):
    inst = installed("four-gpus")
    gpus = inst.machine.leaf_uuids()
    taker = subprocess.Popen([sys.executable, "-c", HANDOVER, str(inst.layout.lease_dir / gpus[1])],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        child = int(taker.stdout.readline())
        status = {d["uuid"]: d for d in json.loads(inst.cli("status", "--json").stdout)["devices"]}
        assert status[gpus[1]]["holder"]["pid"] == child  # not the innocent taker
        assert status[gpus[0]]["holder"] is None
    finally:
        taker.stdin.close()
        taker.wait(timeout=10)


def test_status_lists_waiters_in_order(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    first = inst.machine.leaf_uuids()[0]
    inst.write_config(f'[devices]\nallow = ["{first}"]\n')
    holder = inst.start("recon", "--hold", "30")
    ready_line(holder)
    waiters = []
    for _ in range(2):
        waiters.append(inst.start("recon"))
        assert b"waiting" in waiters[-1].stderr.readline()  # queued before the next starts
    waiting = json.loads(inst.cli("status", "--json").stdout)["waiting"]
    assert [w["pid"] for w in waiting] == [p.pid for p in waiters]
    for p in [holder] + waiters:
        p.kill()


def test_run_any_command_on_a_free_device(installed):
    inst = installed("four-gpus")
    from support.machine import FAKECUDA

    r = inst.cli("run", "-n", "2", "--", sys.executable, str(FAKECUDA), "--exit", "3")
    assert r.returncode == 3
    out = json.loads(r.stdout.splitlines()[0])
    assert len(out["devices"]) == 2 and out["cvd"] == ",".join(out["devices"])


def test_run_bad_input_is_one_line(installed):
    inst = installed("four-gpus")
    for args, code, text in [
        (["run"], 64, "no command given"),
        (["run", "--", "no-such-program-here"], 127, "command not found"),
        (["run", "-n", "zero", "--", "true"], 64, "--gpus zero"),
        (["run", "--wait", "-3", "--", "true"], 64, "--wait -3"),
        (["run", "--bogus", "--", "true"], 64, "bogus"),
    ]:
        r = inst.cli(*args)
        assert r.returncode == code, (args, r.stderr)
        lines = r.stderr.decode().splitlines()
        assert text in lines[0] and len(lines) <= 2, (args, lines)
        assert r.stdout == b""


def test_sync_creates_runtime_area_and_lease_files(installed):
    inst = installed("a100-mig7")
    import shutil

    shutil.rmtree(inst.layout.runtime_dir)
    r = inst.cli("sync")
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(inst.layout.lease_dir)) == sorted(inst.machine.leaf_uuids())
    assert os.stat(inst.layout.queue_dir).st_mode & 0o7777 == 0o1777
    assert inst.layout.launch_cache.exists()


def test_python_api_acquires_for_the_life_of_the_process(installed):
    inst = installed("a100-mig7")
    first = inst.machine.leaf_uuids()[0]
    inst.write_config(f'[devices]\nallow = ["{first}"]\n')
    code = ("import cudawrap, os, sys; got = cudawrap.acquire(); "
            "print(got, os.environ['CUDA_VISIBLE_DEVICES']); sys.stdout.flush(); sys.stdin.read()")
    proc = inst.spawned([sys.executable, "-c", code], env=inst.environ(), stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline().decode()
    assert line.strip() == f"['{first}'] {first}"
    inst.wrap("recon")
    assert inst.run("recon", CUDAWRAP_WAIT="0").returncode == 75  # held by the script
    proc.stdin.close()
    assert proc.wait(timeout=10) == 0
    assert inst.run("recon", CUDAWRAP_WAIT="0").returncode == 0
