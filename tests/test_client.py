"""The client: cudawrap pip-installed into a user's own fresh venv, leasing through an
install's files while wrapped runs compete for the same devices.

Offline: the wheel is built from this tree (`pip wheel --no-deps`), its dependencies come
from the session's wheelhouse (tests/support/installsh.py).
"""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support.installed import ready_line
from support.installsh import SOURCE, clean_env

CLIENT = textwrap.dedent("""\
    import json, os, sys, time
    import cudawrap
    from cudawrap.errors import NoDeviceError
    try:
        devices = cudawrap.acquire(1, wait=float(sys.argv[1]))
    except NoDeviceError as exc:
        print(json.dumps({"error": str(exc), "code": exc.exit_code}), flush=True)
        sys.exit(exc.exit_code)
    print(json.dumps({"devices": devices, "cvd": os.environ["CUDA_VISIBLE_DEVICES"],
                      "module": cudawrap.__file__}), flush=True)
    time.sleep(float(sys.argv[2]))
""")


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory, wheelhouse) -> Path:
    """A fresh venv with nothing but the cudawrap wheel and its dependencies, installed offline."""
    top = tmp_path_factory.mktemp("client")
    links = ["--no-index", "--find-links", str(wheelhouse)] if wheelhouse else []
    run = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, env=clean_env(),
               cwd=top)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *links, "-w", str(top / "wheel"),
                           str(SOURCE)], **run)
    assert done.returncode == 0, done.stdout
    (wheel,) = (top / "wheel").glob("cudawrap-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(top / "venv")], check=True, timeout=120)
    pip = [str(top / "venv" / "bin" / "python"), "-m", "pip"]
    done = subprocess.run([*pip, "install", "-q", *links, str(wheel)], **run)
    assert done.returncode == 0, done.stdout
    return top / "venv"


def test_client_in_its_own_venv_leases_against_an_install(installed, client_venv, tmp_path):
    inst = installed("four-gpus")
    recon = inst.wrap("recon")
    gpus = inst.machine.leaf_uuids()
    script = tmp_path / "train.py"
    script.write_text(CLIENT)
    python = str(client_venv / "bin" / "python")

    # Wrapped runs hold three of the four GPUs.
    holders = [inst.start(str(recon), "--hold", "60") for _ in range(3)]
    try:
        held = {ready_line(h)["devices"][0] for h in holders}
        assert len(held) == 3
        # The client, from the user's venv (not this checkout), gets the fourth.
        client = inst.start(python, "-I", str(script), "0", "60")
        got = ready_line(client)
        assert got["module"].startswith(str(client_venv)), got
        assert got["devices"] == [got["cvd"]] and got["cvd"] in set(gpus) - held
        # Now every device is taken: a wrapped run that will not wait loses to the client...
        r = inst.run(str(recon), CUDAWRAP_WAIT="0")
        assert r.returncode == 75, r.stderr
        # ...and so does a second client.
        r = inst.run(python, "-I", str(script), "0", "0")
        assert r.returncode == 75, r.stdout
        assert json.loads(r.stdout)["code"] == 75
        # The client's lease ends with it: the device goes to the next run.
        client.kill()
        client.wait()
        r = inst.run(str(recon), CUDAWRAP_WAIT="5")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.splitlines()[0])["devices"] == [got["cvd"]]
    finally:
        for h in holders:
            h.kill()
            h.wait()


def test_client_uses_the_system_install_without_cudawrap_root(client_venv, tmp_path):
    """No CUDAWRAP_ROOT: the client works on / (the system install); CUDAWRAP_ROOT names another."""
    code = "import cudawrap.paths as p; print(p.default_layout().root)"
    env = clean_env()
    r = subprocess.run([str(client_venv / "bin" / "python"), "-I", "-c", code], env=env, capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "/"
    r = subprocess.run([str(client_venv / "bin" / "python"), "-I", "-c", code],
                       env=dict(env, CUDAWRAP_ROOT=str(tmp_path)), capture_output=True, text=True, cwd=tmp_path)
    assert r.stdout.strip() == str(tmp_path)
