#!/usr/bin/env python3
"""A stand-in CUDA program: it takes the devices CUDA would give it and holds them.

It reads the same topology file as the fake NVML library (``$FAKENVML_TOPOLOGY``,
format in ``fakenvml/FORMAT.md``) and resolves ``CUDA_VISIBLE_DEVICES`` the way
the CUDA runtime documents it, with these exact rules:

* Unset: every device, in CUDA's order (below); a GPU in MIG mode contributes its
  MIG instances in slot order (none if it has none); a lost GPU contributes none.
* Set but empty (or only blanks): no device.
* Otherwise a comma-separated list, each entry stripped of blanks:

  - ``N`` (ASCII digits): the GPU CUDA numbers N.  With
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` that is NVML index N (the order ``nvidia-smi``
    shows); otherwise (CUDA's default, ``FASTEST_FIRST``) GPUs are numbered by
    compute capability (the topology's ``cc``), highest first, ties in NVML order:
    the stand-in's version of CUDA's undocumented "fastest" heuristic.  On a
    MIG-mode GPU it means that GPU's MIG instances in slot order.
  - ``GPU-...``: the one GPU whose UUID starts with the entry (the full UUID
    or an abbreviation of at least one character after ``GPU-``).  A MIG-mode
    GPU expands as for ``N``.
  - ``MIG-<uuid>``: that MIG instance (full UUID only: an abbreviation is invalid).
  - ``MIG-GPU-<uuid>/<gi>/<ci>``: the pre-R470 spelling of the same.

  The first entry that is invalid ends the list and the devices before it are
  kept: an index out of range or negative, an unknown or ambiguous UUID, an
  empty entry, a device that was already listed, anything else, and any
  device of a GPU the topology marks as lost.

* With a driver older than R570 (the topology's ``driver`` line) a process
  can use one MIG instance only: the first MIG instance in the resulting list
  stays, later ones are dropped; whole GPUs are unaffected.
* With the ``driver_not_loaded`` fault, or without ``$FAKENVML_TOPOLOGY``,
  there is no device.

For as long as it runs it registers itself as a compute process on exactly
those devices in ``$FAKENVML_STATE/procs/<pid>`` (lines ``UUID MEMORY_MIB``),
so the fake NVML library reports it, and it removes the file when it exits
normally or on SIGTERM/SIGINT (it then dies of that signal, as a real program
would).  A registration left behind by a killed process is ignored by the
library because its pid is dead.

Memory: each device shows ``--mem`` MiB plus what its context costs (``--context``, by default
518 MiB, 274 for an MPS client, as measured); ``--grow MIB_PER_S`` rewrites the registration
as the allocation grows, up to ``--max``. ``--children N`` forks N processes that register on
the same devices as their own contexts and hold them alike (their pids in the ready line's
``"children"``); with ``--escape`` each is forked twice, so that its parent is gone and it is
no descendant of the program, its inherited descriptors (a lease) still open; with
``--close-fds`` each closes what it inherited, so that only its descent makes it the program's.
They end with the program.

On start it prints one JSON line to stdout, once its registration and its
``--log`` start record are in place, so a test can read that line as "ready":
``{"pid", "argv", "cvd", "devices", "driver", "mps", "mps_server"}``.  With ``--require N`` and
fewer devices it prints the line, says why on stderr and exits 100
(cudaErrorNoDevice) without registering or logging, as a CUDA program that
fails in ``cudaSetDevice`` never creates a context.

MPS: with ``CUDA_MPS_PIPE_DIRECTORY`` set (non-empty) it is an MPS client of the control
daemon listening there (``fakemps/nvidia-cuda-mps-control``): it connects before it
prints its ready line and stays connected for as long as it runs, so the daemon knows its
uid (from the socket) and notices its death, kill -9 included.  While the daemon keeps it
waiting (another user's MPS server still has clients) it blocks, as a real client blocks
creating its context.  Its devices are then the daemon's, renumbered from 0, narrowed by
its own ``CUDA_VISIBLE_DEVICES`` (an index into the daemon's devices, or a UUID or prefix
of one of them), as NVIDIA documents for MPS clients.  The ready line has an ``"mps"``
object with the ``CUDA_MPS_*`` variables it got (null when none) and ``"mps_server"``,
the pid of its MPS server (null when it is no MPS client).

Without a daemon at that pipe directory (or one that is quitting) the real CUDA driver
quietly makes an ordinary context instead; on a device in EXCLUSIVE_PROCESS compute mode,
as NVIDIA recommends for MPS, that context fails with cudaErrorDevicesUnavailable (46)
once any other process (an MPS server, another run) has the device, and where it does
not fail it runs without its share's limits. The stand-in fails every time, without
registering: it prints the ready line with ``"error": "cudaErrorDevicesUnavailable"``,
says why on stderr and exits 46, so a test sees a shared run that lost its MPS limits
instead of a run that happened to be alone.  A client the daemon disconnects (``quit -t``, ``shutdown_server -f``) says
cudaErrorMpsClientTerminated (810, too large for an exit status) and exits 1.

Timing, as measured on an NVIDIA H200 (``fakenvml/FORMAT.md``, "What calls cost"): a real
CUDA process appears in NVML's process list when its context exists, ~135 ms after it
started, and leaves it ~28 ms before its exit is visible (to a pidfd, to ``wait``). So the
stand-in registers ``context`` ms after its own code began to run (its ready line comes
then; the interpreter's start-up before that is extra), and after unregistering it waits
``leave`` ms before it exits. ``$FAKENVML_TIMING`` sets
both, as it sets the library's costs (``none``: neither).

``argv`` is ``sys.argv``.  When this file is run through its shebang (as
cudawrap's renamed copies and links are), the kernel hands Python the path of
the script file, so ``argv[0]`` is the path that was executed (a link or a
renamed copy), never an ``argv[0]`` chosen by the caller of ``execve``.

Standard library only, Python 3.9+, and quick to start: it is run hundreds of
times by the test suite.
"""
import argparse
import json
import os
import signal
import sys
import time
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

