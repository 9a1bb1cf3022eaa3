"""Choosing devices the way users ask, end to end on a mixed simulated machine: model and
memory filters per program and per run, `run --substitute`, and `status --json/--watch`."""
import json
import os
import pty
import select
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, List

import pytest

from support.installed import Installed, ready_line
from cudawrap.policy import registry
from support.machine import FAKECUDA
from support.installed import intervals, overlaps

MIXED = "h100-a100mig-a6000"


def by_model(inst: Installed) -> Dict[str, List[str]]:
    """"H100" / "1g.10gb" / "A6000" -> the leaf UUIDs of that kind, in NVML order."""
    topo = inst.machine.parse()
    out: Dict[str, List[str]] = {"H100": [], "1g.10gb": [], "A6000": []}
    for gpu in topo.gpus:
        if gpu.instances:
            out["1g.10gb"] += [m.uuid for m in gpu.instances]
        else:
            out["H100" if "H100" in gpu.name else "A6000"].append(gpu.uuid)
    return out


def first_two_lines(result: subprocess.CompletedProcess) -> List[str]:
    lines = result.stderr.decode().splitlines()
    assert 1 <= len(lines) <= 2, lines  # the message, and at most a hint
    return lines


def test_mixed_burst_of_filtered_and_unfiltered_runs(installed):
    inst = installed(MIXED)
    inst.wrap("recon")
    kinds = by_model(inst)
    big = kinds["H100"] + kinds["A6000"]
    # (environment, the devices each grant must come from, devices per run)
    asks = ([({"CUDAWRAP_MODEL": "H100"}, kinds["H100"], 1)] * 6
            + [({"CUDAWRAP_MODEL": "rtx a6000"}, kinds["A6000"], 1)] * 6
            + [({"CUDAWRAP_MIN_MEMORY_MIB": "40000"}, big, 1)] * 5
            + [({"CUDAWRAP_MODEL": "h100", "CUDAWRAP_GPUS": "2"}, kinds["H100"], 2)] * 2
            + [({"CUDAWRAP_MIN_FREE_MEMORY_MIB": "20000", "CUDAWRAP_MAX_UTILIZATION": "50"}, big, 1)] * 3
            + [({"CUDAWRAP_MODEL": "A100"}, kinds["1g.10gb"], 1)] * 6
            + [({}, sum(kinds.values(), []), 1)] * 16)
    asks = asks[::2] + asks[1::2]  # interleave the kinds
    procs = [inst.start("recon", "--hold", "0.2", "--log", str(inst.log), **env) for env, _a, _c in asks]
    outputs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * len(procs), [e.decode() for _o, e in outputs if _o == b""]
    for (env, allowed, count), (out, _err) in zip(asks, outputs):
        got = json.loads(out.decode().splitlines()[0])["devices"]
        assert len(got) == count and set(got) <= set(allowed), (env, got)
    jobs = inst.jobs()
    assert len(jobs) == 2 * len(procs)
    assert overlaps(jobs) == []
    used = set(intervals(jobs))
    assert all(used & set(uuids) for uuids in kinds.values())  # every kind got work


def test_a_request_no_device_can_ever_meet_fails_at_once_saying_why(both):
    way = both(MIXED)
    inst = way.inst
    r = inst.run("recon", CUDAWRAP_MODEL="V100")
    assert r.returncode == 75 and r.stdout == b""
    assert first_two_lines(r)[0] == (
        "recon: no device here can ever satisfy this request: model 'V100' matches none of "
        "H100 80GB HBM3 ×2, A100-SXM4-80GB MIG 1g.10gb ×7, RTX A6000 ×2")
    r = inst.run("recon", CUDAWRAP_MODEL="A6000", CUDAWRAP_GPUS="3")
    assert r.returncode == 75
    assert first_two_lines(r)[0] == (
        "recon: 3 devices asked for, but only 2 can ever satisfy the filters: model 'A6000' leaves out "
        "H100 80GB HBM3 ×2, A100-SXM4-80GB MIG 1g.10gb ×7")
    r = inst.run("recon", CUDAWRAP_MIN_FREE_MEMORY_MIB="81560")  # one MiB more than an H100 has
    assert r.returncode == 75 and "min_free_memory_mib = 81560 leaves out" in first_two_lines(r)[0]


