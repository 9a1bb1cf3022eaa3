"""Every parser against generated input: it parses, or fails with one clear line.

Never a traceback, never a change of state, never a device outside what the input allows.
Bounded (examples and no deadline per example) so that the file runs in well under a minute.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from support import fakecuda
from cudawrap.policy import registry
from cudawrap.policy.config import MAX_GPUS, Config, parse_config, parse_gpus, parse_wait
from cudawrap.devices.model import Inventory
from cudawrap.errors import ConfigError, DataError
from cudawrap.lease.known import inherited_lease
from cudawrap.sched.selection import parse_visible, read_allow_file
from support.admin import Admin, snapshot

FAST = settings(max_examples=250, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SLOW = settings(max_examples=8, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Text that can be an environment value or an argument: no NUL, no lone surrogates.
ARG_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=24)
NASTY = ["", " ", "-1", "0", "-0", "1e400", "nan", "inf", "-inf", "forever", "FOREVER ", "9" * 5000, "٣", "²",
         "1_0", " 2 ", "0x10", "1,5", "\t", "\u00a0", "\u202e1", "--", "1e-400", "10" * 30]


def is_one_line(message: str) -> bool:
    return bool(message) and "\n" not in message and "Traceback" not in message


# --- CUDA_VISIBLE_DEVICES ----------------------------------------------------------------------


def _visible_values(topo: fakecuda.Topology) -> st.SearchStrategy[str]:
    gpus = [g.uuid for g in topo.gpus]
    migs = [m.uuid for g in topo.gpus for m in g.instances]
    legacy = [f"MIG-{g.uuid}/{m.gi}/{m.ci}" for g in topo.gpus for m in g.instances]
    token = st.one_of(
        st.integers(-2, len(gpus) + 2).map(str),
        st.sampled_from(["00", "01", "²", "٣", "０", "1²", "+1", "1.0", "", "GPU-", "MIG-", "GPU", "MIG-GPU-"]),
        st.builds(lambda u, n: u[:n], st.sampled_from(gpus), st.integers(0, 45)),
        st.builds(lambda u, n: u[:n], st.sampled_from(migs or gpus), st.integers(20, 45)),
        st.sampled_from(migs or gpus),
        st.sampled_from(legacy or gpus),
        st.text(max_size=6),
    )
    padded = st.builds(lambda a, t, b: a + t + b, st.sampled_from(["", " ", "\t", "\u00a0"]), token,
                       st.sampled_from(["", " ", "\n"]))
    return st.one_of(st.lists(padded, max_size=6).map(",".join), st.text(max_size=30))


def _oracle(topo: fakecuda.Topology, value: str) -> List[str]:
    """What the CUDA runtime (as tests/support/fakecuda.py models it) lets a program see, without the
    one-MIG-per-process limit of old drivers (that is the driver's business, not the list's)."""
    # An index of 4300+ digits is out of range like any other (int() refuses to read it).
    value = ",".join("999999999" if t.strip().isascii() and t.strip().isdigit() and len(t.strip()) > 9 else t
                     for t in value.split(","))
    return fakecuda.visible_devices(topo._replace(driver="570.0.0"), value)


@pytest.mark.parametrize("topology", ["four-gpus", "mixed", "a100-mig7"])
def test_visible_devices_never_widen(machine, monkeypatch, topology: str) -> None:
    """parse_visible gives exactly a prefix of what CUDA would allow, in CUDA's order, and
    never raises: it may stop early (an unsupported spelling), never add or reorder."""
    from cudawrap.devices import nvml

    fake = machine(topology)
    fake.activate(monkeypatch)
    inventory: Inventory = nvml.inventory()
    topo = fake.parse()

    @FAST
    @given(_visible_values(topo))
    @example("²")
    @example("GPU-")
    @example("0," + "9" * 5000)
    @example("٣")
    def check(value: str) -> None:
        got = [d.uuid for d in parse_visible(value, inventory)]
        allowed = _oracle(topo, value)
        assert got == allowed[:len(got)], (value, got, allowed)
        if "MIG-GPU-" not in value and topology != "mixed":
            assert got == allowed, (value, got, allowed)  # and where it can, it reads all of it

    check()


# --- the configuration file ------------------------------------------------------------------

KEYS = ["gpus", "wait", "placement", "foreign", "busy_memory_mib", "no_driver", "multi_mig", "allow",
        "allow_file", "bogus", "Gpus", '"gpus"', "gpus.x"]
VALUES = st.one_of(
    st.integers(-(10 ** 30), 10 ** 400).map(str), st.sampled_from(["0", "1", "64", "65", "-1", "1e400", "nan", "inf",
                                                                   "-inf", "true", "[]", "{}", '"forever"', '"spread"',
                                                                   '["GPU-x"]', '["bad"]', '"/ids"', '"rel"', '""',
                                                                   "[[[[1]]]]", "1979-05-27", "0x10", "1_000"]),
    st.floats(allow_nan=True).map(repr), st.text(max_size=8).map(json.dumps), st.text(max_size=8))
LINES = st.one_of(
    st.sampled_from(["[policy]", "[devices]", '[programs."recon"]', "[programs]", "[programs.recon.x]", "[bogus]",
                     "[[policy]]", '[programs.""]', "", "# c", "[policy", "policy]"]),
    st.builds("{} = {}".format, st.sampled_from(KEYS), VALUES),
    st.text(max_size=20))


@FAST
@given(st.one_of(st.lists(LINES, max_size=10).map("\n".join), st.text(max_size=60)))
@example("x = " + "[" * 5000)
@example("[policy]\nwait = 1" + "0" * 400)
@example("[policy]\nwait = -1" + "0" * 400)
@example("[policy]\ngpus = 1" + "0" * 400)
def test_config_parses_or_names_the_file(text: str) -> None:
    path = Path("/etc/cudawrap/config.toml")
    try:
        config = parse_config(path, text)
    except ConfigError as exc:
        assert exc.message.startswith(str(path)) and is_one_line(exc.message), exc.message
        assert exc.hint is None or is_one_line(exc.hint)
        return
    assert isinstance(config, Config)
    assert 1 <= config["gpus"] <= MAX_GPUS and config["wait"] >= 0


@FAST
@given(st.one_of(ARG_TEXT, st.sampled_from(NASTY), st.integers(-(10 ** 400), 10 ** 400), st.floats(allow_nan=True),
                 st.booleans(), st.none(), st.lists(st.integers(), max_size=2)))
def test_wait_and_gpus_values(value: object) -> None:
    try:
        wait = parse_wait(value)
    except ValueError as exc:
        assert is_one_line(str(exc))
    else:
        assert isinstance(wait, float) and (wait >= 0 or math.isinf(wait)) and not math.isnan(wait)
    try:
        gpus = parse_gpus(value)
    except ValueError as exc:
        assert is_one_line(str(exc))
    else:
        assert isinstance(gpus, int) and 1 <= gpus <= MAX_GPUS


# --- the registry --------------------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=12)


def _entry(**changes: object) -> dict:
    raw = registry.Entry(link="/opt/app/bin/recon", real="/opt/app/bin/CUDAWRAP_recon", sha256="ab" * 32, mode=0o755,
                         uid=0, gid=0, policy={"gpus": 2}, wrapped_by="alice", wrapped_at="2024-05-01T12:00:00Z",
                         cudawrap_version="0.1.0", stat=(1, 2, 3, 4)).to_raw()
    raw.update(changes)
    return raw


FIELDS = list(_entry())
DOCUMENTS = st.one_of(
    JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=80),
    st.builds(lambda key, value, version: json.dumps({"version": version, "entries": [_entry(**{key: value})]}).encode(),
              st.sampled_from(FIELDS + ["extra"]), JSON, st.sampled_from([1, 1, 1, 0, 2, "1", True, None])),
    st.builds(lambda key: json.dumps({"version": 1, "entries": [{k: v for k, v in _entry().items() if k != key}]}).encode(),
              st.sampled_from(FIELDS)),
)


@pytest.fixture(scope="module")
def registry_dir() -> object:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


@FAST
@given(DOCUMENTS)
@example(b'{"version": 1, "entries": [], "x": ' + b"[" * 100 + b"]" * 100 + b"}")
@example(json.dumps({"version": 1, "entries": [_entry(), _entry()]}).encode())
def test_registry_reader_parses_or_names_the_file(registry_dir: Path, data: bytes) -> None:
    path = registry_dir / "registry.json"
    path.write_bytes(data)
    try:
        reg = registry.load_path(str(path))
    except DataError as exc:
        assert exc.message.startswith(str(path)) and is_one_line(exc.message), exc.message
    else:
        assert all(isinstance(e, registry.Entry) for e in reg)
    try:
        policy = registry.read_policy_at(str(path), "/opt/app/bin/recon")
    except DataError as exc:
        assert exc.message.startswith(str(path)) and is_one_line(exc.message), exc.message
    else:
        assert isinstance(policy, dict)
    assert path.read_bytes() == data  # read, never rewritten


def test_registry_reader_survives_deep_nesting(tmp_path: Path) -> None:
    path = tmp_path / "registry.json"
    path.write_bytes(b"[" * 100000)
    with pytest.raises(DataError):
        registry.load_path(str(path))


@pytest.mark.parametrize("name", ["re\0con", "\ud800", "a" * 5000])
def test_registry_paths_that_cannot_exist_are_refused(tmp_path: Path, name: str) -> None:
    """Such an entry used to pass, and `cudawrap list`, doctor and unwrap died on it."""
    path = tmp_path / "registry.json"
    path.write_text(json.dumps({"version": 1, "entries": [_entry(link=f"/opt/{name}", real=f"/opt/CUDAWRAP_{name}")]}))
    with pytest.raises(DataError):
        registry.load_path(str(path))


# --- the seed allow-list file and the inherited lease marker ---------------------------------

ID_LINES = st.one_of(st.sampled_from(["GPU-5e7f", "MIG-abc-1", "# c", "", "  GPU-x  # y", "gpu-x", "GPU-é", "GPU-a/b",
                                      "MIG-", "GPU-\x00", "\r"]), st.text(max_size=12))


@FAST
@given(st.one_of(st.lists(ID_LINES, max_size=6).map(lambda ls: "\n".join(ls).encode("utf-8", "surrogateescape")),
                 st.binary(max_size=60)))
def test_allow_file_parses_or_names_the_file(registry_dir: Path, data: bytes) -> None:
    path = registry_dir / "ids"
    path.write_bytes(data)
    try:
        ids = read_allow_file(str(path))
    except ConfigError as exc:
        assert exc.message.startswith(str(path)) and is_one_line(exc.message), exc.message
    else:
        assert ids and all(i.isascii() and (i.startswith("GPU-") or i.startswith("MIG-"))
                           and all(c.isalnum() or c == "-" for c in i) for i in ids), ids
    assert path.read_bytes() == data


@FAST
@given(st.one_of(ARG_TEXT, st.lists(st.builds("{}:{}".format, st.sampled_from(["0", "1", "2", "3", "99", "²", "٣", "-1",
                                                                              "9" * 30, ""]),
                                               st.sampled_from(["GPU-x", "", "/", "..", "MIG-a/b", "x"])),
                                     min_size=1, max_size=4).map(",".join)))
def test_a_forged_lease_marker_is_no_lease(registry_dir: Path, marker: str) -> None:
    lease_dir = registry_dir / "leases"
    lease_dir.mkdir(exist_ok=True)
    assert inherited_lease(str(lease_dir), marker) is None


# --- the command line and the environment, through real processes ----------------------------


def _cli_argv(switch: str, value: str, prog: Path) -> List[str]:
    if switch.startswith("run"):
        return ["run", f"--{switch.split()[1]}={value}", "--", "/bin/true"]
    if switch == "monitor --period":
        return ["monitor", "--once", f"--period={value}"]
    return ["wrap", f"--{switch}={value}", str(prog)]


@SLOW
@given(st.sampled_from(["gpus", "wait", "busy-memory-mib", "placement", "run gpus", "run wait", "monitor --period"]),
       st.one_of(ARG_TEXT, st.sampled_from(NASTY)))
@example("gpus", "9" * 5000)
@example("wait", "nan")
@example("run gpus", "٣")
@example("monitor --period", ":")
def test_command_line_values(admin: Admin, switch: str, value: str) -> None:
    """One line (plus a hint) and a non-zero exit, or success; a refusal changes nothing."""
    prog = admin.bindir / "recon"
    if not prog.exists():
        admin.program("recon")
    before = snapshot(admin.tmp)
    result = admin.cli(*_cli_argv(switch, value, prog))
    if result.returncode == 0:
        if switch in ("gpus", "wait", "busy-memory-mib", "placement"):
            assert admin.cli("unwrap", str(prog)).returncode == 0
        return
    lines = result.stderr.splitlines()
    assert lines and lines[0].startswith("cudawrap") and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 or (len(lines) == 2 and lines[1].startswith("hint:")), result.stderr
    after = snapshot(admin.tmp)
    cache = str(admin.layout.runtime_dir / "launch.cache")
    assert {k: v for k, v in after.items() if k != cache} == {k: v for k, v in before.items() if k != cache}


@pytest.fixture(scope="module")
def wait_shim(tmp_path_factory, fakenvml_lib):  # type: ignore[no-untyped-def]
    """A wrapped stand-in on a simulated machine, for CUDAWRAP_WAIT values from the environment."""
    import shutil

    from cudawrap.install.installation import prepare
    from cudawrap.paths import Layout
    from support.machine import FAKECUDA, FakeMachine

    tmp = tmp_path_factory.mktemp("wait-shim")
    fake = FakeMachine(tmp / "machine", fakenvml_lib).without_costs()
    fake.load("four-gpus")
    layout = Layout(tmp / "root")
    prepare(layout)
    env = fake.environ(CUDAWRAP_ROOT=str(layout.root))
    subprocess.run([sys.executable, "-c", "from cudawrap.cli import main; main()", "sync"], env=env, check=True,
                   capture_output=True)
    bindir = tmp / "bin"
    bindir.mkdir()
    real = bindir / "CUDAWRAP_recon"
    shutil.copy(FAKECUDA, real)
    real.write_bytes(f"#!{sys.executable} -IS\n".encode() + real.read_bytes().split(b"\n", 1)[1])
    (bindir / "recon").symlink_to(layout.shim)
    env = {k: v for k, v in env.items() if not k.startswith("CUDAWRAP_") or k == "CUDAWRAP_ROOT"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return bindir / "recon", env


@settings(max_examples=15, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.one_of(ARG_TEXT, st.sampled_from(NASTY)))
@example("9" * 5000)
def test_cudawrap_wait_through_the_shim(wait_shim, value: str) -> None:  # type: ignore[no-untyped-def]
    link, env = wait_shim
    result = subprocess.run([str(link)], env=dict(env, CUDAWRAP_WAIT=value), capture_output=True, timeout=60)
    err = result.stderr.decode("utf-8", "replace")
    if result.returncode == 0:
        assert json.loads(result.stdout.splitlines()[0])["cvd"].startswith("GPU-")
        return
    lines = err.splitlines()
    assert result.returncode == os.EX_USAGE, err
    assert len(lines) == 2 and lines[0].startswith("recon: CUDAWRAP_WAIT=") and lines[1].startswith("recon: hint: "), err
    assert "Traceback" not in err