# When this program's own code began: its CUDA context is created this long after (a wrapped
# run's process began earlier, in the shim, whose time a real program's context does not absorb).
STARTED = time.monotonic()

NO_DEVICE_EXIT = 100  # cudaErrorNoDevice
MPS_UNAVAILABLE_EXIT = 46  # cudaErrorDevicesUnavailable
MPS_TERMINATED_EXIT = 1
MULTI_MIG_DRIVER = 570
# ms: FAKENVML_TIMING's keys (the library's, fakenvml.c, and the two used here) and defaults.
TIMING_H200 = {"init": 9.8, "attach": 6.0, "uuid": 0.09, "memory": 0.05, "procs": 0.3, "by_uuid": 0.01,
               "shutdown": 2.4, "cold": 1000.0, "context": 135.0, "leave": 28.0}
# MiB a CUDA context costs beyond what the program allocates, as NVML's usedGpuMemory shows it
# (REAL-GPU-FACTS.md: 256 MiB allocated showed as 774 MiB, and as 530 MiB for an MPS client; on
# an H200, three driver-API processes each showed 518 MiB as their contexts appeared).
CONTEXT_MIB = 518
MPS_CONTEXT_MIB = 274
GROW_STEP_S = 0.05  # how often a growing program rewrites its registration
MPS_VARIABLES = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
                 "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")


class TopologyError(ValueError):
    """The topology file cannot be read as one."""


def read_timing(value: Optional[str]) -> Dict[str, float]:
    """FAKENVML_TIMING as the library reads it: unset or empty, the H200's costs; "none"
    zeroes them all; then KEY=MS items, comma-separated, override one each."""
    timing = dict(TIMING_H200)
    for item in (value or "").split(",") if value else []:
        if item == "none":
            timing = dict.fromkeys(timing, 0.0)
            continue
        key, eq, ms = item.partition("=")
        try:
            number = float(ms)
        except ValueError:
            number = -1.0
        if not eq or key not in timing or not 0.0 <= number <= 600000.0:
            raise ValueError(f"FAKENVML_TIMING: {item!r} is not none or KEY=MS with KEY one of "
                             f"{', '.join(TIMING_H200)} and MS 0..600000")
        timing[key] = number
    return timing


class Mig(NamedTuple):
    uuid: str
    parent: str
    slot: int
    profile: str
    gi: int
    ci: int
    memory_mib: int
    used_mib: int