def test_the_admins_filters_narrowed_by_a_user_never_widened(both):
    way = both(MIXED)
    inst = way.inst
    kinds = by_model(inst)
    inst.write_config('[programs."recon"]\nmodel = "A6000"\nmax_gpus = 2\n')
    r = inst.run("recon", CUDAWRAP_MODEL="H100")  # both must match: nothing does
    assert r.returncode == 75 and "model 'A6000 H100' matches none of" in first_two_lines(r)[0]
    r = inst.run("recon", CUDAWRAP_MIN_MEMORY_MIB="1")  # a looser ask: still the admin's A6000s
    assert r.returncode == 0 and json.loads(r.stdout)["devices"][0] in kinds["A6000"]
    r = inst.run("recon", CUDAWRAP_GPUS="3")
    assert r.returncode == 75
    assert first_two_lines(r)[0].startswith(
        "recon: 3 devices asked for, but a run of this program may have at most 2 (max_gpus, ")
    config = inst.cli("config", "--program", str(inst.bindir / "recon"), CUDAWRAP_MODEL="RTX")
    rows = {line.split()[0]: line for line in config.stdout.decode().splitlines() if line.strip()}
    assert "A6000 RTX" in rows["model"] and "and environment (CUDAWRAP_MODEL)" in rows["model"]


@pytest.mark.parametrize("how, code, text", [
    ({"env": {"CUDAWRAP_MIN_FREE_MEMORY_MIB": "lots"}}, 64,
     "recon: CUDAWRAP_MIN_FREE_MEMORY_MIB='lots': 'lots' is not a whole number"),
    ({"env": {"CUDAWRAP_GPUS": "-2"}}, 64, "recon: CUDAWRAP_GPUS='-2': -2 is not between 1 and 64"),
    ({"env": {"CUDAWRAP_MAX_UTILIZATION": "150"}}, 64,
     "recon: CUDAWRAP_MAX_UTILIZATION='150': 150 is not a whole percentage from 0 to 100"),
    ({"config": '[policy]\nmin_memory_mib = -1\n'}, 78, "bad value for 'min_memory_mib': -1 is not a whole number"),
    ({"config": '[policy]\nmodel = 100\n'}, 78, "bad value for 'model': 100 is not a model name"),
    ({"config": '[policy]\ndevices = ["H100"]\n'}, 78, "'H100' is not a GPU-… or MIG-… UUID (or prefix) or an index"),
    ({"config": '[policy]\nmax_gpus = 1\ngpus = 2\n'}, 78, "gpus = 2 is above max_gpus = 1"),
], ids=["env-word", "env-negative", "env-percent", "cfg-negative", "cfg-type", "cfg-devices", "cfg-ceiling"])
def test_bad_filter_values_are_one_line_with_the_documented_code(both, how, code, text):
    way = both(MIXED)
    inst = way.inst
    if "config" in how:
        inst.write_config(how["config"])
    r = inst.run("recon", **how.get("env", {}))
    assert r.returncode == code and r.stdout == b"", way
    assert text in first_two_lines(r)[0], way


@pytest.mark.parametrize("args, code, text", [
    (["run", "--max-utilization", "abc", "--", "true"], 64, "cudawrap: --max-utilization abc: 'abc' is not"),
    (["run", "--min-memory-mib", "-5", "--", "true"], 64, "--min-memory-mib -5: -5 is not a whole number >= 0"),
    (["run", "--model", "A6000", "-n", "3", "--", "true"], 75, "only 2 can ever satisfy the filters"),
    (["status", "--watch", "0"], 64, "--watch: '0': choose between 0.1 and 3600 seconds"),
    (["status", "5"], 64, "5: only with --watch"),
    (["run", "--substitute", "--", "echo", "{index}"], 64, "--substitute: CUDA_VISIBLE_DEVICES is empty"),
])
def test_bad_switches_are_one_line(installed, args, code, text):
    inst = installed(MIXED)
    extra = {"CUDA_VISIBLE_DEVICES": ""} if "--substitute" in args else {}
    r = inst.cli(*args, **extra)
    assert r.returncode == code and r.stdout == b""
    assert text in first_two_lines(r)[0]


