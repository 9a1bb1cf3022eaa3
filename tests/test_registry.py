"""The registry: versioned JSON, atomic writes that survive kill -9, clear errors, a light reader."""
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.procs import REPO, Spawned
from cudawrap.policy import registry
from cudawrap.errors import DataError
from cudawrap.paths import Layout
from cudawrap.policy.registry import Entry, Registry


def entry(link: str = "/opt/app/bin/recon", **changes) -> Entry:
    values = dict(
        link=link, real=os.path.join(os.path.dirname(link), "CUDAWRAP_" + os.path.basename(link)),
        sha256="ab" * 32, mode=0o755, uid=0, gid=0, policy={"gpus": 2, "wait": "forever"},
        wrapped_by="alice", wrapped_at="2024-05-01T12:00:00Z", cudawrap_version="0.1.0",
        stat=(1, 2, 3, 4),
    )
    values.update(changes)
    return Entry(**values)


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    layout = Layout(tmp_path)
    layout.state_dir.mkdir(parents=True)
    return layout


def test_round_trip_and_file_shape(layout: Layout) -> None:
    reg = Registry((entry(), entry("/opt/app/bin/my prog é", diversion="/usr/bin/x", package="x")))
    with registry.lock(layout):
        registry.save(layout, reg)
    assert registry.load(layout) == reg
    raw = json.loads(layout.registry_file.read_text())
    assert raw["version"] == registry.VERSION
    assert raw["entries"][0]["mode"] == "0755"
    assert raw["entries"][0]["policy"] == {"gpus": 2, "wait": "forever"}
    assert stat.S_IMODE(layout.registry_file.stat().st_mode) == 0o644
    # The copy kept for recovery is the same document, in a separate file.
    bak = Path(str(layout.registry_file) + ".bak")
    assert bak.read_bytes() == layout.registry_file.read_bytes()
    assert bak.stat().st_ino != layout.registry_file.stat().st_ino


def test_world_readable_whatever_the_umask(layout: Layout) -> None:
    old = os.umask(0o077)
    try:
        registry.save(layout, Registry((entry(),)))
    finally:
        os.umask(old)
    assert stat.S_IMODE(layout.registry_file.stat().st_mode) == 0o644


def test_missing_registry_is_empty(layout: Layout) -> None:
    assert len(registry.load(layout)) == 0
    assert registry.read_policy(layout, "/opt/app/bin/recon") == {}


def test_entries_are_immutable() -> None:
    e = entry()
    with pytest.raises(AttributeError):
        e.link = "/elsewhere"  # type: ignore[misc]
    with pytest.raises(TypeError):
        e.policy["gpus"] = 3  # type: ignore[index]
    assert e.replace(phase="unwrapping").phase == "unwrapping" and e.phase == "wrapped"


def test_put_replaces_and_drop_removes() -> None:
    reg = Registry((entry(), entry("/x/y")))
    reg2 = reg.put(entry(policy={"gpus": 1}))
    assert [e.link for e in reg2] == ["/opt/app/bin/recon", "/x/y"]
    assert dict(reg2.find("/opt/app/bin/recon").policy) == {"gpus": 1}
    assert reg2.find("/opt/app/bin/CUDAWRAP_recon").link == "/opt/app/bin/recon"
    assert [e.link for e in reg2.drop("/x/y")] == ["/opt/app/bin/recon"]


def test_read_policy(layout: Layout, tmp_path: Path) -> None:
    registry.save(layout, Registry((entry(), entry("/opt/app/bin/other", policy={"gpus": 1}))))
    assert registry.read_policy(layout, "/opt/app/bin/recon") == {"gpus": 2, "wait": "forever"}
    assert registry.read_policy(layout, "/opt/app/bin//recon") == {"gpus": 2, "wait": "forever"}
    assert registry.read_policy(layout, "/opt/app/bin/other") == {"gpus": 1}
    assert registry.read_policy(layout, "/opt/app/bin/unknown") == {}