class Gpu(NamedTuple):
    uuid: str
    name: str
    memory_mib: int
    mig: str  # "on", "off" or "unsupported"
    pci: str
    used_mib: int
    instances: Tuple[Mig, ...]  # by slot
    cc: Tuple[int, int] = (8, 0)  # CUDA compute capability


class Process(NamedTuple):
    pid: int
    device: str
    memory_mib: int


class Topology(NamedTuple):
    driver: str
    cuda: int
    gpus: Tuple[Gpu, ...]
    processes: Tuple[Process, ...]
    faults: Dict[str, str]  # name -> value ("" when it has none)

    @property
    def driver_major(self) -> int:
        try:
            return int(self.driver.split(".", 1)[0])
        except ValueError:
            return 0

    def lost_gpus(self) -> List[str]:
        value = self.faults.get("gpu_lost", "")
        return [u for u in value.split(",") if u]

    def leaf_uuids(self) -> List[str]:
        """What a program can be given: whole non-MIG GPUs and MIG instances, NVML order."""
        out: List[str] = []
        for gpu in self.gpus:
            if gpu.mig == "on":
                out.extend(m.uuid for m in gpu.instances)
            else:
                out.append(gpu.uuid)
        return out


def split_fields(line: str) -> List[Tuple[str, Optional[str]]]:
    """Words and key=value pairs, as the C parser splits them; '#' outside quotes starts a comment."""
    fields: List[Tuple[str, Optional[str]]] = []
    i, n = 0, len(line)
    while True:
        while i < n and line[i] in " \t\r":
            i += 1
        if i >= n or line[i] == "#":
            return fields
        start = i
        while i < n and line[i] not in "= \t\r#":
            i += 1
        key = line[start:i]
        if not key:
            raise TopologyError("a field has no name")
        if i >= n or line[i] != "=":
            fields.append((key, None))
            continue
        i += 1
        if i < n and line[i] == '"':
            close = line.find('"', i + 1)
            if close < 0:
                raise TopologyError("unterminated quote")
            fields.append((key, line[i + 1 : close]))
            i = close + 1
        else:
            start = i
            while i < n and line[i] not in " \t\r#":
                i += 1
            fields.append((key, line[start:i]))


def parse_topology(text: str) -> Topology:
    """Parse a topology; the C library is the strict judge, this only needs to agree on valid files."""
    driver, cuda = "", 0
    gpus: List[Dict] = []
    by_uuid: Dict[str, Dict] = {}
    processes: List[Process] = []
    faults: Dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        try:
            fields = split_fields(line)
        except TopologyError as e:
            raise TopologyError(f"line {lineno}: {e}") from None
        if not fields:
            continue
        kind = fields[0][0]
        words = [k for k, v in fields[1:] if v is None]
        kv = {k: v for k, v in fields[1:] if v is not None}
        try:
            if kind == "driver":
                driver = words[0]
            elif kind == "cuda":
                cuda = int(words[0])
            elif kind == "fault":
                name = words[0]
                value = words[1] if len(words) > 1 else ""
                if name == "gpu_lost" and faults.get(name):
                    value = faults[name] + "," + value
                faults[name] = value
            elif kind == "gpu":
                gpu = dict(
                    uuid=kv["uuid"],
                    name=kv["name"],
                    memory_mib=int(kv["memory_mib"]),
                    mig=kv.get("mig", "off"),
                    pci=kv.get("pci", f"0000:{len(gpus) + 1:02X}:00.0"),
                    used_mib=int(kv.get("used_mib", "0")),
                    instances={},
                    cc=tuple(int(x) for x in kv.get("cc", "8.0").split(".", 1)),
                )
                gpus.append(gpu)
                by_uuid[gpu["uuid"]] = gpu
            elif kind == "mig":
                parent = by_uuid[kv["parent"]]
                mig = Mig(
                    uuid=kv["uuid"],
                    parent=kv["parent"],
                    slot=int(kv["slot"]),
                    profile=kv["profile"],
                    gi=int(kv["gi"]),
                    ci=int(kv["ci"]),
                    memory_mib=int(kv["memory_mib"]),
                    used_mib=int(kv.get("used_mib", "0")),
                )
                parent["instances"][mig.slot] = mig
            elif kind == "process":
                processes.append(Process(int(kv["pid"]), kv["device"], int(kv["memory_mib"])))
            elif kind == "health":
                pass  # the board's health readings (NVML only): CUDA still sees the GPU
            else:
                raise TopologyError(f"line {lineno}: unknown keyword {kind!r}")
        except (KeyError, IndexError, ValueError) as e:
            if isinstance(e, TopologyError):
                raise
            raise TopologyError(f"line {lineno}: malformed {kind!r} line ({e!r})") from None
    if not driver:
        raise TopologyError("no 'driver VERSION' line")
    frozen = tuple(
        Gpu(
            uuid=g["uuid"],
            name=g["name"],
            memory_mib=g["memory_mib"],
            mig=g["mig"],
            pci=g["pci"],
            used_mib=g["used_mib"],
            instances=tuple(g["instances"][s] for s in sorted(g["instances"])),
            cc=g["cc"],
        )
        for g in gpus
    )
    return Topology(driver, cuda, frozen, tuple(processes), faults)


