"""A simulated GPU machine for the test suite.

Every test that needs a GPU gets one from here: the fake ``libnvidia-ml.so.1``
(``tests/fakenvml/fakenvml.c``, compiled once per session), a topology file saying
what the machine has (``tests/fakenvml/FORMAT.md``), and a state directory where
the stand-in CUDA program (``fakecuda.py``) registers the devices it holds.

Two ways to use a machine:

* in a subprocess: pass ``machine.environ(...)`` as its environment;
* in this process: ``machine.activate(monkeypatch)``, then ``import pynvml``
  as usual.  The library reads ``$FAKENVML_TOPOLOGY`` on every call, so a test
  may switch machines, or rewrite one, without re-initialising NVML.
"""
import ctypes
import os
import re
import shlex
import subprocess
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import pytest

from . import fakecuda

HERE = Path(__file__).resolve().parent
FAKENVML_DIR = HERE.parent / "fakenvml"
FAKENVML_SRC = FAKENVML_DIR / "fakenvml.c"
TOPOLOGIES = FAKENVML_DIR / "topologies"
FAKECUDA = HERE / "fakecuda.py"
LIBNAME = "libnvidia-ml.so.1"

# One copy of the library per process: pynvml finds it by soname once preloaded.
_preloaded: Dict[Path, ctypes.CDLL] = {}

# This session's own: device claims are machine-wide (/run/cudawrap-devices, lease/claims.py),
# so an install on a simulated machine that claims there (a README walk-through, which sets no
# CUDAWRAP_DEVICE_CLAIMS) must not use the UUIDs another session's, or README's own
# walk-through run by hand, claims at the same time.
SESSION = uuid.uuid4().hex[:8]
_UUID = re.compile(r"\b((?:GPU|MIG)-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-)[0-9a-f]{8}([0-9a-f]{4})\b")


def session_topology(name: str) -> str:
    """The topology NAME (of TOPOLOGIES) with every device UUID made this session's own: the
    last group's first 8 digits are SESSION's, so the UUIDs' prefixes (ambiguous or not, as
    the file chose them) and their order are the file's."""
    return _UUID.sub(lambda m: f"{m[1]}{SESSION}{m[2]}", (TOPOLOGIES / f"{name}.topo").read_text(encoding="utf-8"))


def build_fakenvml(out_dir: Path) -> Path:
    """Compile the fake NVML library into out_dir; returns out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cc = shlex.split(os.environ.get("CC", "cc"))
    flags = ["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Werror"]
    cmd = cc + flags + ["-o", str(out_dir / LIBNAME), f"-Wl,-soname,{LIBNAME}", str(FAKENVML_SRC)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cannot build the fake NVML library: {shlex.join(cmd)}\n{done.stderr}")
    return out_dir


def pid_alive(pid: int) -> bool:
    """The library's test for a live registration: the pid exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process, alive
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] not in ("Z", "X")


def read_environ_file(path: Path) -> Dict[bytes, bytes]:
    """Parse what ``fakecuda.py --env-out`` wrote (NUL-terminated KEY=VALUE entries)."""
    out: Dict[bytes, bytes] = {}
    for entry in path.read_bytes().split(b"\0"):
        if entry:
            key, _, value = entry.partition(b"=")
            out[key] = value
    return out


def _fields(line: str) -> List[Tuple[str, Optional[str]]]:
    try:
        return fakecuda.split_fields(line)
    except fakecuda.TopologyError:
        return []


