"""A drain during a burst of runs by real accounts (run as root; skipped otherwise).

In its own file, after test_fakenvml: the multi-user fixture shuts the in-process NVML down.
"""
import json
import time

import pytest

from support.procs import cli_code, root_only

pytestmark = [pytest.mark.root, root_only]


def test_drain_during_a_burst_is_never_granted_and_wait_returns_when_its_holder_ends(mu) -> None:  # type: ignore[no-untyped-def]
    inst = mu("four-gpus")
    alice, bob = inst.world.alice, inst.world.bob
    inst.wrap("recon")
    gpus = inst.machine.gpu_uuids()
    burst = [inst.start(alice if i % 2 else bob, "recon", "--hold", "1.5", "--log", str(inst.log))
             for i in range(12)]
    wait_for_started = time.monotonic() + 30
    while len([line for line in inst.log.read_text().splitlines() if '"start"' in line]) < 4:
        assert time.monotonic() < wait_for_started
        time.sleep(0.02)
    code = cli_code(inst.path)
    drainer = inst.start(None, inst.world.python, "-I", "-c", code, "drain", "2", "--reason", "burst test", "--wait")
    assert drainer.stdout.readline().decode().startswith(f"drained {gpus[2]}")
    drained_at = time.time()
    assert drainer.wait(timeout=60) == 0, drainer.stderr.read()
    returned_at = time.time()
    assert all(job.wait(timeout=120) == 0 for job in burst)
    records = [json.loads(line) for line in inst.log.read_text().splitlines()]
    on_drained = [r for r in records if r["event"] == "start" and r["devices"] == [gpus[2]]]
    # Exactly the run that held GPU 2 when it was drained, and nobody after it.
    assert len(on_drained) == 1 and on_drained[0]["time"] < drained_at, on_drained
    ended = [r for r in records if r["event"] == "end" and r["pid"] == on_drained[0]["pid"]][0]
    # --wait returned after that holder ended, and not long after (it looks every 0.1 s).
    assert ended["time"] <= returned_at <= ended["time"] + 5.0
    assert len([r for r in records if r["event"] == "start"]) == 12  # the other devices served everyone
    # Resumed, GPU 2 is handed out again.
    assert inst.cli(None, "resume", gpus[2][:10]).returncode == 0
    done = inst.run(alice, "recon", CUDA_VISIBLE_DEVICES="2")
    assert done.returncode == 0 and json.loads(done.stdout)["devices"] == [gpus[2]], done.stderr