def read_topology(path: str) -> Topology:
    with open(path, encoding="utf-8") as f:
        return parse_topology(f.read())


def _expand(gpu: Gpu) -> List[str]:
    if gpu.mig == "on":
        return [m.uuid for m in gpu.instances]
    return [gpu.uuid]


def cuda_order(topo: Topology, device_order: str) -> Tuple[Gpu, ...]:
    """The GPUs as CUDA numbers them under CUDA_DEVICE_ORDER=DEVICE_ORDER (PCI_BUS_ID, else FASTEST_FIRST)."""
    if device_order == "PCI_BUS_ID":
        return topo.gpus
    return tuple(sorted(topo.gpus, key=lambda g: (-g.cc[0], -g.cc[1])))  # stable: ties keep NVML order


def _lookup(topo: Topology, entry: str, order: Tuple[Gpu, ...]) -> Optional[List[str]]:
    """The devices one CUDA_VISIBLE_DEVICES entry names, or None when it is invalid."""
    lost = set(topo.lost_gpus())
    if entry and all(c in "0123456789" for c in entry):
        index = int(entry)
        if index >= len(order) or order[index].uuid in lost:
            return None
        return _expand(order[index])
    if entry.startswith("GPU-") and len(entry) > len("GPU-"):
        matches = [g for g in topo.gpus if g.uuid.startswith(entry)]
        if len(matches) != 1 or matches[0].uuid in lost:
            return None
        return _expand(matches[0])
    if entry.startswith("MIG-GPU-"):
        parts = entry[len("MIG-") :].split("/")
        if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
            return None
        for gpu in topo.gpus:
            if gpu.uuid == parts[0] and gpu.uuid not in lost:
                for mig in gpu.instances:
                    if (mig.gi, mig.ci) == (int(parts[1]), int(parts[2])):
                        return [mig.uuid]
        return None
    if entry.startswith("MIG-"):
        for gpu in topo.gpus:
            for mig in gpu.instances:
                if mig.uuid == entry and gpu.uuid not in lost:
                    return [mig.uuid]
    return None


def visible_devices(topo: Topology, cvd: Optional[str], device_order: str = "PCI_BUS_ID") -> List[str]:
    """UUIDs of the devices a CUDA process gets, in CUDA order (rules in the module docstring)."""
    if "driver_not_loaded" in topo.faults:
        return []
    lost = set(topo.lost_gpus())
    chosen: List[str] = []
    order = cuda_order(topo, device_order)
    if cvd is None:
        for gpu in order:
            if gpu.uuid not in lost:
                chosen.extend(_expand(gpu))
    elif cvd.strip():
        for raw in cvd.split(","):
            devices = _lookup(topo, raw.strip(), order)
            if devices is None or any(d in chosen for d in devices):
                break
            chosen.extend(devices)
    if topo.driver_major < MULTI_MIG_DRIVER:
        migs = [d for d in chosen if d.startswith("MIG-")]
        chosen = [d for d in chosen if not d.startswith("MIG-") or d == migs[0]]
    return chosen


