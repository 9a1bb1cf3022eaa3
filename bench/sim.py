"""The simulated machine the benchmark runs on, with cudawrap installed and the peers beside it.

Everything lives under one work directory: the fake ``libnvidia-ml.so.1`` built from
``tests/fakenvml``, one FakeMachine per topology, cudawrap installed once by its own
``install.sh --prefix`` (so launches run the shim, interpreter and package an admin
gets; every machine re-syncs that install with the installed ``cudawrap sync``), and a
bin directory per machine with the programs the tools launch, wrapped by the installed
``create-cudawrap``:

* ``true`` -- a tiny C program (``bench/true.c``) that exits at once: launch overhead and
  the shim's peak RSS (exec keeps the process, so its max RSS is the shim's);
* ``fakecuda`` -- the stand-in CUDA program (``tests/support/fakecuda.py``), run directly;
* ``true-w`` and ``job`` -- the same two, wrapped by ``create-cudawrap``;
* ``nvidia-smi`` and ``getgpu`` -- the stand-ins for the seed's script (``bench/peers``).

The peers are launched the way their documentation says:
``gpuselect -- CMD``, ``CUDA_VISIBLE_DEVICES=$(nvisel ...) CMD`` and
``CUDA_VISIBLE_DEVICES=$(getgpu) CMD``.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TESTS = REPO / "tests"
PEERS_DIR = BENCH / "peers"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from support.machine import FAKECUDA, FakeMachine, build_fakenvml, preload  # noqa: E402

from cudawrap.paths import Layout  # noqa: E402

# "cudawrap+monitor" is cudawrap with `cudawrap monitor` running beside it, keeping the
# snapshot that lets launches skip pynvml and NVML; plain "cudawrap" has no monitor.
TOOLS = ("cudawrap", "cudawrap+monitor", "gpuselect", "gpuselect-in-script", "nvisel", "getgpu")
MONITORED = "cudawrap+monitor"
# Environment variables that must not leak from the caller into a measured launch.
_SCRUB = ("CUDA_VISIBLE_DEVICES", "CUDAWRAP_LEASE", "CUDAWRAP_WAIT", "CUDAWRAP_VERBOSE",
          "CUDAWRAP_DEBUG", "CUDAWRAP_ROOT", "SLURM_JOB_ID", "PYTHONPATH", "PYTHONHOME",
          "PYTHONPROFILEIMPORTTIME", "PYTHONSTARTUP")
# Memory the stand-in claims on its device in bursts: nvisel's free-memory threshold is
# set between "idle" and "one job on it", so nvisel can tell busy from free.
JOB_MEM_MIB = 2048


class Peers:
    """Where the peers live; None fields are peers that could not be set up."""

    def __init__(self, gpuselect_python: Optional[str], nvisel: Optional[str], notes: List[str]) -> None:
        self.gpuselect_python = gpuselect_python
        self.nvisel = nvisel
        self.notes = notes

    def available(self) -> List[str]:
        out = ["cudawrap", MONITORED, "getgpu"]
        if self.gpuselect_python:
            out += ["gpuselect", "gpuselect-in-script"]
        if self.nvisel:
            out.append("nvisel")
        return [t for t in TOOLS if t in out]


def find_peers(venv: Path, install: bool) -> Peers:
    """gpuselect from the bench's own venv (created here if INSTALL), nvisel from ours.

    gpuselect pins nvidia-ml-py==12.560.30, so it must not go into the dev venv (which
    has the newer nvidia-ml-py cudawrap is tested with): it gets a venv of its own under
    bench/results/ (gitignored), which also gets matplotlib for the plots.
    """
    notes: List[str] = []
    python = venv / "bin" / "python"
    if not python.exists() and install:
        notes.append(f"created {venv} (pip install gpuselect==0.1.4 matplotlib)")
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "gpuselect==0.1.4", "matplotlib"],
                           check=True, capture_output=True, timeout=600)
        except (subprocess.SubprocessError, OSError) as exc:
            notes.append(f"could not set up the peers venv: {exc}")
    gpuselect_python: Optional[str] = None
    if python.exists():
        check = subprocess.run([str(python), "-c", "import gpuselect"], capture_output=True)
        if check.returncode == 0:
            gpuselect_python = str(python)
        else:
            notes.append(f"gpuselect is not importable in {venv}")
    else:
        notes.append("gpuselect skipped: no peers venv (run without --no-install to create it)")
    nvisel = shutil.which("nvisel", path=str(Path(sys.executable).parent)) or shutil.which("nvisel")
    if not nvisel:
        notes.append("nvisel skipped: nvitop is not installed in this interpreter's environment")
    return Peers(gpuselect_python, nvisel, notes)


def build_c(out_dir: Path, name: str) -> Path:
    """Compile bench/NAME.c into OUT_DIR/NAME."""
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / name
    cc = shlex.split(os.environ.get("CC", "cc"))
    subprocess.run(cc + ["-O2", "-Wall", "-o", str(exe), str(BENCH / f"{name}.c")], check=True)
    return exe


def _install_script(src: Path, dst: Path, shebang: Optional[str] = None) -> Path:
    """Copy SRC to DST, executable; a Python script gets SHEBANG baked in (no `env`)."""
    text = src.read_bytes()
    if shebang is not None and text.startswith(b"#!"):
        text = shebang.encode() + b"\n" + text.split(b"\n", 1)[1]
    dst.write_bytes(text)
    dst.chmod(0o755)
    return dst


class Install:
    """cudawrap installed by ``install.sh --prefix ROOT``, and the interpreter its shim runs.

    The interpreter is read from the installed shim's ``#!`` line: that is what every
    launch really starts, so every ratio is taken against it. install.sh makes its venv
    with PYTHON (default: ``python3`` on PATH, as install.sh itself picks).
    """

    def __init__(self, root: Path, python: Optional[str] = None) -> None:
        self.root = root
        self.layout = Layout(root)
        cmd = ["bash", str(REPO / "install.sh"), "--prefix", str(root)]
        if python:
            cmd += ["--python", python]
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB and k != "VIRTUAL_ENV"}
        started = time.monotonic()
        done = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"install.sh --prefix {root} failed ({done.returncode}): {done.stderr[-2000:]}")
        self.install_s = round(time.monotonic() - started, 1)
        self.cudawrap = str(root / "usr/local/bin/cudawrap")
        self.create = str(root / "usr/local/bin/create-cudawrap")
        with open(self.layout.shim, encoding="utf-8") as f:
            first = f.readline()
        self.python = shlex.split(first[2:])[0]  # "#!/…/venv/bin/python -IS"
        picked = python or shutil.which("python3") or "python3"
        version = subprocess.run([self.python, "-IS", "-c", "import sys; print(sys.version.split()[0])"],
                                 capture_output=True, text=True).stdout.strip()
        self.describe = {
            "python": self.python, "resolves_to": os.path.realpath(self.python), "version": version,
            "how_found": f"the `#!` line of the installed shim {self.layout.shim}; install.sh made that venv "
                         f"with {'--python ' + python if python else 'python3 on PATH'} ({picked})",
            "install_sh_s": self.install_s,
        }


def stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM, then SIGKILL after GRACE s; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def monitor_nice(layout: Layout) -> int:
    """The Nice= of the monitor's systemd unit as install.sh writes it (0 if it sets none)."""
    from cudawrap.install.installation import render_monitor_unit

    for line in render_monitor_unit(layout).splitlines():
        if line.startswith("Nice="):
            return int(line.split("=", 1)[1])
    return 0