def test_read_policy_through_a_directory_alias(layout: Layout, tmp_path: Path) -> None:
    real_dir = tmp_path / "usr-bin"
    real_dir.mkdir()
    (tmp_path / "bin").symlink_to(real_dir)
    registry.save(layout, Registry((entry(str(real_dir / "recon")),)))
    assert registry.read_policy(layout, str(tmp_path / "bin" / "recon"))["gpus"] == 2


def test_read_policy_ignores_a_broken_entry_of_another_program(layout: Layout) -> None:
    doc = {"version": 1, "entries": [entry().to_raw(), {"link": "/x", "bogus": True}]}
    layout.registry_file.write_text(json.dumps(doc))
    assert registry.read_policy(layout, "/opt/app/bin/recon")["gpus"] == 2
    with pytest.raises(DataError, match="entry 2"):
        registry.load(layout)


CORRUPT = [
    pytest.param(b"{not json", "not valid JSON", id="not-json"),
    pytest.param(b"", "not valid JSON", id="empty"),
    pytest.param(b"\xff\xfe", "not valid JSON", id="binary"),
    pytest.param(b"[]", "expected a JSON object", id="list"),
    pytest.param(b'{"entries": []}', "version", id="no-version"),
    pytest.param(b'{"version": "1", "entries": []}', "version", id="string-version"),
    pytest.param(b'{"version": 1}', "entries", id="no-entries"),
    pytest.param(b'{"version": 1, "entries": [{"link": "/x"}]}', "missing key", id="short-entry"),
]


@pytest.mark.parametrize("data, problem", CORRUPT)
def test_corrupt_registry_is_a_clear_error_and_never_replaced(layout: Layout, data: bytes, problem: str) -> None:
    layout.registry_file.write_bytes(data)
    with pytest.raises(DataError) as info:
        registry.load(layout)
    message = info.value.message
    assert str(layout.registry_file) in message and problem in message
    assert "registry.json.bak" in message and "cudawrap doctor" in message and "\n" not in message
    if problem != "missing key":  # read_policy checks only the entry it is asked about
        with pytest.raises(DataError, match=problem):
            registry.read_policy(layout, "/x")
    with pytest.raises(DataError):
        registry.update(layout, lambda reg: reg.put(entry()))
    assert layout.registry_file.read_bytes() == data


def test_bad_field_names_the_entry_and_the_field(layout: Layout) -> None:
    raw = entry().to_raw()
    raw["sha256"] = "nothex"
    layout.registry_file.write_text(json.dumps({"version": 1, "entries": [raw]}))
    with pytest.raises(DataError, match=r"entry 1 \(/opt/app/bin/recon\): \"sha256\" must be"):
        registry.load(layout)


def test_newer_version_says_upgrade(layout: Layout) -> None:
    layout.registry_file.write_text(json.dumps({"version": 99, "entries": []}))
    with pytest.raises(DataError, match="newer cudawrap"):
        registry.load(layout)
    with pytest.raises(DataError, match="newer cudawrap"):
        registry.read_policy(layout, "/x")


