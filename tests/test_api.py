"""The Python API's promises (docs/user/running.md): a second call, and release()."""
import json
import subprocess
import sys

import pytest


def run_script(inst, code: str, **env: str) -> list:
    """Run CODE in a fresh interpreter on the simulated machine; its JSON lines."""
    r = subprocess.run([sys.executable, "-c", code], env=inst.environ(**env), capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    return [json.loads(line) for line in r.stdout.splitlines()]


def test_a_second_call_returns_the_same_lease(installed):
    inst = installed("four-gpus")
    code = ("import cudawrap, json, os\n"
            "first = cudawrap.acquire()\n"
            "second = cudawrap.acquire()  # a re-run notebook cell\n"
            "print(json.dumps([first, second, os.environ['CUDA_VISIBLE_DEVICES']]))\n")
    [(first, second, visible)] = run_script(inst, code)
    assert len(first) == 1 and first[0] in inst.machine.leaf_uuids()
    assert second == first and visible == first[0]


@pytest.mark.parametrize("preset", [None, "0,1,2"], ids=["unset", "narrowed-by-caller"])
def test_release_gives_back_and_restores_the_environment(installed, preset):
    inst = installed("four-gpus")
    gpus = inst.machine.leaf_uuids()
    code = ("import cudawrap, cudawrap.api, json, os\n"
            "env = lambda: [os.environ.get(k) for k in ('CUDA_VISIBLE_DEVICES', 'CUDAWRAP_LEASE')]\n"
            "before = env()\n"
            "one = cudawrap.acquire(wait=0)\n"
            "cudawrap.api.release()\n"
            "after = env()\n"
            "two = cudawrap.acquire(2, wait=0)  # not narrowed to the device given back\n"
            "print(json.dumps([before, one, after, two]))\n")
    extra = {} if preset is None else {"CUDA_VISIBLE_DEVICES": preset}
    [(before, one, after, two)] = run_script(inst, code, **extra)
    assert before == [preset, None]
    assert after == before
    assert len(two) == 2 and set(two) <= set(gpus if preset is None else gpus[:3])


def test_release_frees_the_device_for_others(installed):
    inst = installed("four-gpus")
    inst.wrap("recon")
    first = inst.machine.leaf_uuids()[0]
    inst.write_config(f'[devices]\nallow = ["{first}"]\n')
    code = ("import cudawrap, cudawrap.api, sys\n"
            "cudawrap.acquire()\n"
            "print('held', flush=True); sys.stdin.readline()\n"
            "cudawrap.api.release()\n"
            "print('released', flush=True); sys.stdin.readline()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=inst.environ(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == b"held\n"
        assert inst.run("recon", CUDAWRAP_WAIT="0").returncode == 75
        proc.stdin.write(b"\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == b"released\n"
        r = inst.run("recon", CUDAWRAP_WAIT="0")  # the script still runs, its lease is back
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.splitlines()[0])["devices"] == [first]
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