class Sim:
    """One simulated machine with cudawrap installed and every tool ready to launch."""

    def __init__(self, work: Path, lib_dir: Path, true_exe: Path, topology: str, peers: Peers,
                 install: Install, hold_exe: Optional[Path] = None, nvml_timing: str = "") -> None:
        self.work = work
        self.topology_name = topology
        self.peers = peers
        self.install = install
        work.mkdir(parents=True, exist_ok=True)
        self.machine = FakeMachine(work / "machine", lib_dir)
        # What an NVIDIA H200 costs (tests/fakenvml/FORMAT.md), whatever the caller's environment
        # says: NVML calls, a CUDA context's creation, a process leaving NVML's list. NVML_TIMING
        # "none" (run.py --nvml-timing none) charges nothing: the launch's own cost, comparable
        # with figures taken before the stand-in charged an H200's.
        self.machine.env["FAKENVML_TIMING"] = nvml_timing
        self.machine.load(topology)
        # One install serves every machine in turn: sync makes its lease files this
        # machine's (the last machine's devices vanished, nobody holds them).
        self.layout = install.layout
        self.bindir = work / "bin"
        self.bindir.mkdir(exist_ok=True)
        self.sync()
        # The stand-in runs with the shim's interpreter; it needs only the standard library.
        shebang = f"#!{install.python} -IS"
        self.true = self.bindir / "true"
        shutil.copy2(true_exe, self.true)
        self.fakecuda = _install_script(FAKECUDA, self.bindir / "fakecuda", shebang)
        self.true_wrapped = self._wrap("true-w", self.true)
        self.job_wrapped = self._wrap("job", self.fakecuda)
        self.hold = self.hold_wrapped = None
        if hold_exe is not None:
            self.hold = self.bindir / "hold"
            shutil.copy2(hold_exe, self.hold)
            self.hold_wrapped = self._wrap("hold-w", self.hold)
        # nvidia-smi needs pynvml, which this interpreter's site-packages has: no -S.
        _install_script(PEERS_DIR / "nvidia-smi", self.bindir / "nvidia-smi", f"#!{sys.executable} -I")
        _install_script(PEERS_DIR / "getgpu", self.bindir / "getgpu")
        topo = self.machine.parse()
        leaves = []
        for gpu in topo.gpus:
            if gpu.mig == "on":
                leaves.extend(gpu.instances)
            else:
                leaves.append(gpu)
        self._leaves = leaves
        self.devices = len(leaves)
        self.leaf_uuids = topo.leaf_uuids()
        # Free means "less than half a job's memory in use" for nvisel.
        self.nvisel_free_mib = min(leaf.memory_mib - leaf.used_mib for leaf in leaves) - JOB_MEM_MIB // 2

    # ---- cudawrap --------------------------------------------------------------

    def _wrap(self, name: str, program: Path) -> Path:
        """A copy of PROGRAM named NAME, wrapped by the installed create-cudawrap."""
        link = self.bindir / name
        shutil.copy2(program, link)
        link.chmod(0o755)
        self._admin([self.install.create, str(link)])
        return link

    def _admin(self, argv: List[str]) -> None:
        done = subprocess.run(argv, env=self.machine.environ(), capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr[-1000:]}")

    def activate(self) -> None:
        """Point this process at the machine (for holding leases by hand)."""
        os.environ.update(self.machine.environ())
        preload(self.machine.lib_dir)

    def sync(self) -> None:
        self.activate()
        self._admin([self.install.cudawrap, "sync"])

    @contextlib.contextmanager
    def monitor(self, enabled: bool = True) -> Iterator[None]:
        """`cudawrap monitor` running for the duration (as root runs the service).

        Waits for its first snapshot. With ENABLED false, does nothing.
        """
        if not enabled:
            yield
            return
        snap = self.layout.usage_snapshot
        try:
            snap.unlink()
        except FileNotFoundError:
            pass
        # At the priority the installed service gives it (its unit's Nice=), as root runs it.
        proc = subprocess.Popen(["nice", "-n", str(monitor_nice(self.layout)), self.install.cudawrap, "monitor"],
                                env=self.machine.environ(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.monitor_pid = proc.pid
        try:
            deadline = time.monotonic() + 60
            while not snap.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise RuntimeError(f"cudawrap monitor did not write a snapshot: {err[-500:]}")
                time.sleep(0.02)
            yield
        finally:
            stop(proc, 10)
            try:
                snap.unlink()  # later launches must not use a snapshot nobody refreshes
            except FileNotFoundError:
                pass

    def set_fault(self, name: str, value: str) -> None:
        self.machine.set_fault(name, value)

    def clear_fault(self, name: str) -> None:
        self.machine.clear_fault(name)

    # ---- launching -------------------------------------------------------------

    def environ(self) -> Dict[str, str]:
        env = self.machine.environ()
        for key in _SCRUB:
            env.pop(key, None)
        env["PATH"] = f"{self.bindir}:/usr/bin:/bin"
        return env

    def argv(self, tool: str, program: str, args: List[str]) -> List[str]:
        """The command line that launches PROGRAM ("true", "job" or "hold") with ARGS through TOOL.

        "direct" runs the program itself; "cudawrap" its wrapped name. The peers pick a
        device and start the unwrapped program with CUDA_VISIBLE_DEVICES set.
        """
        plain = str({"true": self.true, "hold": self.hold}.get(program, self.fakecuda))
        if tool == "direct":
            return [plain] + args
        if tool in ("cudawrap", MONITORED):
            return [str({"true": self.true_wrapped, "hold": self.hold_wrapped}.get(program, self.job_wrapped))] + args
        if tool == "gpuselect":
            if not self.peers.gpuselect_python:
                raise LookupError("gpuselect is not available")
            return [self.peers.gpuselect_python, str(PEERS_DIR / "gpuselect_compat.py"), "--", plain] + args
        if tool == "gpuselect-in-script":
            # The job's own script calls gpuselect() first; `true` is then an empty script.
            if not self.peers.gpuselect_python:
                raise LookupError("gpuselect is not available")
            job = [] if program == "true" else [plain] + args
            return [self.peers.gpuselect_python, str(PEERS_DIR / "gpuselect_inscript.py")] + job
        if tool == "nvisel":
            if not self.peers.nvisel:
                raise LookupError("nvisel is not available")
            return ["/bin/sh", "-c", f'{self.nvisel_command()} exec "$@"', "sh", plain] + args
        if tool == "getgpu":
            return ["/bin/sh", "-c", 'CUDA_VISIBLE_DEVICES=$(getgpu) exec "$@"', "sh", plain] + args
        raise ValueError(f"unknown tool {tool}")

    def nvisel_command(self) -> str:
        """nvisel as its documentation's example: `export CUDA_DEVICE_ORDER="PCI_BUS_ID"
        CUDA_VISIBLE_DEVICES="$(nvisel -c 1 -f 10GiB)"`, with -f between idle and busy.

        -C 1 as well: -c 1 alone prints every device that qualifies, and a one-device job
        (the stand-in takes every device it is shown) must be given the one it will use.
        --tolerance stays 0 (strict): see nvisel_threshold for the tolerance that would
        let a busy device pass.
        """
        pick = f"{shlex.quote(str(self.peers.nvisel))} -c 1 -C 1 -f {self.nvisel_free_mib}MiB 2>/dev/null"
        return f'CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES="$({pick})"'

    def nvisel_threshold(self) -> dict:
        """Whether nvisel's -f threshold separates an idle device from one running a job."""
        idle = [leaf.memory_mib - leaf.used_mib for leaf in self._leaves]
        busy = [m - JOB_MEM_MIB for m in idle]
        f = self.nvisel_free_mib
        # nvisel accepts free >= f × (1 - tolerance/100): the smallest tolerance that would
        # let the busiest-looking busy device through.
        tolerance = min(100.0 * (1 - b / f) for b in busy)
        return {"min_free_mib": f, "idle_free_mib_min": min(idle), "busy_free_mib_max": max(busy),
                "separates": min(idle) >= f > max(busy), "tolerance_that_breaks_it_pct": round(tolerance, 1)}

    def job_args(self, hold: float, log: Path) -> List[str]:
        """The stand-in's arguments in bursts: it fails (exit 100, no log) without a device."""
        return ["--require", "1", "--hold", f"{hold:g}", "--log", str(log), "--mem", str(JOB_MEM_MIB)]


class Bench:
    """Shared state of one benchmark run: the work directory, the library, the peers."""

    def __init__(self, work: Path, peers: Peers, install: Optional[Install] = None, nvml_timing: str = "") -> None:
        self.work = work
        self.nvml_timing = nvml_timing
        self.install = install or Install(work / "install")
        self.lib_dir = build_fakenvml(work / "fakenvml")
        self.true_exe = build_c(work / "cbin", "true")
        self.maxrss = build_c(work / "cbin", "maxrss")
        self.hold_exe = build_c(work / "cbin", "hold")
        self.peers = peers
        self._count = 0
        self._others: Dict[str, Install] = {}

    def sim(self, topology: str, install: Optional[Install] = None) -> Sim:
        """A fresh machine for the install (INSTALL, or the run's own): nothing held, nothing queued."""
        self._count += 1
        return Sim(self.work / f"sim{self._count}-{Path(topology).stem}", self.lib_dir, self.true_exe, topology, self.peers,
                   install or self.install, self.hold_exe, self.nvml_timing)

    def other_install(self, name: str) -> Install:
        """A second install beside the run's own, made once (NAME: its directory under the work
        directory), with the same interpreter: for figures of two configurations side by side."""
        if name not in self._others:
            self._others[name] = Install(self.work / name, self.install.describe["resolves_to"])
        return self._others[name]