class FakeMachine:
    """One simulated machine: a topology file, a state directory and the library to read them."""

    def __init__(self, root: Path, lib_dir: Path) -> None:
        self.root = root
        self.topology = root / "machine.topo"
        self.state_dir = root / "state"
        self.lib_dir = lib_dir
        procs = self.state_dir / "procs"
        procs.mkdir(parents=True, exist_ok=True)
        # Programs run by other users register here too, as on a shared server.
        procs.chmod(0o1777)
        self.env: Dict[str, str] = {
            "LD_LIBRARY_PATH": str(lib_dir),
            "FAKENVML_TOPOLOGY": str(self.topology),
            "FAKENVML_STATE": str(self.state_dir),
            # Its GPUs are its own, not the host's: the installs on it claim them here.
            "CUDAWRAP_DEVICE_CLAIMS": str(self.claims_dir),
        }

    def without_costs(self) -> "FakeMachine":
        """Calls answer at once and CUDA programs register at once (FAKENVML_TIMING=none).

        A machine costs what an NVIDIA H200 does by default (fakenvml/FORMAT.md, "What
        calls cost"): the benchmarks keep that; the test suite's machines drop it, which
        spares the suite about a quarter of its time (every stand-in run would wait ~160 ms
        for its context and its exit)."""
        self.env["FAKENVML_TIMING"] = "none"
        return self

    @property
    def claims_dir(self) -> Path:
        return self.root / "claims"

    @property
    def procs_dir(self) -> Path:
        return self.state_dir / "procs"

    # ---- environments ----------------------------------------------------

    def environ(self, base: Optional[Mapping[str, str]] = None, **extra: Optional[str]) -> Dict[str, str]:
        """base (default os.environ) + this machine's variables + extra; a None value removes a key.

        The library directory goes in front of any LD_LIBRARY_PATH already in base.
        """
        env = dict(os.environ if base is None else base)
        env.update(self.env)
        env["LD_LIBRARY_PATH"] = self._library_path(base, with_lib=True)
        for key, value in extra.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def without_library(self) -> Dict[str, str]:
        """An environment in which libnvidia-ml.so.1 cannot be found (pynvml: LibraryNotFound).

        Only true on a machine without a real driver installed; in this process the
        library, once preloaded, stays loaded, so use this for subprocesses.
        """
        env = self.environ()
        path = self._library_path(None, with_lib=False)
        if path:
            env["LD_LIBRARY_PATH"] = path
        else:
            env.pop("LD_LIBRARY_PATH", None)
        return env

    def _library_path(self, base: Optional[Mapping[str, str]], with_lib: bool) -> str:
        prior = (os.environ if base is None else base).get("LD_LIBRARY_PATH", "")
        dirs = [d for d in prior.split(":") if d and Path(d) != self.lib_dir]
        return ":".join(([str(self.lib_dir)] if with_lib else []) + dirs)

    def activate(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this process at the machine and preload the library for pynvml."""
        env = self.environ()
        for key in self.env:
            monkeypatch.setenv(key, env[key])
        preload(self.lib_dir)

    # ---- the topology ----------------------------------------------------

    def read(self) -> str:
        return self.topology.read_text(encoding="utf-8")

    def parse(self) -> fakecuda.Topology:
        return fakecuda.parse_topology(self.read())

    def write(self, text: str) -> None:
        """Replace the topology atomically: the library never sees half a file.

        Readable by all (mkstemp makes it 0600): programs of other users read it too."""
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".topology-", suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, self.topology)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self, name: str) -> None:
        """Copy a ready topology (a name from TOPOLOGIES, or a path to a .topo file)."""
        path = Path(name) if name.endswith(".topo") else TOPOLOGIES / f"{name}.topo"
        self.write(path.read_text(encoding="utf-8"))

    def _edit(self, drop: Callable[[List[Tuple[str, Optional[str]]]], bool], add: Optional[str] = None) -> None:
        lines = [line for line in self.read().splitlines() if not drop(_fields(line))]
        if add is not None:
            lines.append(add)
        self.write("\n".join(lines) + "\n")

    def set_fault(self, name: str, value: str = "") -> None:
        """Switch a fault on, replacing any earlier line for the same fault."""
        self._edit(lambda f: f[:2] == [("fault", None), (name, None)], f"fault {name} {value}".rstrip())

    def clear_fault(self, name: str) -> None:
        self._edit(lambda f: f[:2] == [("fault", None), (name, None)])

    def inject_event(self, uuid: str, kind: str = "xid", data: int = 0) -> None:
        """An NVML event on UUID (a GPU, or a MIG device: delivered on its GPU): KIND xid,
        dbe or sbe; DATA the XID. One write with O_APPEND, so concurrent injections never mix."""
        fd = os.open(self.state_dir / "events", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, f"{uuid} {kind} {data}\n".encode())
        finally:
            os.close(fd)

    def set_health(self, uuid: str, **fields: int) -> None:
        """Replace the GPU's `health` line (remapped rows, clock event reasons); none: defaults."""
        line = f"health uuid={uuid} " + " ".join(f"{k}={v}" for k, v in fields.items())
        self._edit(lambda f: bool(f) and f[0][0] == "health" and ("uuid", uuid) in f,
                   line if fields else None)

    def add_process(self, pid: int, device: str, memory_mib: int = 512) -> None:
        """A foreign process the library always reports, alive or not (someone else's job)."""
        self._edit(lambda f: False, f"process pid={pid} device={device} memory_mib={memory_mib}")

    def remove_process(self, pid: int) -> None:
        self._edit(lambda f: bool(f) and f[0] == ("process", None) and ("pid", str(pid)) in f)

    # ---- what the library would say --------------------------------------

    def leaf_uuids(self) -> List[str]:
        return self.parse().leaf_uuids()

    def gpu_uuids(self) -> List[str]:
        return [g.uuid for g in self.parse().gpus]

    def registrations(self) -> List[Tuple[int, str]]:
        """(pid, device uuid) of the live stand-in programs, by pid."""
        out: List[Tuple[int, str]] = []
        for path in sorted(self.procs_dir.iterdir(), key=lambda p: p.name):
            if not path.name.isdigit() or not pid_alive(int(path.name)):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except FileNotFoundError:
                continue
            for line in text.splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[1].isdigit():
                    out.append((int(path.name), parts[0]))
        return sorted(out, key=lambda r: r[0])

    def compute_pids(self) -> Dict[str, List[int]]:
        """Device uuid -> pids the library reports now, for every GPU and MIG device.

        A MIG-mode GPU lists the processes of its instances too.  Faults are ignored.
        """
        topo = self.parse()
        parent_of: Dict[str, str] = {}
        out: Dict[str, List[int]] = {}
        for gpu in topo.gpus:
            out[gpu.uuid] = []
            for mig in gpu.instances:
                out[mig.uuid] = []
                parent_of[mig.uuid] = gpu.uuid
        users = [(p.pid, p.device) for p in topo.processes] + self.registrations()
        for pid, device in users:
            if device not in out:
                continue  # registered on a device that has since gone away
            out[device].append(pid)
            if device in parent_of:
                out[parent_of[device]].append(pid)
        return out


def preload(lib_dir: Path) -> ctypes.CDLL:
    """Load the fake library globally so pynvml's CDLL("libnvidia-ml.so.1") resolves to it."""
    lib_dir = Path(lib_dir)
    if lib_dir not in _preloaded:
        _preloaded[lib_dir] = ctypes.CDLL(str(lib_dir / LIBNAME), mode=ctypes.RTLD_GLOBAL)
    return _preloaded[lib_dir]


def shutdown_nvml() -> None:
    """Drop every nvmlInit reference held in this process, so the next test starts uninitialised."""
    for lib in _preloaded.values():
        for _ in range(10000):
            if lib.nvmlShutdown() != 0:
                break


@pytest.fixture(scope="session")
def fakenvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding the compiled fake libnvidia-ml.so.1."""
    return build_fakenvml(tmp_path_factory.mktemp("fakenvml"))


@pytest.fixture
def machine(tmp_path: Path, fakenvml_lib: Path) -> Iterator[Callable[..., FakeMachine]]:
    """Factory: ``machine("a100-mig7")`` is a fresh machine under tmp_path with that topology."""
    made: List[FakeMachine] = []

    def make(name: str = "four-gpus") -> FakeMachine:
        fake = FakeMachine(tmp_path / f"machine-{len(made)}", fakenvml_lib).without_costs()
        fake.load(name)
        made.append(fake)
        return fake

    yield make
    shutdown_nvml()
