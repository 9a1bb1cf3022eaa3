"""NVIDIA MPS control daemons, one per shared device: started, stopped and asked.

A control daemon runs the CUDA work of one user at a time: a client of another uid waits
until every client of the running server is gone. cudawrap gives a shared device in mps
mode to one user at a time, so each device (a whole GPU or a MIG instance) gets a daemon
of its own, seeing only that device (CUDA_VISIBLE_DEVICES=its UUID), with its own pipe
and log directories (``sharing.mps_pipe_dir``, ``mps_log_dir``): the directories the launch
gives that device's shared runs. One daemon for the machine would make the users of
different devices wait for each other.

Managed devices: those of the inventory that this install has lease files for and that
have 2 or more slots. ``stop`` quits every daemon under the MPS directory, also those of
devices configured no more.

The daemons are NVIDIA's nvidia-cuda-mps-control, found on PATH and run through plumbum:
``-d`` starts one, the front end (commands on stdin) asks or quits one. Whether a daemon
runs is whether it answers the front end in that pipe directory: its pid file can outlive
it, and a daemon killed with -9 leaves its socket behind.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import locations as loc
from ..errors import ConfigError, MpsUnavailable, NvmlUnavailable, SetupError
from ..paths import Layout
from ..lease.mpsaccess import pipe_dirs
from ..lease.sharing import MPS, MPS_PID_FILE, Sharing, mps_log_dir, mps_pipe_dir, settings as sharing_settings

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PID_FILE = MPS_PID_FILE
ASK_TIMEOUT_S = 10.0
START_TIMEOUT_S = 10.0
# MPS listens on unix sockets in the pipe directory, whose addresses hold 108 bytes: the
# directory, a slash, the longest name MPS makes there and a NUL must fit.
MAX_PIPE_DIR_BYTES = 108 - len("/control_privileged") - 1


@dataclass(frozen=True)
class Managed:
    """A device whose control daemon cudawrap keeps."""

    uuid: str
    slots: int


@dataclass(frozen=True)
class Outcome:
    """What start or stop did for one device: OK, and in words."""

    uuid: str
    ok: bool
    what: str


def sharing_of(layout: Layout) -> Tuple[Sharing, str]:
    """The [sharing] settings in force, and where the mode was set ("FILE:LINE", "default")."""
    data = sharing_settings(str(layout.root))
    return Sharing(data), data.get("mode", (None, "default"))[1]


def require_mps(layout: Layout) -> Sharing:
    """The [sharing] settings; ConfigError unless mode is "mps"."""
    share, where = sharing_of(layout)
    if share.mode != MPS:
        raise ConfigError(
            f"[sharing] mode is \"{share.mode}\" ({where}), so no device is shared through MPS",
            hint=f"set mode = \"mps\" under [sharing] in {layout.config_file} (with slots = 2 or more), "
                 f"then run `cudawrap mps start`")
    return share


def control_program() -> str:
    """The path of nvidia-cuda-mps-control on PATH, or MpsUnavailable."""
    found = shutil.which(CONTROL)
    if found is None:
        raise MpsUnavailable(
            f"{CONTROL} is not on PATH ({os.environ.get('PATH', '')})",
            hint="install the NVIDIA driver's compute utilities (Debian/Ubuntu: nvidia-compute-utils-BRANCH), "
                 "or put the directory that holds it on root's PATH")
    return found


def managed(layout: Layout, share: Sharing) -> List[Managed]:
    """The devices that get a daemon: leased by this install, with 2 or more slots."""
    from ..devices import nvml

    inventory = nvml.inventory()
    leased = set(os.listdir(layout.lease_dir)) if layout.lease_dir.is_dir() else set()
    out = []
    for device in inventory.devices:
        slots = share.slots_for(device.uuid, device.parent_uuid)
        if device.uuid in leased and slots >= 2:
            out.append(Managed(device.uuid, slots))
    return out


# --- talking to nvidia-cuda-mps-control ---------------------------------------------------


def _environ(**extra: str) -> Dict[str, str]:
    """Ours without any CUDA_MPS_* or CUDA_VISIBLE_DEVICES of the admin's shell (a stray
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE would become a daemon's default), plus EXTRA."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(extra)
    return env


def _run(control: str, args: List[str], stdin: str, env: Dict[str, str],
         timeout: Optional[float]) -> Tuple[int, str, str]:
    """(exit status, stdout, stderr) of CONTROL; status -1 when it ran past TIMEOUT."""
    from plumbum import local
    from plumbum.commands.processes import ProcessTimedOut

    command = local[control][args] << stdin
    try:
        # From /: the admin's working directory may be one the daemon should not keep busy.
        rc, out, err = command.run(retcode=None, timeout=timeout, cwd="/", env=env)
    except ProcessTimedOut:
        return -1, "", f"no answer in {timeout:g} s"
    return int(rc), out, err


