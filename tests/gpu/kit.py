#!/usr/bin/env python3
"""The real-GPU kit: cudawrap's promises checked on this machine's GPU, as root, offline.

It installs cudawrap into a temporary prefix and checks, on this machine's GPU, the
behaviours users rely on. README.md beside this file says how to run it.

One line per check on stdout (``PASS name: detail``, ``FAIL name: detail``, ``SKIP name:
why``) and, with ``--report FILE``, a JSON report. Exit 0 when no check failed, 1 when one
did or the install failed, 64 bad usage, 69 no probe could be built or run, 70 a bug of the
kit's (traceback on stderr), 77 not root, 130 interrupted.

Standard library only, Python 3.9+, run as root (it creates two temporary accounts). It
removes what it made (the prefix, the accounts, its processes) at the end, even on failure.
"""
from __future__ import annotations

import argparse
import json
import os
import pwd
import re
import secrets
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
SOURCE = HERE.parent.parent  # the cudawrap checkout the kit belongs to
PROBE_SRC = HERE / "probe.c"
TRUE_SRC = SOURCE / "bench" / "true.c"  # the trivial program the launch benchmarks time
EX_USAGE, EX_UNAVAILABLE, EX_NOPERM = 64, 69, 77
# The machine's, not an install's: the claims directory of a simulated machine (CI) stays.
CLAIMS_ENV = "CUDAWRAP_DEVICE_CLAIMS"
EXIT_BUSY = 75  # a wrapped run that got no device
WAIT = "60"  # CUDAWRAP_WAIT of every wrapped run: no check can hang on a lost turn
ALL_CHECKS = ("lease", "burst", "kill9", "foreign", "foreign-monitor", "accounts", "drain", "slots", "mps",
              "torch", "overhead", "overhead-monitor", "overhead-service", "stall", "confine")
STALL_LIMIT_S = 0.25  # issue 31: slowest launch after a foreign exit, over the normal launch
HOLD_S = 60.0  # the holder's hold in kill9: the waiter starting long before that was freed by the kill
CHECK_LIMIT_S = {"torch": 240.0}  # each check's time limit; others get DEFAULT_LIMIT_S
DEFAULT_LIMIT_S = 90.0

TORCH_SCRIPT = """\
#!{python}
import json, os, sys, time
start = time.time()
import torch
x = torch.ones(1024, 1024, device="cuda")
total = float((x @ x).sum().item())
props = torch.cuda.get_device_properties(0)
print(json.dumps({{"pid": os.getpid(), "uid": os.getuid(), "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
                  "uuid": str(getattr(props, "uuid", "")), "name": props.name, "count": torch.cuda.device_count(),
                  "sum": total, "start": start, "end": time.time()}}))
"""


class CheckFailed(Exception):
    """A check's expectation did not hold; the message is its FAIL detail."""


class TimedOut(CheckFailed):
    """A check ran past its time limit."""


class Skipped(Exception):
    """A check cannot run here; the message says why."""


def hex_of(uuid: Optional[str]) -> str:
    """The hex digits of a GPU or MIG UUID without its prefix: CUDA's UUIDs have none."""
    text = (uuid or "").lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return re.sub(r"[^0-9a-f]", "", text)