def mps_visible(server: Sequence[str], cvd: Optional[str]) -> List[str]:
    """The devices an MPS client sees: its server's, renumbered from 0, narrowed by the
    client's CUDA_VISIBLE_DEVICES (indices into the server's list, UUIDs or GPU- prefixes)."""
    if cvd is None:
        return list(server)
    chosen: List[str] = []
    for raw in cvd.split(","):
        entry = raw.strip()
        found: Optional[str] = None
        if entry and all(c in "0123456789" for c in entry):
            found = server[int(entry)] if int(entry) < len(server) else None
        elif entry.startswith("GPU-") and len(entry) > len("GPU-"):
            matches = [u for u in server if u.startswith(entry)]
            found = matches[0] if len(matches) == 1 else None
        elif entry.startswith("MIG-") and entry in server:
            found = entry
        if found is None or found in chosen:
            break
        chosen.append(found)
    return chosen


class MpsError(Exception):
    """No MPS server for this client."""


def mps_connect(pipe_dir: str) -> Tuple["socket.socket", int, List[str]]:
    """Connect to the control daemon in PIPE_DIR and wait for a server: (connection, server
    pid, the server's devices)."""
    import socket  # only for MPS clients: it costs a few ms of every start

    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.path.join(pipe_dir, "control"))
        conn.sendall(f"CLIENT {os.getpid()}\n".encode())
        reader = conn.makefile("rb")
        while True:
            line = reader.readline().decode(errors="replace").strip()
            if line != "WAIT":  # another user's server still has clients: wait on
                break
    except OSError as e:
        conn.close()
        raise MpsError(f"cannot connect to the MPS control daemon in {pipe_dir}: {e.strerror}") from None
    words = dict(w.split("=", 1) for w in line.split()[1:] if "=" in w)
    if not line.startswith("GO ") or not words.get("server", "").isdigit():
        conn.close()
        raise MpsError(f"the MPS control daemon in {pipe_dir} refused the client: {line or 'no answer'}")
    return conn, int(words["server"]), [d for d in words.get("devices", "").split(",") if d]


# ---- the program ---------------------------------------------------------


def _append_line(path: str, record: Dict) -> None:
    # One write on an O_APPEND descriptor: concurrent writers never interleave.
    data = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _environment_bytes() -> bytes:
    # /proc/self/environ is the block execve() received, byte for byte; os.environb
    # may differ (Python coerces LC_CTYPE under the C locale, PEP 538).
    try:
        with open("/proc/self/environ", "rb") as f:
            return f.read()
    except OSError:
        return b"".join(k + b"=" + v + b"\0" for k, v in os.environb.items())