def test_older_version_is_converted(layout: Layout, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend this cudawrap writes version 2, where "policy" was renamed "settings".
    def v1_to_v2(doc):
        for e in doc["entries"]:
            e["settings"] = e.pop("policy")
        return {"version": 2, "entries": doc["entries"]}

    registry.save(layout, Registry((entry(),)))
    monkeypatch.setattr(registry, "VERSION", 2)
    monkeypatch.setitem(registry._UPGRADES, 1, v1_to_v2)
    doc = registry._read_document(str(layout.registry_file))
    assert doc["version"] == 2 and doc["entries"][0]["settings"]["gpus"] == 2


def test_duplicate_links_are_rejected(layout: Layout) -> None:
    layout.registry_file.write_text(json.dumps({"version": 1, "entries": [entry().to_raw()] * 2}))
    with pytest.raises(DataError, match="listed twice"):
        registry.load(layout)


def test_lock_is_reentrant_in_one_process(layout: Layout) -> None:
    with registry.lock(layout):
        with registry.lock(layout):
            registry.update(layout, lambda reg: reg.put(entry()))
    assert len(registry.load(layout)) == 1


def test_concurrent_writers_lose_no_update(layout: Layout, spawned: Spawned) -> None:
    code = (
        "import sys; from pathlib import Path; from cudawrap.policy import registry; "
        "from cudawrap.paths import Layout; sys.path.insert(0, %r); from test_registry import entry; "
        "layout = Layout(Path(sys.argv[1]))\n"
        "for i in range(15):\n"
        "    registry.update(layout, lambda reg: reg.put(entry(f'/w{sys.argv[2]}/p{i}')))\n"
    ) % str(Path(__file__).parent)
    env = dict(os.environ, PYTHONPATH=REPO)
    procs = [spawned([sys.executable, "-c", code, str(layout.root), str(n)], env=env) for n in range(3)]
    assert [p.wait(60) for p in procs] == [0, 0, 0]
    assert len(registry.load(layout)) == 45


WRITER = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from cudawrap.policy import registry
from cudawrap.paths import Layout
from test_registry import entry
layout = Layout(Path(sys.argv[1]))
small = registry.Registry((entry(),))
big = registry.Registry(tuple(entry(f"/opt/app/bin/p{{i}}") for i in range(300)))
print("ready", flush=True)
while True:
    for reg in (small, big):
        with registry.lock(layout):
            registry.save(layout, reg)
"""


@pytest.mark.slow
def test_kill_9_during_writes_leaves_a_readable_registry(layout: Layout, spawned: Spawned) -> None:
    code = WRITER.format(tests=str(Path(__file__).parent))
    env = dict(os.environ, PYTHONPATH=REPO)
    rng = random.Random(1234)
    sizes = set()
    registry.save(layout, Registry((entry(),)))  # a kill before the first write leaves this
    for _ in range(25):
        proc = spawned([sys.executable, "-c", code, str(layout.root)], env=env, stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        reg = registry.load(layout)  # must parse: the old document or the new one
        assert len(reg) in (1, 300)
        sizes.add(len(reg))
        assert registry.load_path(str(layout.registry_file) + ".bak") is not None
    assert sizes == {1, 300}, "the writer should have been caught at different moments"


def test_the_shim_path_imports_little(layout: Layout) -> None:
    """read_policy is on every launch: no dataclasses, typing, pathlib, filelock or plumbum."""
    registry.save(layout, Registry((entry(),)))
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from cudawrap.policy.registry import read_policy_at\n"
        "assert read_policy_at(%r, '/opt/app/bin/recon')['gpus'] == 2\n"
        "heavy = {'dataclasses', 'typing', 'pathlib', 'filelock', 'plumbum'} & set(sys.modules)\n"
        "print(sorted(heavy))\n"
    ) % (REPO, str(layout.registry_file))
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_deeply_nested_json_is_a_clear_error(layout: Layout) -> None:
    layout.registry_file.write_bytes(b"[" * 100000)
    with pytest.raises(DataError, match="nested too deeply"):
        registry.load(layout)


@pytest.mark.parametrize("link, real", [
    pytest.param("/opt/re\0con", "/opt/CUDAWRAP_re\0con", id="nul"),
    pytest.param("/opt/\ud800", "/opt/CUDAWRAP_\ud800", id="lone-surrogate"),
    pytest.param("/opt/" + "a" * 300, "/opt/CUDAWRAP_" + "a" * 300, id="too-long"),
    pytest.param("/opt/../etc/x", "/opt/../etc/CUDAWRAP_x", id="not-normalised"),
    pytest.param("/opt/app/recon", "/etc/shadow", id="real-elsewhere"),
])
def test_paths_that_cannot_be_a_wrap_are_refused(layout: Layout, link: str, real: str) -> None:
    raw = entry().to_raw()
    raw.update(link=link, real=real)
    layout.registry_file.write_text(json.dumps({"version": 1, "entries": [raw]}))
    with pytest.raises(DataError, match="entry 1"):
        registry.load(layout)