def ask(control: str, pipe_dir: str, *commands: str) -> Optional[str]:
    """The daemon's reply to COMMANDS, or None when no daemon answers in PIPE_DIR."""
    rc, out, _ = _run(control, [], "".join(f"{c}\n" for c in commands),
                      _environ(CUDA_MPS_PIPE_DIRECTORY=pipe_dir), ASK_TIMEOUT_S)
    return out if rc == 0 else None


def _pids(text: Optional[str]) -> List[int]:
    return [int(word) for word in (text or "").split() if word.isdigit()]


def _last_line(*texts: str) -> str:
    for text in texts:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if lines:
            return lines[-1]
    return ""


# --- start, stop, status ---------------------------------------------------------------------


def start(layout: Layout) -> List[Outcome]:
    """Start the daemon of every managed device that has none answering; one Outcome each."""
    share = require_mps(layout)
    control = control_program()
    if not layout.lease_dir.is_dir():
        from ..lease.files import SYNC_HINT

        raise SetupError(f"the lease directory {layout.lease_dir} is missing", hint=SYNC_HINT)
    return [_start_one(layout, control, device) for device in managed(layout, share)]


def _start_one(layout: Layout, control: str, device: Managed) -> Outcome:
    from ..install.runtime import ensure_dir

    root = str(layout.root)
    pipe, logs = mps_pipe_dir(root, device.uuid), mps_log_dir(root, device.uuid)
    if ask(control, pipe, "get_server_list") is not None:
        _seal_pid_file(pipe)
        return Outcome(device.uuid, True, "already running")
    if len(os.fsencode(pipe)) > MAX_PIPE_DIR_BYTES:
        return Outcome(device.uuid, False, f"its pipe directory {pipe} is too long for MPS's unix sockets "
                                           f"(at most {MAX_PIPE_DIR_BYTES} bytes): install under a shorter --prefix")
    try:
        # Root's, 0755; the pipe directory, where clients connect, as _pipe_dir says.
        for path in (layout.mps_dir, layout.root / loc.LOG_DIR, layout.mps_log_dir, Path(logs)):
            ensure_dir(path, 0o755)
        _pipe_dir(layout, pipe)
    except OSError as exc:
        return Outcome(device.uuid, False, f"cannot make {exc.filename}: {exc.strerror or exc}")
    env = _environ(CUDA_VISIBLE_DEVICES=device.uuid, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_LOG_DIRECTORY=logs)
    rc, out, err = _run(control, ["-d"], "", env, START_TIMEOUT_S)
    if rc != 0:
        return Outcome(device.uuid, False, f"{CONTROL} -d failed: {_last_line(err, out) or f'exit status {rc}'}")
    # -d may return before the daemon listens.
    deadline = time.monotonic() + START_TIMEOUT_S
    while ask(control, pipe, "get_server_list") is None:
        if time.monotonic() > deadline:
            return Outcome(device.uuid, False, f"started, but nothing answers in {pipe}; see {logs}/control.log")
        time.sleep(0.1)
    _seal_pid_file(pipe)
    log.debug("MPS control daemon for %s listens in %s", device.uuid, pipe)
    return Outcome(device.uuid, True, "started")


def _pipe_dir(layout: Layout, pipe: str) -> None:
    """PIPE made, then as the one arbiter wants it: where the service arbitrates, for its sharers alone
    (0700 and their ACL, which this leaves alone), else 0755 (lease/mpsaccess.py)."""
    from ..install.runtime import sealed
    from ..lease.mpsaccess import OPEN_MODE, open_up, seal

    os.makedirs(pipe, mode=OPEN_MODE, exist_ok=True)
    (seal if sealed(layout) else open_up)(pipe)