class Registration:
    """This process as a compute process on its devices, in the fake driver's eyes."""

    def __init__(self) -> None:
        self.path: Optional[str] = None

    def create(self, devices: Sequence[str], memory_mib: int) -> None:
        state = os.environ.get("FAKENVML_STATE")
        if not state or not devices:
            return
        procs = os.path.join(state, "procs")
        os.makedirs(procs, exist_ok=True)
        pid = os.getpid()
        tmp = os.path.join(procs, f".{pid}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(f"{uuid} {memory_mib}\n" for uuid in devices))
        self.path = os.path.join(procs, str(pid))
        os.replace(tmp, self.path)

    def update(self, devices: Sequence[str], memory_mib: int) -> None:
        """Rewrite the figure (a program that allocates more): replaced whole, never half-written."""
        if self.path is not None:
            self.create(devices, memory_mib)

    def remove(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


def leave_orphan(devices: Sequence[str], memory_mib: int, seconds: float) -> int:
    """Fork a child that outlives this process on DEVICES, as a worker a training script
    forgot does: it closes every inherited descriptor (the lease's with them), starts its own
    session, keeps its CUDA context (its own registration) and ends SIGTERM-able after SECONDS."""
    child = os.fork()
    if child:
        return child
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 65536)
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        registration = Registration()
        registration.create(devices, memory_mib)
        time.sleep(seconds)
        registration.remove()
    finally:
        os._exit(0)


def _parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0]), description=__doc__.split("\n")[0])
    parser.add_argument("--hold", type=float, default=0.0, metavar="SECONDS", help="keep the devices this long")
    parser.add_argument("--log", metavar="FILE", help="append a JSON line at start and at end")
    parser.add_argument("--exit", type=int, default=0, metavar="CODE", help="exit status at the end")
    parser.add_argument("--mem", type=int, default=256, metavar="MIB", help="memory allocated on each device")
    parser.add_argument("--context", type=int, default=None, metavar="MIB",
                        help=f"what its context costs on top (default {CONTEXT_MIB}, {MPS_CONTEXT_MIB} as an MPS client)")
    parser.add_argument("--grow", type=float, default=0.0, metavar="MIB_PER_S", help="allocate this much more a second")
    parser.add_argument("--max", type=int, default=0, metavar="MIB", help="stop growing at this allocation (0: never)")
    parser.add_argument("--children", type=int, default=0, metavar="N",
                        help="start N child processes that use the same devices alike (each its own context)")
    parser.add_argument("--stubborn", action="store_true",
                        help="ignore SIGTERM (it and its children), as a program that traps it and carries on")
    parser.add_argument("--escape", action="store_true",
                        help="the children leave this process (double fork): reparented, the lease still open")
    parser.add_argument("--close-fds", action="store_true",
                        help="the children close what they inherited (as subprocess's close_fds does): "
                             "no lease, only descent makes them the program's")
    parser.add_argument("--env-out", metavar="FILE", help="write the environment, NUL-terminated KEY=VALUE")
    parser.add_argument("--orphan", type=float, default=0.0, metavar="SECONDS",
                        help="at the end, leave a child on the devices for SECONDS that closed every "
                             "inherited descriptor (the lease's too); its pid is a second JSON line")
    parser.add_argument("--require", type=int, default=0, metavar="N", help="fail like CUDA with fewer devices")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        timing = read_timing(os.environ.get("FAKENVML_TIMING"))
    except ValueError as e:
        print(f"fakecuda: {e}", file=sys.stderr)
        return 2
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    path = os.environ.get("FAKENVML_TOPOLOGY")
    driver: Optional[str] = None
    devices: List[str] = []
    if path:
        try:
            topo = read_topology(path)
        except (OSError, TopologyError) as e:
            print(f"fakecuda: {path}: {e}", file=sys.stderr)
            return 2
        driver = topo.driver
        devices = visible_devices(topo, cvd, os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST"))

    if args.env_out:
        with open(args.env_out, "wb") as f:
            f.write(_environment_bytes())

    pid = os.getpid()
    mps = {k: os.environ[k] for k in MPS_VARIABLES if k in os.environ} or None
    ready = {"pid": pid, "argv": sys.argv, "cvd": cvd, "devices": devices, "driver": driver, "mps": mps,
             "mps_server": None}
    client: Optional["socket.socket"] = None
    if os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        try:
            client, ready["mps_server"], served = mps_connect(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
        except MpsError as e:
            print(json.dumps(dict(ready, error="cudaErrorDevicesUnavailable")), flush=True)
            print(f"CUDA error: all CUDA-capable devices are busy or unavailable "
                  f"(cudaErrorDevicesUnavailable): {e}", file=sys.stderr)
            return MPS_UNAVAILABLE_EXIT
        devices = ready["devices"] = mps_visible(served, cvd)
    hello = json.dumps(ready)
    if len(devices) < args.require:
        print(hello, flush=True)
        print(
            f"CUDA error: no CUDA-capable device is detected (cudaErrorNoDevice): "
            f"needs {args.require} device(s), CUDA_VISIBLE_DEVICES={cvd!r} gives {len(devices)}",
            file=sys.stderr,
        )
        return NO_DEVICE_EXIT

    registration = Registration()
    usage = Usage(args, client is not None)
    children: List[int] = []

    def finish(**how: int) -> None:
        registered = registration.path is not None
        registration.remove()
        _end_children(children)
        if args.log:
            _append_line(args.log, dict(pid=pid, event="end", time=time.time(), devices=devices, **how))
        if registered:
            time.sleep(timing["leave"] / 1000.0)  # gone from NVML's list before the process is

    def on_signal(signum: int, _frame: object) -> None:
        finish(signal=signum)
        # Die of the signal itself, so the parent sees what it would see with a real program.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(pid, signum)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.stubborn else on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if devices:  # NVML lists a CUDA process once its context exists
        time.sleep(max(0.0, STARTED + timing["context"] / 1000.0 - time.monotonic()))
    registration.create(devices, usage.at(0.0))
    if devices and args.children > 0:
        children.extend(_start_children(args, devices, usage))
        ready["children"] = children
        hello = json.dumps(ready)
    if args.log:
        _append_line(args.log, dict(pid=pid, event="start", time=time.time(), devices=devices))
    print(hello, flush=True)
    if client is not None:
        # Connected for as long as it runs; the daemon closing its end ends the client.
        if _hold(args.hold, registration, devices, usage, client):
            finish(exit=MPS_TERMINATED_EXIT)
            print("CUDA error: the MPS client has been terminated by the server "
                  "(cudaErrorMpsClientTerminated)", file=sys.stderr)
            return MPS_TERMINATED_EXIT
    elif args.hold > 0:
        _hold(args.hold, registration, devices, usage, None)
    if args.orphan > 0 and devices:
        print(json.dumps({"orphan": leave_orphan(devices, args.mem, args.orphan)}), flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    finish(exit=args.exit)
    return args.exit


class Usage:
    """What the program's context shows in NVML over time: its allocation (--mem, growing by
    --grow MiB a second up to --max) plus what the context itself costs."""

    def __init__(self, args: argparse.Namespace, mps_client: bool) -> None:
        self.mem, self.grow, self.max = args.mem, args.grow, args.max
        default = MPS_CONTEXT_MIB if mps_client else CONTEXT_MIB
        self.context = default if args.context is None else args.context

    def at(self, elapsed: float) -> int:
        allocated = self.mem + self.grow * max(elapsed, 0.0)
        if self.max > 0:
            allocated = min(allocated, max(self.max, self.mem))
        return int(allocated) + self.context


def _hold(seconds: float, registration: Registration, devices: Sequence[str], usage: Usage,
          client: Optional["socket.socket"]) -> bool:
    """Hold the devices SECONDS, growing as USAGE says; True when the MPS daemon dropped CLIENT."""
    import select

    began = time.monotonic()
    deadline = began + max(seconds, 0.0)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        step = min(left, GROW_STEP_S) if usage.grow else left
        if client is not None:
            if select.select([client], [], [], step)[0] and not client.recv(1):
                return True
        else:
            time.sleep(step)
        if usage.grow:
            registration.update(devices, usage.at(time.monotonic() - began))


def _start_children(args: argparse.Namespace, devices: Sequence[str], usage: Usage) -> List[int]:
    """Fork --children processes that each make a context on DEVICES and hold them like this one;
    with --escape each is forked twice, so that it is no child of ours (its parent is gone).
    Returns their pids once each is registered."""
    read_end, write_end = os.pipe()
    for _ in range(args.children):
        first = os.fork()
        if first == 0:
            os.close(read_end)
            if args.escape and os.fork() != 0:
                os._exit(0)
            _child(args, devices, usage, write_end)
        if args.escape:
            os.waitpid(first, 0)
    os.close(write_end)
    pids: List[int] = []
    with os.fdopen(read_end, "rb") as ready:
        for line in ready:
            pids.append(int(line))
            if len(pids) == args.children:
                break
    return pids


def _child(args: argparse.Namespace, devices: Sequence[str], usage: Usage, ready: int) -> None:
    """A child's life: register, say so, hold as its parent does; never returns."""
    registration = Registration()

    def on_signal(signum: int, _frame: object) -> None:
        registration.remove()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, signal.SIG_IGN if args.stubborn else on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if args.close_fds:
        os.closerange(3, ready)
        os.closerange(ready + 1, os.sysconf("SC_OPEN_MAX"))
    registration.create(devices, usage.at(0.0))
    os.write(ready, f"{os.getpid()}\n".encode())
    os.close(ready)
    _hold(args.hold, registration, devices, usage, None)
    registration.remove()
    os._exit(0)


def _end_children(children: Sequence[int]) -> None:
    """End the children with their parent, as a program's workers end with it."""
    for child in children:
        try:
            os.kill(child, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for child in children:
        try:
            os.waitpid(child, 0)
        except ChildProcessError:  # an escaped one: its new parent reaps it
            while os.path.exists(f"/proc/{child}") and _state(child) not in ("Z", "X", ""):
                time.sleep(0.01)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""

if __name__ == "__main__":
    sys.exit(main())
