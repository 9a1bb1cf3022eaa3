"""Free, leased, fair: the guarantees cudawrap makes about who gets which device."""
import fcntl
import json
import os
import signal
import subprocess
import time

from support.installed import intervals, overlaps


def test_burst_of_launches_never_shares_a_device(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    procs = [inst.start("recon", "--hold", "0.3", "--log", str(inst.log)) for _ in range(56)]
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0] * len(procs), [p.stderr.read() for p in procs if p.returncode]
    jobs = inst.jobs()
    assert len(jobs) == 2 * len(procs)
    assert overlaps(jobs) == []
    assert len(intervals(jobs)) == 7  # and every instance was used


def test_several_devices_per_run_all_or_nothing_without_deadlock(installed):
    inst = installed("four-gpus")
    inst.write_config('[policy]\ngpus = 2\n')
    inst.wrap("recon")
    procs = [inst.start("recon", "--hold", "0.2", "--log", str(inst.log)) for _ in range(16)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 16
    jobs = inst.jobs()
    assert all(len(j["devices"]) == 2 for j in jobs)
    assert overlaps(jobs) == []


def test_partial_availability_takes_nothing(both):
    way = both("four-gpus")
    inst = way.inst
    gpus = inst.machine.leaf_uuids()
    holders = [inst.hold(CUDA_VISIBLE_DEVICES=u)[0] for u in gpus[:3]]
    inst.write_config('[policy]\ngpus = 2\n')
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 75
    assert r.stderr.decode().startswith("recon: no free device"), r.stderr
    # The one free GPU was not kept by the failed request: a run may have it at once.
    inst.write_config("")
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["devices"] == [gpus[3]]
    for p in holders:
        p.kill()


def test_waiters_are_served_first_come_first_served(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    first = inst.machine.leaf_uuids()[0]
    inst.allow(first)
    holder, _ = inst.hold(30)
    waiters = []
    for n in range(5):
        proc = inst.start("recon", "--hold", "0.1", "--log", str(inst.log))
        line = proc.stderr.readline().decode()  # said once, before it sleeps
        assert "waiting" in line and f"position {n + 1} in line" in line, line
        waiters.append(proc)
    holder.send_signal(signal.SIGTERM)
    holder.wait(timeout=10)
    for proc in waiters:
        assert proc.wait(timeout=30) == 0
    started = [j["pid"] for j in inst.jobs() if j["event"] == "start"][1:]
    assert started == [p.pid for p in waiters]


def test_kill_9_releases_the_lease(both):
    way = both("a100-mig7")
    inst = way.inst
    inst.allow(inst.machine.leaf_uuids()[0])
    holder, _ = inst.hold()
    assert inst.run("recon", CUDAWRAP_WAIT="0").returncode == 75
    waiter = inst.start("recon", "--log", str(inst.log), CUDAWRAP_WAIT="20")
    assert b"waiting" in waiter.stderr.readline()
    holder.kill()
    holder.wait()
    assert waiter.wait(timeout=10) == 0


def test_lease_lives_while_a_child_that_inherited_it_runs(installed, tmp_path):
    inst = installed("a100-mig7")
    prog = tmp_path / "forker"
    # The program starts a background child that keeps running after the parent exits.
    prog.write_text("#!/bin/sh\nsleep 2 >/dev/null 2>&1 &\necho started\n")
    prog.chmod(0o755)
    inst.wrap("forker", prog)
    inst.wrap("recon")
    inst.allow(inst.machine.leaf_uuids()[0])
    t0 = time.monotonic()
    assert inst.run("forker").returncode == 0
    assert inst.run("recon", CUDAWRAP_WAIT="0").returncode == 75  # the child still holds it
    r = inst.run("recon", CUDAWRAP_WAIT="10")
    assert r.returncode == 0
    assert time.monotonic() - t0 >= 1.5


def test_wait_limit_ends_with_75_and_one_line(both):
    way = both("a100-mig7")
    inst = way.inst
    inst.allow(inst.machine.leaf_uuids()[0])
    holder, _ = inst.hold()
    t0 = time.monotonic()
    r = inst.run("recon", CUDAWRAP_WAIT="0.5")
    took = time.monotonic() - t0
    assert r.returncode == 75
    lines = r.stderr.decode().splitlines()
    assert "waiting" in lines[0]
    assert lines[1] == "recon: no device within 0.5 s: every device it may use is busy; position 1 in line"
    assert took >= 0.5  # how soon after its limit it gives up is a figure for bench/, not a test
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 75
    assert r.stderr.decode().splitlines()[0].startswith("recon: no free device")
    holder.kill()


def test_per_program_wait_from_config(both):
    way = both("a100-mig7")
    inst = way.inst
    first = inst.machine.leaf_uuids()[0]
    inst.write_config(f'[devices]\nallow = ["{first}"]\n[programs.recon]\nwait = 0\n')
    holder, _ = inst.hold()
    r = inst.run("recon")
    assert r.returncode == 75
    holder.kill()


def test_bad_wait_value_is_a_usage_error(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    r = inst.run("recon", CUDAWRAP_WAIT="soon")
    assert r.returncode == os.EX_USAGE
    assert r.stderr.decode().startswith("recon: CUDAWRAP_WAIT='soon': ")


def test_ctrl_c_while_waiting_exits_130_and_leaves_nothing(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    inst.allow(inst.machine.leaf_uuids()[0])
    holder, _ = inst.hold()
    waiter = inst.start("recon")
    assert b"waiting" in waiter.stderr.readline()
    assert len(os.listdir(inst.layout.queue_dir)) == 1
    waiter.send_signal(signal.SIGINT)
    assert waiter.wait(timeout=10) == 130
    assert os.listdir(inst.layout.queue_dir) == []
    holder.kill()


def test_sigterm_while_waiting_cleans_up(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    inst.allow(inst.machine.leaf_uuids()[0])
    holder, _ = inst.hold()
    waiter = inst.start("recon")
    assert b"waiting" in waiter.stderr.readline()
    waiter.send_signal(signal.SIGTERM)
    assert waiter.wait(timeout=10) == 128 + signal.SIGTERM
    assert os.listdir(inst.layout.queue_dir) == []
    holder.kill()


def test_nested_wrapped_program_reuses_the_lease(installed, tmp_path):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    outer = tmp_path / "pipeline"
    outer.write_text("#!/bin/sh\nrecon\nrecon\n")
    outer.chmod(0o755)
    inst.wrap("pipeline", outer)
    inst.allow(inst.machine.leaf_uuids()[0])  # one device: a second lease would deadlock
    r = inst.run("pipeline", CUDAWRAP_WAIT="2")
    assert r.returncode == 0, r.stderr
    runs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [x["devices"] for x in runs] == [[inst.machine.leaf_uuids()[0]]] * 2


def test_nested_run_honours_its_own_visible_devices(installed, tmp_path):
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    outer = tmp_path / "pipeline"
    # The parent holds two GPUs; each child narrows within them (README: an index counts in
    # the parent's list, empty means no device).
    outer.write_text('#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES"\n'
                     'CUDA_VISIBLE_DEVICES= recon\n'
                     'CUDA_VISIBLE_DEVICES=1 recon\n'
                     'CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES%%,*}" recon\n'
                     'recon\n')
    outer.chmod(0o755)
    inst.wrap("pipeline", outer)
    inst.allow(gpus[0], gpus[1])  # a child leasing anew would find nothing free
    inst.write_config(inst.layout.config_file.read_text() + "[policy]\ngpus = 2\n")
    r = inst.run("pipeline", CUDAWRAP_WAIT="0")
    assert r.returncode == 0, r.stderr
    first, *lines = r.stdout.decode().splitlines()
    parent = first.split(",")
    assert sorted(parent) == gpus[:2]
    runs = [json.loads(line) for line in lines]
    assert [x["devices"] for x in runs] == [[], [parent[1]], [parent[0]], parent]
    assert runs[0]["cvd"] == ""


def test_a_forged_lease_marker_gets_no_free_ride(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    first = inst.machine.leaf_uuids()[0]
    inst.allow(first)
    holder, _ = inst.hold()
    r = inst.run("recon", CUDAWRAP_WAIT="0", CUDAWRAP_LEASE=f"0:{first}")
    assert r.returncode == 75
    holder.kill()


def test_a_hand_opened_free_lease_file_is_no_inherited_lease(installed):
    """A user opens a free lease file and passes the descriptor with a hand-made marker."""
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    inst.allow(gpus[0])
    holder, _ = inst.hold()
    forged = inst.layout.lease_dir / gpus[3]  # free, and outside the allow-list
    r = inst.run("sh", "-c", f'exec 7<"{forged}"; CUDAWRAP_LEASE=7:{gpus[3]} exec recon',
                 CUDAWRAP_WAIT="0")
    assert r.returncode == 75, r.stdout  # neither the allow-list nor the queue was skipped
    assert b"no free device" in r.stderr
    fd = os.open(forged, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and it was not left locked either
    finally:
        os.close(fd)
    holder.kill()


def test_foreign_processes_are_avoided(both):
    way = both("four-gpus")
    inst = way.inst
    gpus = inst.machine.leaf_uuids()
    for uuid in gpus[:3]:
        inst.machine.add_process(os.getpid(), uuid, 2048)
    way.listed()  # through the service: the monitor's next snapshot lists it
    r = inst.run("recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=gpus[0])
    assert (r.returncode, r.stderr.decode()) == (75, "recon: no free device: every device it may use is busy; "
                                                     "position 1 in line; waiting is off (wait = 0)\n"
                                                     "recon: hint: set CUDAWRAP_WAIT=SECONDS to wait\n"), way
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert json.loads(r.stdout.splitlines()[0])["devices"] == [gpus[3]], way
    inst.machine.add_process(os.getpid(), gpus[3], 2048)
    way.listed()
    assert inst.run("recon", CUDAWRAP_WAIT="0").returncode == 75, way
    inst.write_config('[policy]\nforeign = "ignore"\n')
    assert inst.run("recon", CUDAWRAP_WAIT="0").returncode == 0


def test_a_waiter_takes_a_device_once_its_foreign_process_leaves(both):
    way = both("four-gpus")
    inst = way.inst
    gpus = inst.machine.leaf_uuids()
    for uuid in gpus:
        inst.machine.add_process(4242, uuid, 2048)
    way.listed()
    waiter = inst.start("recon", CUDAWRAP_WAIT="20")
    assert b"waiting" in waiter.stderr.readline()
    inst.machine.remove_process(4242)
    assert waiter.wait(timeout=10) == 0


def test_hidden_process_lists_fall_back_to_memory_used(both):
    way = both("a100-mig7")
    inst = way.inst
    migs = inst.machine.leaf_uuids()
    inst.machine.set_fault("no_permission", "all")
    for uuid in migs[:6]:
        inst.machine.add_process(4242, uuid, 4096)  # 4 GiB used, above the 1 GiB threshold
    way.listed()
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["devices"] == [migs[6]]


def test_preset_visible_devices_are_only_narrowed(both):
    way = both("four-gpus")
    inst = way.inst
    gpus = inst.machine.leaf_uuids()
    r = inst.run("recon", CUDA_VISIBLE_DEVICES="2,3")
    assert json.loads(r.stdout.splitlines()[0])["devices"] in ([gpus[2]], [gpus[3]])
    holder = inst.hold(CUDA_VISIBLE_DEVICES=gpus[1])[0]
    r = inst.run("recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=gpus[1])
    assert r.returncode == 75  # never widened to a free GPU outside the caller's set
    r = inst.run("recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES=f"{gpus[1]},bogus,{gpus[0]}")
    assert r.returncode == 75  # the invalid entry ends the list, as in CUDA
    r = inst.run("recon", CUDA_VISIBLE_DEVICES="", SLURM_JOB_ID="77")
    assert json.loads(r.stdout.splitlines()[0])["devices"] == []  # none asked, none given
    holder.kill()


def test_allow_list_and_seed_ids_file(installed, tmp_path):
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    ids = tmp_path / "ids"
    ids.write_text(f"# the getgpu format\n{gpus[2]}\n")
    inst.write_config(f'[devices]\nallow_file = "{ids}"\n')
    for _ in range(3):
        r = inst.run("recon")
        assert json.loads(r.stdout.splitlines()[0])["devices"] == [gpus[2]]
    ids.write_text("not-a-uuid\n")
    r = inst.run("recon")
    assert r.returncode == os.EX_CONFIG
    assert r.stderr.decode().startswith(f"recon: {ids}:1: not a GPU-")


def test_too_many_mig_instances_before_r570_are_refused(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    inst.write_config("[policy]\ngpus = 2\n")
    r = inst.run("recon")
    assert r.returncode == 75
    assert "can use only one MIG instance" in r.stderr.decode().splitlines()[0]
    assert os.listdir(inst.layout.queue_dir) == []


def test_whole_gpus_serve_multi_device_requests_when_configured(installed):
    inst = installed("mixed")
    inst.wrap("recon")
    inst.write_config('[policy]\ngpus = 2\nmulti_mig = "whole-gpus"\n')
    r = inst.run("recon")
    assert r.returncode == 0, r.stderr
    devices = json.loads(r.stdout.splitlines()[0])["devices"]
    assert len(devices) == 2 and all(d.startswith("GPU-") for d in devices)


def test_spread_and_pack_placement(installed):
    inst = installed("dgx-a100-mig56")
    inst.wrap("recon")
    parents = {}
    for line in inst.machine.read().splitlines():
        if line.startswith("mig "):
            fields = dict(f.split("=", 1) for f in line.split()[1:])
            parents[fields["uuid"]] = fields["parent"]
    procs = [inst.hold()[0] for _ in range(3)]
    got = [j["devices"][0] for j in inst.jobs()]
    assert len({parents[u] for u in got}) == 3  # spread: three different physical GPUs
    for p in procs:
        p.kill()
        p.wait()
    inst.log.unlink()
    inst.write_config('[policy]\nplacement = "pack"\n')
    procs = [inst.hold()[0] for _ in range(3)]
    got = [j["devices"][0] for j in inst.jobs()]
    assert len({parents[u] for u in got}) == 1  # pack: one GPU filled first
    for p in procs:
        p.kill()


def test_no_driver_and_no_lease_files_runs_unchanged_after_one_warning(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    for name in os.listdir(inst.layout.lease_dir):
        os.unlink(inst.layout.lease_dir / name)  # never synced with a driver
    env = inst.machine.without_library()
    env["PATH"] = f"{inst.bindir}:{env['PATH']}"
    env.pop("CUDA_VISIBLE_DEVICES", None)
    r = subprocess.run(["recon"], env=env, capture_output=True, timeout=30)
    assert r.returncode == 0
    lines = r.stderr.decode().splitlines()
    assert lines == ["recon: warning: no NVIDIA driver: libnvidia-ml.so.1 was not found; "
                     "running without a device lease"]
    assert json.loads(r.stdout.splitlines()[0])["cvd"] is None
    inst.write_config('[policy]\nno_driver = "fail"\n')
    r = subprocess.run(["recon"], env=env, capture_output=True, timeout=30)
    assert r.returncode == os.EX_UNAVAILABLE


def test_unusable_nvml_leases_by_the_lease_files(installed):
    """A driver upgraded under a loaded module: NVML refuses, the lease files still name the GPUs."""
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    inst.machine.set_fault("version_mismatch")
    procs = [inst.hold(CUDAWRAP_WAIT="0") for _ in range(4)]
    for proc, _ in procs:
        line = proc.stderr.readline().decode()
        assert line.startswith("recon: warning: NVML could not start: ") and "lease files" in line, line
    assert sorted(info["cvd"] for _, info in procs) == sorted(gpus)  # one UUID each
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == 75, r.stdout  # all four leased: nobody lands on device 0 as well
    r = inst.run("recon", CUDAWRAP_WAIT="0", CUDA_VISIBLE_DEVICES="")
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[0])["cvd"] == ""
    inst.write_config('[policy]\nno_driver = "fail"\n')
    r = inst.run("recon")
    assert r.returncode == os.EX_UNAVAILABLE
    assert r.stderr.decode().splitlines()[0].startswith("recon: NVML could not start: ")
    for proc, _ in procs:
        proc.kill()
        proc.wait()


def test_driver_not_loaded_is_the_same_policy(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    inst.machine.set_fault("driver_not_loaded")
    r = inst.run("recon")
    assert r.returncode == 0
    assert "driver is not loaded" in r.stderr.decode()


def test_lost_gpu_is_never_handed_out(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    inst.machine.set_fault("gpu_lost", gpus[0])
    seen = set()
    procs = [inst.hold(CUDAWRAP_WAIT="0")[0] for _ in range(3)]
    seen = {j["devices"][0] for j in inst.jobs()}
    assert gpus[0] not in seen and len(seen) == 3
    assert inst.run("recon", CUDAWRAP_WAIT="0").returncode == 75
    for p in procs:
        p.kill()


def test_mig_reconfigured_devices_follow_sync(installed):
    inst = installed("a100-mig7")
    inst.wrap("recon")
    text = inst.machine.read()
    migs = inst.machine.leaf_uuids()
    # Replace slot 6 by a new instance with a new UUID, as `nvidia-smi mig -dci/-cci` would.
    new_uuid = "MIG-00000000-1111-2222-3333-444444444444"
    inst.machine.write(text.replace(migs[6], new_uuid))
    inst.allow(migs[6], new_uuid)
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert r.returncode == os.EX_OSFILE  # the new one has no lease file yet: never guessed at
    assert "cudawrap sync" in r.stderr.decode()
    inst.sync()
    assert not (inst.layout.lease_dir / migs[6]).exists()
    r = inst.run("recon", CUDAWRAP_WAIT="0")
    assert json.loads(r.stdout.splitlines()[0])["devices"] == [new_uuid]


def test_missing_runtime_directory_gives_a_hint(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    import shutil

    shutil.rmtree(inst.layout.runtime_dir)
    r = inst.run("recon")
    assert r.returncode == os.EX_OSFILE
    lines = r.stderr.decode().splitlines()
    assert "is missing" in lines[0] and "cudawrap sync" in lines[1]