def _seal_pid_file(pipe: str) -> None:
    """Make the daemon's pid file 0644: NVIDIA's daemon leaves it writable by everyone, and it
    names the daemon whose children are cudawrap's MPS servers (sharing.mps_daemon)."""
    try:
        fd = os.open(os.path.join(pipe, PID_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return  # none (yet): nothing names a daemon, so no server counts as cudawrap's
    try:
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)


def stop(layout: Layout, notice: Callable[[str], None] = lambda line: None) -> List[Outcome]:
    """Quit every daemon under the MPS directory, all at once; NOTICE hears of running clients.

    ``quit`` is NVIDIA's: the daemon takes no new client, waits until the running ones are
    done, then stops its server and exits. So this returns when the last client has ended.
    """
    from plumbum import local

    pipes = pipe_dirs(layout)
    if not pipes:
        return []
    control = control_program()
    quitting: Dict[str, Any] = {}
    outcomes: Dict[str, Outcome] = {}
    for uuid, pipe in pipes.items():
        servers = ask(control, pipe, "get_server_list")
        if servers is None:
            outcomes[uuid] = Outcome(uuid, True, "not running")
            continue
        clients = _pids(ask(control, pipe, *(f"get_client_list {pid}" for pid in _pids(servers))))
        if clients:
            notice(f"{uuid}: waiting for {len(clients)} running MPS client(s) to finish "
                   f"(pids {', '.join(map(str, clients))}); new ones are refused")
        proc = local[control].popen(cwd="/", env=_environ(CUDA_MPS_PIPE_DIRECTORY=pipe))
        proc.stdin.write(b"quit\n")
        proc.stdin.flush()  # communicate() closes it, once every daemon is quitting
        quitting[uuid] = proc
    for uuid, proc in quitting.items():
        out, err = proc.communicate()
        if proc.returncode == 0:
            outcomes[uuid] = Outcome(uuid, True, "stopped")
        else:
            why = _last_line(_text(err), _text(out)) or f"exit status {proc.returncode}"
            outcomes[uuid] = Outcome(uuid, False, f"quit failed: {why}")
    for uuid, pipe in pipes.items():
        if outcomes[uuid].ok:
            try:
                os.rmdir(pipe)  # emptied by the daemon; a killed one's leftovers stay for start
            except OSError:
                pass
    return [outcomes[uuid] for uuid in pipes]


def _text(data: Any) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")


def status(layout: Layout) -> Dict[str, Any]:
    """Mode, and per device its slots and daemon: pid, servers with their user and clients."""
    from ..policy.privacy import HIDDEN, hidden_from
    from ..base.procinfo import process_info

    share, where = sharing_of(layout)
    out: Dict[str, Any] = {"root": str(layout.root), "mode": share.mode, "mode_source": where,
                           "nvml_error": None, "devices": []}
    rows: Dict[str, Dict[str, Any]] = {}
    if share.mode == MPS:
        try:
            for device in managed(layout, share):
                rows[device.uuid] = {"uuid": device.uuid, "slots": device.slots, "managed": True}
        except NvmlUnavailable as exc:
            out["nvml_error"] = str(exc)
    for uuid in pipe_dirs(layout):
        rows.setdefault(uuid, {"uuid": uuid, "slots": None, "managed": False})
    control = control_program() if rows else None
    for uuid, row in rows.items():
        pipe = mps_pipe_dir(str(layout.root), uuid)
        servers = ask(control, pipe, "get_server_list") if control else None
        row.update(pipe_dir=pipe, running=servers is not None, pid=None, servers=[])
        if servers is None:
            continue
        row["pid"] = _pid_file(pipe)
        for pid in _pids(servers):
            clients = _pids(ask(control, pipe, f"get_client_list {pid}"))
            row["servers"].append({"pid": pid, "user": process_info(pid)["user"], "clients": clients})
    me = hidden_from(str(layout.root), os.geteuid())
    for row in rows.values() if me is not None else ():  # [service] private_status: others' counted only
        row["servers"] = [s if s["user"] == me else {"pid": None, "user": HIDDEN, "clients": [None] * len(s["clients"])}
                          for s in row["servers"]]
    out["devices"] = list(rows.values())
    return out


def _pid_file(pipe: str) -> Optional[int]:
    try:
        with open(os.path.join(pipe, PID_FILE), encoding="ascii", errors="replace") as f:
            text = f.read(32).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _daemon(row: Dict[str, Any]) -> str:
    if not row["running"]:
        return "not running"
    return f"pid {row['pid']}" if row["pid"] else "running"


def _servers(row: Dict[str, Any], key: str) -> str:
    return ",".join("?" if server[key] is None else str(server[key]) for server in row["servers"]) or "-"


COLUMNS = [
    ("DEVICE", lambda r: r["uuid"], 0),
    ("SLOTS", lambda r: str(r["slots"]) if r["managed"] else "not shared now", 0),
    ("DAEMON", _daemon, 0),
    ("SERVER", lambda r: _servers(r, "pid"), 0),
    ("USER", lambda r: _servers(r, "user"), 16),
    ("CLIENTS", lambda r: str(sum(len(s["clients"]) for s in r["servers"])) if r["running"] else "-", 0),
]


def render(report: Dict[str, Any]) -> List[str]:
    """`cudawrap mps status` as text: the mode, then a line per device."""
    from .statustable import table

    rows = report["devices"]
    running = sum(1 for r in rows if r["running"])
    shared = sum(1 for r in rows if r["managed"])
    lines = [f"install root {report['root']}: [sharing] mode = \"{report['mode']}\" ({report['mode_source']}); "
             f"{shared} device(s) shared through MPS, {running} control daemon(s) running"]
    if report["nvml_error"]:
        lines.append(f"warning: which devices exist is unknown: {report['nvml_error']}")
    if rows:
        lines += table(rows, COLUMNS)
    if any(r["managed"] and not r["running"] for r in rows):
        lines.append("start the missing ones with `cudawrap mps start` as root (systemd: `systemctl start cudawrap-mps`)")
    if any(r["running"] and not r["managed"] for r in rows):
        lines.append("daemons of devices not shared through MPS now: `cudawrap mps stop` quits them")
    return lines