def overlaps(runs: Sequence[Dict[str, Any]], since: str = "start") -> int:
    """The most runs that were running at one instant (probe SINCE..end intervals)."""
    events = sorted([(r[since], 1) for r in runs] + [(r["end"], -1) for r in runs], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def median_ms(values: Sequence[float]) -> str:
    return ms(statistics.median(values)) if values else "n/a"


class Run:
    """One started program; its probe JSON once finished."""

    def __init__(self, proc: subprocess.Popen, spawned: float, ready: Optional[Path]) -> None:
        self.proc = proc
        self.spawned = spawned
        self.ready = ready
        self.rc: Optional[int] = None
        self.out = ""
        self.err = ""
        self.result: Optional[Dict[str, Any]] = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> int:
        """The probe's pid once its contexts exist (its --ready file); CheckFailed otherwise."""
        assert self.ready is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                text = self.ready.read_text().strip()
                if text.isdigit():
                    return int(text)
            except FileNotFoundError:
                pass
            if self.proc.poll() is not None:
                self.finish(5)
                raise CheckFailed(f"pid {self.pid} exited {self.rc} before it was ready: {self.tail()}")
            time.sleep(0.005)
        raise CheckFailed(f"pid {self.pid} not ready after {timeout:.0f} s")

    def finish(self, timeout: float) -> "Run":
        if self.rc is None:
            try:
                self.out, self.err = self.proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise CheckFailed(f"pid {self.pid} still running after {timeout:.0f} s") from None
            self.rc = self.proc.returncode
            for line in reversed(self.out.splitlines()):
                try:
                    self.result = json.loads(line)
                    break
                except ValueError:
                    continue
        return self

    def tail(self) -> str:
        text = (self.err.strip() or self.out.strip()).splitlines()
        return text[-1] if text else "no output"

    def ok(self) -> Dict[str, Any]:
        """Its probe result, or CheckFailed when it did not run to a clean end."""
        if self.rc != 0 or self.result is None or self.result.get("error"):
            raise CheckFailed(f"pid {self.pid} exit {self.rc}: {self.tail()}")
        return self.result


class Kit:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # Short: MPS's pipe directory under the prefix must fit a unix socket's 108 bytes.
        self.base = Path(tempfile.mkdtemp(prefix="cwkit-", dir="/tmp"))
        self.base.chmod(0o755)  # the accounts run the programs and the install from here
        self.bin = self.base / "bin"
        self.work = self.base / "work"
        self.bin.mkdir(mode=0o755)
        self.work.mkdir()
        self.work.chmod(0o1777)  # ready files of every account
        self.root = Path(args.root) if args.root else self.base / "r"
        self.installed = False
        self.runs: List[Run] = []
        self.users: List[Tuple[str, int, int]] = []
        self.wrapped: List[Path] = []
        self.config_saved: Optional[str] = None
        self.results: List[Dict[str, Any]] = []
        self.info: Dict[str, Any] = {}
        self.target = ""
        self.confining = False  # the confine check changed [confine]: its nodes are put back at cleanup
        self.counter = 0
        self.deadline = time.monotonic() + args.budget

    # ---- paths and environments -----------------------------------------------------

    @property
    def cudawrap(self) -> str:
        return str(self.root / "usr/local/bin/cudawrap")

    @property
    def vpy(self) -> str:
        return str(self.root / "opt/cudawrap/venv/bin/python")

    @property
    def config(self) -> Path:
        return self.root / "etc/cudawrap/config.toml"

    def env(self, **extra: str) -> Dict[str, str]:
        """This process's environment without anything of cudawrap or CUDA's, plus EXTRA."""
        env = {k: v for k, v in os.environ.items() if k == CLAIMS_ENV or (
               not k.startswith(("CUDAWRAP_", "CUDA_MPS_")) and k not in ("CUDA_VISIBLE_DEVICES", "PYTHONPATH",
                                                                          "VIRTUAL_ENV"))}
        env["CUDAWRAP_WAIT"] = WAIT
        env.update(extra)
        return env

    def pinned(self, **extra: str) -> Dict[str, str]:
        """Runs that must compete for one device all ask for the kit's device."""
        return self.env(CUDA_VISIBLE_DEVICES=self.target, **extra)

    def ready_file(self) -> Path:
        self.counter += 1
        return self.work / f"ready-{self.counter}"

    # ---- processes --------------------------------------------------------------------

    def start(self, argv: Sequence[str], env: Dict[str, str], user: Optional[Tuple[str, int, int]] = None,
              ready: bool = False) -> Run:
        path = self.ready_file() if ready else None
        cmd = list(argv) + (["--ready", str(path)] if path else [])
        if user:
            cmd = ["setpriv", f"--reuid={user[1]}", f"--regid={user[2]}", "--clear-groups", "--"] + cmd
        spawned = time.time()
        # A session of its own: the cleanup can kill whatever it started, whoever it runs as.
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=str(self.work))
        run = Run(proc, spawned, path)
        self.runs.append(run)
        return run

    def wrapped_probe(self, *args: str, env: Optional[Dict[str, str]] = None, **kw: Any) -> Run:
        return self.start([str(self.bin / "cw-probe"), *args], env or self.pinned(), **kw)

    def direct_probe(self, *args: str, env: Optional[Dict[str, str]] = None, **kw: Any) -> Run:
        return self.start([str(self.bin / "probe"), *args], env or self.pinned(), **kw)

    def cli(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run([self.cudawrap, *args], env=self.env(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
        if check and done.returncode != 0:
            lines = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()
            raise CheckFailed(f"cudawrap {' '.join(args)}: exit {done.returncode}: {lines[-1]}")
        return done

    def reap(self) -> None:
        for run in self.runs:
            if run.proc.poll() is None:
                try:
                    os.killpg(run.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                run.proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError, OSError):
                pass
        self.runs = [r for r in self.runs if r.proc.poll() is None]

    # ---- set-up -----------------------------------------------------------------------

    def build(self) -> None:
        """The probe (run directly), a copy of it to wrap, and a trivial program to wrap."""
        cc = shlex.split(os.environ.get("CC", "cc"))
        for source, out, libs in ((PROBE_SRC, "probe", ["-ldl"]), (TRUE_SRC, "cw-true", [])):
            if self.args.prebuilt:  # built on another machine: this one has no C compiler
                built = Path(self.args.prebuilt) / ("true" if out == "cw-true" else out)
                if not os.access(built, os.X_OK):
                    raise SystemExit(self.fatal(EX_USAGE, f"--prebuilt {self.args.prebuilt}: no executable {built}"))
                shutil.copy2(built, self.bin / out)
                continue
            if not shutil.which(cc[0]):
                raise SystemExit(self.fatal(EX_UNAVAILABLE, f"no C compiler ({cc[0]}) to build the probe: install "
                                                            f"one, or build it elsewhere and give --prebuilt DIR "
                                                            f"(tests/gpu/README.md)"))
            done = subprocess.run(cc + ["-O2", "-o", str(self.bin / out), str(source)] + libs, capture_output=True,
                                  text=True, timeout=120)
            if done.returncode != 0:
                raise SystemExit(self.fatal(EX_UNAVAILABLE, f"cannot build {source} with {' '.join(cc)}: "
                                                            f"{done.stderr.strip()[-300:]}"))
            (self.bin / out).chmod(0o755)
        shutil.copy2(self.bin / "probe", self.bin / "cw-probe")

    def install(self) -> None:
        if self.args.root:
            if not os.access(self.cudawrap, os.X_OK):
                raise SystemExit(self.fatal(EX_USAGE, f"--root {self.root}: no cudawrap install there "
                                                      f"({self.cudawrap} is missing)"))
            return
        cmd = ["bash", str(SOURCE / "install.sh"), "--prefix", str(self.root)]
        if self.args.wheelhouse:
            cmd += ["--wheelhouse", self.args.wheelhouse]
        if self.args.python:
            cmd += ["--python", self.args.python]
        began = time.monotonic()
        done = subprocess.run(cmd, env=self.env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=300)
        self.info["install_seconds"] = round(time.monotonic() - began, 1)
        if done.returncode != 0:
            sys.stdout.write(done.stdout)
            raise SystemExit(self.fatal(1, f"install.sh failed (exit {done.returncode}); its output is above"))
        self.installed = True

    def wrap(self) -> None:
        for name in ("cw-probe", "cw-true") + (("cw-torch",) if (self.bin / "cw-torch").exists() else ()):
            done = subprocess.run([str(self.root / "usr/local/bin/create-cudawrap"), str(self.bin / name)],
                                  env=self.env(), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=60)
            if done.returncode != 0:
                raise SystemExit(self.fatal(1, f"create-cudawrap {self.bin / name}: exit {done.returncode}: "
                                               f"{done.stderr.strip()[-300:]}"))
            self.wrapped.append(self.bin / name)

    def machine(self) -> None:
        """What the GPU machine is (for the report), and the device the kit competes for."""
        code = ("import json, sys, pynvml as n; n.nvmlInit(); "
                "print(json.dumps({'venv_python': sys.version.split()[0], 'driver': n.nvmlSystemGetDriverVersion(), "
                "'cuda': n.nvmlSystemGetCudaDriverVersion(), 'count': n.nvmlDeviceGetCount(), "
                "'gpus': [[n.nvmlDeviceGetName(h), n.nvmlDeviceGetUUID(h), n.nvmlDeviceGetMemoryInfo(h).total >> 20] "
                "for h in (n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount()))]}))")
        done = subprocess.run([self.vpy, "-I", "-c", code], env=self.env(), capture_output=True, text=True, timeout=60)
        if done.returncode == 0:
            self.info.update(json.loads(done.stdout))
        else:
            self.info["nvml_error"] = (done.stderr.strip().splitlines() or ["?"])[-1]
        direct = self.direct_probe(env=self.env()).finish(60)
        if direct.rc != 0 or not direct.result or not direct.result.get("devices"):
            raise SystemExit(self.fatal(EX_UNAVAILABLE, f"the probe run directly found no CUDA device: exit "
                                                        f"{direct.rc}: {direct.tail()}"))
        first = direct.result["devices"][0]
        known = [g[1] for g in self.info.get("gpus", [])]
        self.target = next((u for u in known if hex_of(u) == hex_of(first)), first)
        self.info.update(cuda_devices=direct.result["devices"], target=self.target, host=socket.gethostname(),
                         python=sys.version.split()[0], kernel=os.uname().release, commit=self.commit())
        # Another install on this machine may manage the device (its claim): then no check can run.
        trial = self.start([str(self.bin / "cw-true")], self.pinned(CUDAWRAP_WAIT="0")).finish(60)
        if trial.rc != 0:
            sync = self.cli("sync", check=False)
            said = " / ".join((sync.stdout + sync.stderr).strip().splitlines()[-3:])
            raise SystemExit(self.fatal(EX_UNAVAILABLE, f"a wrapped run cannot lease {self.target}: exit {trial.rc}: "
                                                        f"{trial.tail()}; `cudawrap sync` says: {said}"))

    def commit(self) -> Optional[str]:
        """The cudawrap commit under test, where the checkout has its .git."""
        try:
            done = subprocess.run(["git", "-C", str(SOURCE), "describe", "--always", "--dirty"], capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() or None if done.returncode == 0 else None

    def torch_python(self) -> Optional[str]:
        python = shutil.which("python3")
        if not python:
            return None
        try:
            done = subprocess.run([python, "-c", "import torch"], env=self.env(), capture_output=True, timeout=120)
        except subprocess.TimeoutExpired:
            return None
        return python if done.returncode == 0 else None

    def fatal(self, code: int, message: str) -> int:
        print(f"kit: {message}", file=sys.stderr, flush=True)
        return code

    # ---- state that checks change, always put back ---------------------------------------

    def set_sharing(self, text: str) -> None:
        if self.config_saved is None:
            self.config_saved = self.config.read_text()
        # The default config shows a [sharing] table (its keys commented out): the keys go
        # under that header, as TOML allows a table once; an older config gets the table.
        lines = self.config_saved.splitlines(keepends=True)
        added = "# added by the real-GPU kit\n" + text
        if "[sharing]\n" in lines:
            at = lines.index("[sharing]\n") + 1
            self.config.write_text("".join(lines[:at]) + added + "".join(lines[at:]))
        else:
            self.config.write_text(self.config_saved + "\n[sharing]\n" + added)
        self.cli("sync")

    def set_confine(self, text: str) -> None:
        """TEXT as the install's [confine] table, in place of the one it has (commented out or
        not: TOML allows a table once); the original config kept, as set_sharing does."""
        if self.config_saved is None:
            self.config_saved = self.config.read_text()
        kept, inside = [], False
        for line in self.config_saved.splitlines(keepends=True):
            if line.startswith(("[", "#[")):
                inside = line.strip() in ("[confine]", "#[confine]")
            if not inside:
                kept.append(line)
        self.config.write_text("".join(kept) + "\n[confine]\n# added by the real-GPU kit\n" + text)

    def confine_stop(self) -> None:
        """The service the confine check started, stopped (its nodes then stay as they are)."""
        if self.confining:
            self.service_stop()

    def open_nodes(self) -> None:
        """GPU nodes the confine check closed ([confine] nodes = "leased") put back as the state
        file says they were, whatever happened: the config restored says "open" and no service
        runs, so sync puts them back; if it did not, they are put back directly."""
        state = self.root / "var/lib/cudawrap/nodes.saved"
        if not self.confining or not state.exists():
            return
        self.cli("sync", check=False)
        if state.exists():
            subprocess.run([self.vpy, "-I", "-c", "import sys; from cudawrap.base import nodemodes; "
                            "nodemodes.put_back(sys.argv[1])", str(state)], env=self.env(), timeout=60)
        self.confining = False

    def restore_config(self) -> None:
        if self.config_saved is not None:
            self.config.write_text(self.config_saved)
            self.config_saved = None
            self.cli("sync", check=False)

    def daemon_pid(self, name: str) -> Optional[int]:
        """The live pid in run/cudawrap/NAME.pid (the monitor's, the service's), or None."""
        try:
            pid = int((self.root / f"run/cudawrap/{name}.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if Path(f"/proc/{pid}").exists() else None

    @staticmethod
    def stop_daemon(pid: Optional[int]) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if pid is None:
            return
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)

    def monitor_pid(self) -> Optional[int]:
        return self.daemon_pid("monitor")

    def service_pid(self) -> Optional[int]:
        return self.daemon_pid("service")

    def service_start(self) -> None:
        self.cli("serve", "--daemon")
        deadline = time.monotonic() + 15
        while self.service_pid() is None or not (self.root / "run/cudawrap/cudawrap.sock").exists():
            if time.monotonic() > deadline:
                raise CheckFailed("cudawrap serve --daemon: no live pid file and socket after 15 s")
            time.sleep(0.02)

    def service_stop(self) -> None:
        self.stop_daemon(self.service_pid())

    def monitor_start(self) -> None:
        self.cli("monitor", "--daemon")
        deadline = time.monotonic() + 15
        while self.monitor_pid() is None:
            if time.monotonic() > deadline:
                raise CheckFailed("cudawrap monitor --daemon: no live pid file after 15 s")
            time.sleep(0.02)
        time.sleep(0.3)  # its first snapshot

    def monitor_stop(self) -> None:
        self.stop_daemon(self.monitor_pid())

    def add_user(self, tag: str) -> Tuple[str, int, int]:
        name = f"cwkit{secrets.token_hex(3)}{tag}"
        done = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                               "--comment", "cudawrap GPU kit (temporary)", name], capture_output=True, text=True,
                              timeout=60)
        if done.returncode != 0:
            raise CheckFailed(f"useradd {name}: {done.stderr.strip()}")
        entry = pwd.getpwnam(name)
        user = (name, entry.pw_uid, entry.pw_gid)
        self.users.append(user)
        return user

    def remove_users(self) -> None:
        for name, _, _ in self.users:
            subprocess.run(["userdel", name], capture_output=True, timeout=60)
        self.users = []

    def cleanup(self) -> None:
        steps: List[Callable[[], None]] = [self.reap, self.monitor_stop, self.stop_mps, self.resume_target,
                                           self.confine_stop, self.restore_config, self.open_nodes,
                                           self.remove_users, self.uninstall]
        for step in steps:
            try:
                step()
            except Exception as e:  # every step runs, whatever the one before did
                print(f"kit: cleanup: {step.__name__}: {e}", file=sys.stderr)
        self.reap()
        if not self.args.keep:
            shutil.rmtree(self.base, ignore_errors=True)

    def stop_mps(self) -> None:
        if self.installed or self.args.root:
            if (self.root / "run/cudawrap/mps").is_dir() and any((self.root / "run/cudawrap/mps").iterdir()):
                self.cli("mps", "stop", check=False)

    def resume_target(self) -> None:
        if self.target and (self.installed or self.args.root):
            self.cli("resume", self.target, check=False)

    def uninstall(self) -> None:
        if self.args.root:
            for path in self.wrapped:
                subprocess.run([self.cudawrap, "unwrap", str(path)], env=self.env(), capture_output=True, timeout=60)
        elif self.installed and not self.args.keep:
            subprocess.run(["bash", str(SOURCE / "install.sh"), "--uninstall", "--unwrap-all", "--prefix",
                            str(self.root)], env=self.env(), capture_output=True, timeout=120)

    # ---- the checks -----------------------------------------------------------------------

    def check_lease(self) -> Tuple[str, Dict[str, Any]]:
        r = self.wrapped_probe(env=self.env()).finish(60).ok()
        if not r["cvd"] or not r["cvd"].startswith(("GPU-", "MIG-")):
            raise CheckFailed(f"the wrapped probe got CUDA_VISIBLE_DEVICES={r['cvd']!r}, not a device UUID")
        if [hex_of(d) for d in r["devices"]] != [hex_of(r["cvd"])]:
            raise CheckFailed(f"leased {r['cvd']} but CUDA gave {r['devices']}")
        return f"leased {r['cvd']}, CUDA's only device is {r['devices'][0]}", {"probe": r}

    def check_burst(self) -> Tuple[str, Dict[str, Any]]:
        runs = [self.wrapped_probe("--hold", "0.8") for _ in range(4)]
        results = sorted((r.finish(90).ok() for r in runs), key=lambda r: r["start"])
        gaps = [b["start"] - a["end"] for a, b in zip(results, results[1:])]
        data = {"runs": results, "gaps_s": gaps}
        if overlaps(results) > 1 or min(gaps) < 0:
            raise CheckFailed(f"runs overlapped on {self.target}: gaps {[ms(g) for g in gaps]}")
        return (f"4 runs of 0.8 s on {self.target} never overlapped; hand-overs {ms(min(gaps))}..{ms(max(gaps))} "
                f"(median {median_ms(gaps)})", data)

    def check_kill9(self) -> Tuple[str, Dict[str, Any]]:
        holder = self.wrapped_probe("--hold", str(HOLD_S), ready=True)
        pid = holder.wait_ready(60)
        waiter = self.wrapped_probe()
        time.sleep(0.5)  # let it queue: it must still be waiting behind the holder
        if waiter.proc.poll() is not None:
            waiter.finish(5)
            raise CheckFailed(f"the second run did not wait for the holder: exit {waiter.rc}: {waiter.tail()}")
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        r = waiter.finish(60).ok()
        holder.finish(10)
        delay = r["start"] - killed
        data = {"killed": killed, "next": r, "delay_s": delay}
        if delay < 0:
            raise CheckFailed(f"the waiting run started {ms(-delay)} before the holder was killed")
        if holder.rc != -signal.SIGKILL:
            raise CheckFailed(f"the holder was not killed: exit {holder.rc}: {holder.tail()}")
        return f"the next run started {ms(delay)} after kill -9 of the holder", data

    def snapshot_rewrites(self, count: int) -> None:
        """Wait until the monitor has rewritten its snapshot COUNT times from now: the second
        rewrite's look at NVML came after this moment."""
        path = self.root / "run/cudawrap/usage.snapshot"

        def mtime() -> int:
            try:
                return path.stat().st_mtime_ns
            except FileNotFoundError:
                return 0

        seen = mtime()
        deadline = time.monotonic() + 30
        while count:
            if time.monotonic() > deadline:
                raise CheckFailed(f"the monitor did not rewrite {path} within 30 s")
            time.sleep(0.01)
            if mtime() != seen:
                seen = mtime()
                count -= 1

    def foreign(self, monitor: bool) -> Tuple[str, Dict[str, Any]]:
        foreign = self.direct_probe("--hold", "1.5", ready=True)
        foreign.wait_ready(60)
        if monitor:
            # A foreign process newer than the monitor's last snapshot is not in it (README).
            self.snapshot_rewrites(2)
        wrapped = self.wrapped_probe()
        w = wrapped.finish(90).ok()
        f = foreign.finish(30).ok()
        data = {"foreign": f, "wrapped": w}
        if w["start"] < f["end"]:
            raise CheckFailed(f"the wrapped run started {ms(f['end'] - w['start'])} before the foreign process ended")
        when = ", launched once the monitor's snapshot listed it" if monitor else ""
        return (f"the wrapped run waited; it started {ms(w['start'] - f['end'])} after the foreign process "
                f"ended{when}", data)

    def check_foreign(self) -> Tuple[str, Dict[str, Any]]:
        self.monitor_stop()
        return self.foreign(monitor=False)

    def check_foreign_monitor(self) -> Tuple[str, Dict[str, Any]]:
        self.monitor_start()
        try:
            return self.foreign(monitor=True)
        finally:
            self.monitor_stop()

    def check_accounts(self) -> Tuple[str, Dict[str, Any]]:
        if not shutil.which("useradd") or not shutil.which("setpriv"):
            raise Skipped("needs useradd and setpriv")
        first, second = self.add_user("a"), self.add_user("b")
        holder = self.wrapped_probe("--hold", "1.5", user=first, ready=True)
        holder.wait_ready(60)
        waiter = self.wrapped_probe(user=second)
        b = waiter.finish(90).ok()
        a = holder.finish(30).ok()
        data = {"first": a, "second": b}
        if (a["uid"], b["uid"]) != (first[1], second[1]):
            raise CheckFailed(f"the runs ran as uids {a['uid']}, {b['uid']}, not {first[1]}, {second[1]}")
        if b["start"] < a["end"]:
            raise CheckFailed(f"{second[0]}'s run started {ms(a['end'] - b['start'])} before {first[0]}'s ended")
        return (f"{second[0]} (uid {second[1]}) waited for {first[0]} (uid {first[1]}); started "
                f"{ms(b['start'] - a['end'])} after it ended", data)

    def check_drain(self) -> Tuple[str, Dict[str, Any]]:
        self.cli("drain", self.target, "--reason", "real-GPU kit")
        refused = self.wrapped_probe(env=self.pinned(CUDAWRAP_WAIT="0")).finish(60)
        self.cli("resume", self.target)
        if refused.rc != EXIT_BUSY or refused.result is not None:
            raise CheckFailed(f"a run on the drained device exited {refused.rc} (expected {EXIT_BUSY}, not run): "
                              f"{refused.tail()}")
        after = self.wrapped_probe().finish(60).ok()
        holder = self.wrapped_probe("--hold", "1.0", ready=True)
        holder.wait_ready(60)
        self.cli("drain", self.target, "--reason", "real-GPU kit", "--wait", "30")
        returned = time.time()
        self.cli("resume", self.target)
        h = holder.finish(30).ok()
        data = {"refused_rc": refused.rc, "after_resume": after, "holder": h, "drain_wait_returned": returned}
        if returned < h["end"]:
            raise CheckFailed("drain --wait returned while the device was still held")
        return (f"drained: a run exited {EXIT_BUSY} at once; resumed: the next ran; "
                f"drain --wait returned {ms(returned - h['end'])} after the holder ended", data)

    def check_slots(self) -> Tuple[str, Dict[str, Any]]:
        self.set_sharing("slots = 2\n")
        try:
            shared = self.pinned(CUDAWRAP_SHARE="1")
            sharers = [self.wrapped_probe("--hold", "1.0", env=shared, ready=True) for _ in range(2)]
            for run in sharers:
                run.wait_ready(60)
            third = self.wrapped_probe("--hold", "1.0", env=shared)
            whole = self.wrapped_probe("--hold", "0.2")
            results = [r.finish(90).ok() for r in sharers + [third]]
            exclusive = whole.finish(90).ok()
        finally:
            self.restore_config()
        data = {"sharers": results, "exclusive": exclusive}
        most = overlaps(results)
        beside = [r for r in results if overlaps([r, exclusive]) > 1]
        if most != 2:
            raise CheckFailed(f"{most} sharers ran at once on {self.target} (slots = 2)")
        if beside:
            raise CheckFailed(f"the exclusive run overlapped {len(beside)} sharer(s)")
        return "slots = 2: two sharers at once, the third after one ended, the exclusive run beside none", data

    def check_mps(self) -> Tuple[str, Dict[str, Any]]:
        if not shutil.which("nvidia-cuda-mps-control"):
            raise Skipped("no nvidia-cuda-mps-control on PATH")
        self.set_sharing('slots = 2\nmode = "mps"\n')
        try:
            self.cli("mps", "start", timeout=120)
            try:
                status = self.cli("mps", "status", "--json").stdout
                shared = self.pinned(CUDAWRAP_SHARE="1")
                runs = [self.wrapped_probe("--hold", "1.0", env=shared) for _ in range(2)]
                results = [r.finish(120).ok() for r in runs]
            finally:
                self.cli("mps", "stop", timeout=120)
        finally:
            self.restore_config()
        data = {"runs": results, "status": status}
        pipes = [r["mps_pipe"] for r in results]
        if not all(pipes):
            raise CheckFailed(f"a shared run got no CUDA_MPS_PIPE_DIRECTORY: {pipes}")
        if overlaps(results, since="ready") != 2:  # both had their contexts at once
            raise CheckFailed("the two MPS clients did not hold their contexts at once")
        return (f"two MPS clients at once on {self.target} (thread limit {results[0]['mps_threads']} %), "
                f"pipe {pipes[0]}", data)

    def check_torch(self) -> Tuple[str, Dict[str, Any]]:
        if not (self.bin / "cw-torch").exists():
            raise Skipped("`import torch` fails in this machine's python3")
        run = self.start([str(self.bin / "cw-torch")], self.env()).finish(240)
        if run.rc != 0 or run.result is None:
            raise CheckFailed(f"the wrapped PyTorch script exited {run.rc}: {run.tail()}")
        r = run.result
        if r["count"] != 1 or (r["uuid"] and hex_of(r["uuid"]) != hex_of(r["cvd"])):
            raise CheckFailed(f"PyTorch saw {r['count']} device(s), uuid {r['uuid']}; the lease is {r['cvd']}")
        if r["sum"] != 1024.0 ** 3:
            raise CheckFailed(f"a matmul of ones gave {r['sum']}")
        return f"PyTorch ran on the leased {r['cvd']} ({r['name']}) in {ms(r['end'] - r['start'])}", {"torch": r}

    def timed(self, argv: Sequence[str], env: Dict[str, str]) -> float:
        began = time.perf_counter()
        run = self.start(argv, env).finish(60)
        took = time.perf_counter() - began
        if run.rc != 0:
            raise CheckFailed(f"{argv[0]} exited {run.rc}: {run.tail()}")
        return took

    def overhead(self) -> Tuple[str, Dict[str, Any]]:
        rounds = self.args.rounds
        pairs = {"true": ([str(self.bin / "cw-true")], [self.vpy, "-I", "-c", "pass"]),
                 "probe": ([str(self.bin / "cw-probe")], [str(self.bin / "probe")])}
        data: Dict[str, Any] = {}
        for name, (wrapped, bare) in pairs.items():
            self.timed(wrapped, self.env())  # warm the caches once
            w, b = [], []
            for _ in range(rounds):  # alternating, so drifts hit both alike
                w.append(self.timed(wrapped, self.env()))
                b.append(self.timed(bare, self.env()))
            data[name] = {"wrapped_s": w, "bare_s": b, "wrapped_median_s": statistics.median(w),
                          "bare_median_s": statistics.median(b)}
        t, p = data["true"], data["probe"]
        return (f"wrapped true {median_ms(t['wrapped_s'])} vs `python -I -c pass` {median_ms(t['bare_s'])} "
                f"({t['wrapped_median_s'] / t['bare_median_s']:.2f}x); wrapped probe {median_ms(p['wrapped_s'])} vs "
                f"direct {median_ms(p['bare_s'])} (+{ms(p['wrapped_median_s'] - p['bare_median_s'])}); "
                f"medians of {rounds}", data)

    def check_overhead(self) -> Tuple[str, Dict[str, Any]]:
        self.monitor_stop()
        return self.overhead()

    def check_overhead_monitor(self) -> Tuple[str, Dict[str, Any]]:
        self.monitor_start()
        try:
            return self.overhead()
        finally:
            self.monitor_stop()

    def check_overhead_service(self) -> Tuple[str, Dict[str, Any]]:
        """The launch granted by `cudawrap serve` (issue 30: the shim loads no NVML then)."""
        self.monitor_stop()
        self.service_start()
        try:
            return self.overhead()
        finally:
            self.service_stop()

    def check_stall(self) -> Tuple[str, Dict[str, Any]]:
        self.monitor_start()
        try:
            normal, after = [], []
            for _ in range(5):
                run = self.wrapped_probe("--mem", "0").finish(60)
                normal.append(run.ok()["start"] - run.spawned)
            for _ in range(self.args.rounds):
                self.direct_probe("--hold", "0.3").finish(60).ok()
                run = self.wrapped_probe("--mem", "0").finish(60)
                after.append(run.ok()["start"] - run.spawned)
        finally:
            self.monitor_stop()
        base = statistics.median(normal)
        data = {"normal_s": normal, "after_foreign_s": after}
        detail = (f"launch after an unwrapped 0.3 s probe: median {median_ms(after)}, max {ms(max(after))} "
                  f"(normal launch {ms(base)}; {len(after)} rounds, monitor on)")
        if max(after) > base + STALL_LIMIT_S:
            raise CheckFailed(detail + f": over the normal launch + {ms(STALL_LIMIT_S)}")
        return detail, data

    def check_confine(self) -> Tuple[str, Dict[str, Any]]:
        """Issue 52: [confine] runs = true, a wrapped probe that resets CUDA_VISIBLE_DEVICES
        still sees one device; [confine] nodes = "leased", another account's unwrapped probe
        fails cuInit, and succeeds once the nodes are "open" again. The nodes are put back at
        cleanup whatever happens (open_nodes)."""
        if not shutil.which("useradd") or not shutil.which("setpriv"):
            raise Skipped("needs useradd and setpriv")
        self.monitor_stop()
        reset = self.bin / "cw-reset"
        reset.write_text(f"#!/bin/sh\nunset CUDA_VISIBLE_DEVICES\nexec {self.bin / 'probe'} \"$@\"\n")
        reset.chmod(0o755)
        done = subprocess.run([str(self.root / "usr/local/bin/create-cudawrap"), str(reset)], env=self.env(),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise CheckFailed(f"create-cudawrap {reset}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
        self.wrapped.append(reset)
        self.confining = True
        self.set_confine("runs = true\n")
        self.service_start_checked()
        try:
            confined = self.start([str(reset)], self.env()).finish(60).ok()
        finally:
            self.service_stop()
        if len(confined["devices"]) != 1:
            raise CheckFailed(f"the confined run that reset CUDA_VISIBLE_DEVICES saw {confined['devices']}")
        data: Dict[str, Any] = {"confined": confined}
        detail = f"runs = true: a wrapped probe that reset CUDA_VISIBLE_DEVICES saw {len(confined['devices'])} device"
        params = Path("/proc/driver/nvidia/params")
        if not params.exists():
            return detail + "; nodes = \"leased\" not checked: no NVIDIA driver (no /proc/driver/nvidia/params)", data
        values = dict(line.split(":", 1) for line in params.read_text().splitlines() if ":" in line)
        node = {k: values.get(k, "?").strip() for k in ("DeviceFileMode", "DeviceFileUID", "DeviceFileGID",
                                                         "ModifyDeviceFiles")}
        data["driver"] = node
        if node["ModifyDeviceFiles"] != "0" and (node["DeviceFileMode"], node["DeviceFileUID"],
                                                 node["DeviceFileGID"]) != ("432", "0", "0"):
            return detail + (f"; nodes = \"leased\" not checked: the driver makes its nodes with "
                             f"{', '.join(f'{k}={v}' for k, v in node.items())} (the service refuses it there)"), data
        other = self.add_user("c")
        self.set_confine("runs = true\nnodes = \"leased\"\n")
        self.service_start_checked()
        try:
            closed = self.direct_probe(env=self.env(), user=other).finish(60)
        finally:
            self.service_stop()
        self.set_confine("runs = true\nnodes = \"open\"\n")
        self.cli("sync")  # no service runs, the config says "open": the nodes go back as they were
        opened = self.direct_probe(env=self.env(), user=other).finish(60)
        data.update(closed=closed.result, opened=opened.result)
        if not closed.result or not str(closed.result.get("error", "")).startswith("cuInit"):
            raise CheckFailed(f"under nodes = \"leased\" {other[0]}'s unwrapped probe did not fail cuInit: "
                              f"exit {closed.rc}: {closed.tail()}")
        opened.ok()
        return detail + (f"; nodes = \"leased\": {other[0]}'s unwrapped probe failed {closed.result['error']}, "
                         f"and ran once the nodes were \"open\" again"), data

    def service_start_checked(self) -> None:
        """service_start, its refusal's own line as the failure (a host that cannot confine)."""
        done = self.cli("serve", "--daemon", check=False)
        if done.returncode != 0:
            raise CheckFailed(f"cudawrap serve --daemon: exit {done.returncode}: "
                              f"{(done.stderr.strip() or done.stdout.strip() or '?').splitlines()[-1]}")
        deadline = time.monotonic() + 15
        while self.service_pid() is None or not (self.root / "run/cudawrap/cudawrap.sock").exists():
            if time.monotonic() > deadline:
                raise CheckFailed("cudawrap serve --daemon: no live pid file and socket after 15 s")
            time.sleep(0.02)

    # ---- driver ---------------------------------------------------------------------------

    def record(self, name: str, status: str, detail: str, data: Dict[str, Any], seconds: float) -> None:
        print(f"{status} {name}: {detail}", flush=True)
        self.results.append({"name": name, "status": status, "detail": detail, "seconds": round(seconds, 2),
                             "data": data})

    def run_check(self, name: str) -> None:
        method = getattr(self, "check_" + name.replace("-", "_"))
        began = time.monotonic()
        if began > self.deadline:
            self.record(name, "SKIP", f"out of time (--budget {self.args.budget:.0f} s)", {}, 0)
            return
        limit = CHECK_LIMIT_S.get(name, DEFAULT_LIMIT_S)

        def expired(_signum: int, _frame: Any) -> None:
            raise TimedOut(f"still running after its limit of {limit:.0f} s")

        signal.signal(signal.SIGALRM, expired)
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            try:
                detail, data = method()
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            status = "PASS"
        except Skipped as e:
            status, detail, data = "SKIP", str(e), {}
        except CheckFailed as e:
            status, detail, data = "FAIL", str(e), {}
        except (OSError, subprocess.SubprocessError, ValueError, KeyError, TypeError) as e:
            status, detail, data = "FAIL", f"{type(e).__name__}: {e}", {}
        self.reap()
        self.record(name, status, detail, data, time.monotonic() - began)

    def main(self) -> int:
        self.build()
        python = self.torch_python()
        if python:
            script = self.bin / "cw-torch"
            script.write_text(TORCH_SCRIPT.format(python=python))
            script.chmod(0o755)
        self.install()
        self.wrap()
        self.machine()
        gpus = ", ".join(f"{name} ({mib} MiB)" for name, _, mib in self.info.get("gpus", [])) or "GPUs unknown"
        print(f"kit: {gpus}; driver {self.info.get('driver', '?')}; device under test {self.target}; cudawrap "
              f"{self.info.get('commit') or '?'}; install {self.info.get('install_seconds', 0)} s", flush=True)
        for name in self.args.only or ALL_CHECKS:
            self.run_check(name)
        return 1 if any(r["status"] == "FAIL" for r in self.results) else 0

    def report(self, path: Optional[str], began: float) -> None:
        counts = {s: sum(r["status"] == s for r in self.results) for s in ("PASS", "FAIL", "SKIP")}
        print(f"kit: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped in "
              f"{time.monotonic() - began:.0f} s", flush=True)
        if path:
            doc = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - (time.monotonic() - began))),
                   "seconds": round(time.monotonic() - began, 1), "machine": self.info, "summary": counts,
                   "checks": self.results}
            Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheelhouse", metavar="DIR", help="install offline from these wheels (build-wheelhouse.sh)")
    parser.add_argument("--python", metavar="PATH", help="the Python install.sh builds cudawrap's venv with")
    parser.add_argument("--root", metavar="DIR", help="use the cudawrap install in DIR instead of installing one")
    parser.add_argument("--report", metavar="FILE", help="write the JSON report here")
    parser.add_argument("--only", metavar="CHECK,...", help=f"run only these checks, of: {', '.join(ALL_CHECKS)}")
    parser.add_argument("--rounds", type=int, default=10, metavar="N", help="rounds of the timed checks (10)")
    parser.add_argument("--budget", type=float, default=270, metavar="SECONDS",
                        help="checks not begun by then are skipped (270)")
    parser.add_argument("--prebuilt", metavar="DIR", help="DIR/probe and DIR/true, built where there is a compiler")
    parser.add_argument("--keep", action="store_true", help="keep the temporary prefix (for debugging)")
    args = parser.parse_args(argv)
    if args.only:
        args.only = [c.strip() for c in args.only.split(",") if c.strip()]
        unknown = [c for c in args.only if c not in ALL_CHECKS]
        if unknown:
            parser.exit(EX_USAGE, f"kit: --only: unknown check(s) {', '.join(unknown)}; "
                                  f"known: {', '.join(ALL_CHECKS)}\n")
    if args.wheelhouse and not Path(args.wheelhouse).is_dir():
        parser.exit(EX_USAGE, f"kit: --wheelhouse {args.wheelhouse}: no such directory\n")
    if args.rounds < 1:
        parser.exit(EX_USAGE, "kit: --rounds: give 1 or more\n")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if os.geteuid() != 0:
        print("kit: run it as root: it creates temporary accounts and wraps programs", file=sys.stderr)
        return EX_NOPERM
    os.umask(0o022)
    began = time.monotonic()

    def on_signal(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    kit = Kit(args)
    try:
        code = kit.main()
    except KeyboardInterrupt:
        print("kit: interrupted; cleaning up", file=sys.stderr)
        code = 130
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except Exception:  # a bug of the kit's: still clean up and report what ran
        import traceback

        traceback.print_exc()
        code = 70
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kit.cleanup()
    kit.report(args.report, began)
    return code


if __name__ == "__main__":
    sys.exit(main())