def test_run_switches_filter_and_substitute_the_lease_held_before_the_program_starts(installed):
    inst = installed(MIXED)
    kinds = by_model(inst)
    probe = inst.bindir / "probe"
    # A program taking its device on the command line; `flock -n` on its lease file fails
    # while the lease is held, which it must be before the program starts.
    probe.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if flock -n "{inst.layout.lease_dir}/$2" true; then held=no; else held=yes; fi
        echo "$1 $2 $3 $4 cvd=$CUDA_VISIBLE_DEVICES held=$held"
        """))
    probe.chmod(0o755)
    r = inst.cli("run", "--model", "A6000", "--substitute", "--", str(probe),
                 "-p0:{index}", "{uuid}", "{nvml_index}", "{indices}")
    assert r.returncode == 0, r.stderr
    index, uuid, nvml_index, indices, cvd, held = r.stdout.decode().split()
    assert uuid in kinds["A6000"] and cvd == f"cvd={uuid}" and held == "held=yes"
    assert (index, indices) == ("-p0:0", "0")  # CUDA numbers the leased devices from 0
    assert nvml_index == str(inst.machine.gpu_uuids().index(uuid))  # nvidia-smi's number: 3 or 4

    r = inst.cli("run", "-n", "2", "--model", "H100", "--substitute", "--", "/bin/echo",
                 "{uuids}", "{indices}", "{nvml_indices}")
    assert r.returncode == 0, r.stderr
    uuids, indices, nvml_indices = r.stdout.decode().split()
    assert sorted(uuids.split(",")) == sorted(kinds["H100"]) and indices == "0,1"
    assert sorted(nvml_indices.split(",")) == ["0", "1"]

    r = inst.cli("run", "--model", "1g.10gb", "--substitute", "--", "/bin/echo", "{nvml_index}")
    assert r.returncode == 64
    assert "is a MIG instance, which has no NVML index" in first_two_lines(r)[0]


def test_python_api_takes_the_filters_as_keywords(installed):
    inst = installed(MIXED)
    kinds = by_model(inst)
    code = textwrap.dedent("""\
        import cudawrap, sys
        from cudawrap.errors import CudawrapError
        try:
            print(cudawrap.acquire(**eval(sys.argv[1])))
        except CudawrapError as exc:
            print(exc.exit_code, exc)
        """)
    for kwargs, expect in [
        ("dict(model='a6000', min_free_memory_mib=40000)", kinds["A6000"]),
        ("dict(count=2, model='H100', max_utilization=90)", None),
    ]:
        r = inst.run(sys.executable, "-c", code, kwargs)
        got = eval(r.stdout.decode())
        assert (got[0] in expect) if expect else sorted(got) == sorted(kinds["H100"]), r.stderr
    r = inst.run(sys.executable, "-c", code, "dict(min_memory_mib=200000)")
    assert r.stdout.decode().startswith("75 no device here can ever satisfy this request: min_memory_mib")
    r = inst.run(sys.executable, "-c", code, "dict(max_utilization=-1)")
    assert r.stdout.decode().startswith("64 max_utilization=-1: -1 is not a whole percentage")


def test_create_cudawrap_switches_are_kept_in_the_registry_and_applied(installed):
    inst = installed(MIXED)
    kinds = by_model(inst)
    program = inst.bindir / "render"
    program.write_bytes(f"#!{sys.executable} -IS\n".encode() + FAKECUDA.read_bytes().split(b"\n", 1)[1])
    program.chmod(0o755)
    w = inst.cli("wrap", "--model", "RTX", "--min-memory-mib", "40000", "--min-free-memory-mib", "1000",
                 "--max-utilization", "80", "--max-gpus", "1", "--devices", "4,GPU-7b2e", str(program))
    assert w.returncode == 0, w.stderr
    assert registry.read_policy(inst.layout, str(program)) == {
        "model": "RTX", "min_memory_mib": 40000, "min_free_memory_mib": 1000, "max_utilization": 80,
        "max_gpus": 1, "devices": [4, "GPU-7b2e"]}
    runs = [inst.run(str(program)) for _ in range(3)]
    # Index 4 (the second A6000) or the H100s (GPU-7b2e…), and an RTX: only the second A6000.
    assert [json.loads(r.stdout)["devices"] for r in runs] == [[kinds["A6000"][1]]] * 3
    r = inst.run(str(program), CUDAWRAP_GPUS="2")
    assert r.returncode == 75 and "may have at most 1 (max_gpus, " in first_two_lines(r)[0]
    assert "registry.json (wrap of" in first_two_lines(r)[0]
    for switches, text in [(["--max-utilization", "101"], "--max-utilization: bad value"),
                           (["--min-memory-mib", "x"], "--min-memory-mib: 'x' is not a whole number"),
                           (["--devices", "A6000"], "'A6000' is not a GPU-… or MIG-… UUID"),
                           (["--gpus", "3", "--max-gpus", "2"], "--gpus 3 is above --max-gpus 2")]:
        bad = inst.cli("wrap", *switches, str(inst.bindir / "other"))
        assert bad.returncode == 64 and text in first_two_lines(bad)[0], bad.stderr


def test_status_json_reports_what_gpustatus_does(installed):
    inst = installed(MIXED)
    inst.wrap("recon")
    kinds = by_model(inst)
    holder = inst.start("recon", "--hold", "30", "--mem", "2048", "--context", "0", CUDA_VISIBLE_DEVICES=kinds["H100"][0])
    ready_line(holder)
    inst.machine.add_process(4242, kinds["A6000"][1], 1500)
    status = json.loads(inst.cli("status", "--json").stdout)
    devices = {d["uuid"]: d for d in status["devices"]}
    h100 = devices[kinds["H100"][0]]
    assert (h100["index"], h100["product"], h100["mig_profile"], h100["parent"]) == (
        0, "NVIDIA H100 80GB HBM3", None, kinds["H100"][0])
    assert (h100["memory_total_mib"], h100["memory_used_mib"], h100["memory_free_mib"]) == (81559, 2048, 79511)
    assert (h100["utilization"], h100["memory_utilization"], h100["temperature_c"], h100["power_w"],
            h100["power_limit_w"], h100["performance_state"]) == (3, 1, 31, 72.0, 700.0, "P0")
    (proc,) = h100["processes"]
    assert (proc["pid"], proc["memory_mib"], proc["lease_holder"]) == (holder.pid, 2048, True)
    assert "CUDAWRAP_recon" in proc["command"] and h100["holder"]["pid"] == holder.pid
    assert (h100["waiters"], h100["drains"]) == ([], [])
    a6000 = devices[kinds["A6000"][1]]
    (other,) = a6000["processes"]  # someone else's job: its pid may not even be ours to see
    assert (other["pid"], other["memory_mib"], other["lease_holder"]) == (4242, 1500, False)
    assert (a6000["performance_state"], a6000["temperature_c"], a6000["index"]) == ("P8", 47, 4)
    mig = devices[kinds["1g.10gb"][3]]
    assert (mig["product"], mig["mig_profile"], mig["index"], mig["mig_slot"]) == (
        "NVIDIA A100-SXM4-80GB MIG 1g.10gb", "1g.10gb", 2, 3)
    # A MIG instance has no sensors or counters of its own: null, and its GPU's are listed.
    assert [mig[k] for k in ("utilization", "temperature_c", "power_w", "performance_state")] == [None] * 4
    a100 = status["gpus"][2]
    assert (a100["name"], a100["mig_mode"], a100["temperature_c"], a100["power_w"], a100["utilization"]) == (
        "NVIDIA A100-SXM4-80GB", True, 38, 91.0, None)
    inst.machine.set_fault("readings_not_supported")
    quiet = {d["uuid"]: d for d in json.loads(inst.cli("status", "--json").stdout)["devices"]}
    h100 = quiet[kinds["H100"][0]]
    assert [h100[k] for k in ("temperature_c", "power_w", "power_limit_w", "performance_state")] == [None] * 4
    assert h100["utilization"] == 3  # a separate counter, still there
    holder.kill()
    holder.wait()


def test_status_watch_refreshes_a_given_number_of_times(installed):
    inst = installed("four-gpus")
    r = inst.cli("status", "--watch", "0.1", "--count", "3")
    assert r.returncode == 0, r.stderr
    frames = r.stdout.decode().split("\n\n")
    assert len(frames) == 3 and all(f.lstrip().startswith("install root ") for f in frames)
    r = inst.cli("status", "--json", "--watch", "0.1", "--count", "2")
    lines = r.stdout.decode().splitlines()
    assert len(lines) == 2 and all(len(json.loads(line)["devices"]) == 4 for line in lines)


def test_status_watch_redraws_in_place_on_a_terminal_until_interrupted(installed):
    inst = installed("four-gpus")
    code = "from cudawrap.cli import main; main()"
    pid, fd = pty.fork()
    if pid == 0:  # the child: cudawrap status --watch on a terminal
        env = inst.environ()
        os.execve(sys.executable, [sys.executable, "-c", code, "status", "--watch", "0.1"], env)
    seen = b""
    while seen.count(b"Ctrl-C to stop") < 3:
        ready, _, _ = select.select([fd], [], [], 30)
        assert ready, seen
        seen += os.read(fd, 65536)
    os.write(fd, b"\x03")  # Ctrl-C, through the terminal
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child is gone
            break
        if not chunk:
            break
        seen += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    frames = seen.split(b"\x1b[H")[1:]
    assert len(frames) >= 3
    # Each frame starts at the top left and clears what an earlier, longer one left behind.
    assert all(b"DEVICE" in f and f.rstrip(b"\r\n").endswith(b"\x1b[J") for f in frames[:2])


def test_fake_nvml_answers_the_status_readings(machine, monkeypatch):
    import pynvml

    fake = machine(MIXED)
    fake.activate(monkeypatch)
    pynvml.nvmlInit()
    h100, _h100b, a100, a6000, _a6000b = fake.gpu_uuids()
    handle = pynvml.nvmlDeviceGetHandleByUUID
    assert pynvml.nvmlDeviceGetTemperature(handle(h100), pynvml.NVML_TEMPERATURE_GPU) == 31
    assert pynvml.nvmlDeviceGetPowerUsage(handle(a100)) == 91000  # milliwatts
    assert pynvml.nvmlDeviceGetEnforcedPowerLimit(handle(a6000)) == 300000
    assert pynvml.nvmlDeviceGetPerformanceState(handle(a6000)) == 8
    assert pynvml.nvmlDeviceGetName(handle(a6000)) == "NVIDIA RTX A6000"
    mig = handle(fake.leaf_uuids()[2])
    for ask in (pynvml.nvmlDeviceGetPowerUsage, pynvml.nvmlDeviceGetPerformanceState):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            ask(mig)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetTemperature(handle(h100), 1)  # no such sensor
    fake.set_fault("readings_not_supported")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetTemperature(handle(h100), pynvml.NVML_TEMPERATURE_GPU)
    fake.write(fake.read() + "gpu uuid=GPU-bad name=x memory_mib=1 temp=500\n")
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetCount()


def test_run_and_acquire_counts_are_held_to_max_gpus(installed):
    inst = installed(MIXED)
    inst.write_config("[policy]\nmax_gpus = 2\n")
    r = inst.cli("run", "-n", "3", "--", "true")
    assert r.returncode == 75
    assert first_two_lines(r)[0].startswith("cudawrap: 3 devices asked for, but a run of this program may "
                                            "have at most 2 (max_gpus, ")
    code = "import cudawrap\ntry:\n    cudawrap.acquire(3)\nexcept Exception as exc:\n    print(exc.exit_code)"
    assert inst.run(sys.executable, "-c", code).stdout == b"75\n"
    assert inst.cli("run", "-n", "2", "--", "true").returncode == 0
