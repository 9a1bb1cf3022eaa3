"""The monitor's accounting and Prometheus metrics, one step per monitor cycle.

Each cycle records grants and ends in the ledger (ledger.observe) and, where
``[metrics] textfile`` is set, rewrites that file in the Prometheus text format for
node_exporter's textfile collector: written to a temporary name in the same directory and
renamed into place, so the collector never reads half a file. Counters (grants, waits that
ended without a grant, the waits histogram) count what this monitor observed since it
started; device-seconds per user are the ledger's, finished leases only.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Collection, Dict, List, Optional, Sequence, Tuple

from ..ledger import looks as ledger, files as ledgerfile
from ..sched.drains import covering, drained, health_drained
from ..lease.holders import holdings
from ..paths import Layout
from ..base.proc import real_uid
from ..base.safepath import Unsafe
from ..base.users import user_name
from ..base.filestamp import file_signature

log = logging.getLogger(__name__)

WAIT_BUCKETS = (0.1, 1.0, 10.0, 60.0, 600.0, 3600.0, 86400.0)


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: Any) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}" if labels else ""


class Counters:
    """What the monitor saw since it started."""

    def __init__(self) -> None:
        self.started = time.time()
        self.grants = 0
        self.abandoned = 0
        self.wait_buckets = [0] * len(WAIT_BUCKETS)
        self.wait_count = 0
        self.wait_sum = 0.0
        self.device_seconds: Dict[str, float] = {}  # user -> the ledger's finished device-seconds

    def add(self, obs: ledger.Observation) -> None:
        self.grants += len(obs.grants)
        self.abandoned += obs.abandoned
        for grant in obs.grants:
            wait = grant.get("wait_s")
            if isinstance(wait, (int, float)):
                self.wait_count += 1
                self.wait_sum += wait
                for i, bound in enumerate(WAIT_BUCKETS):
                    if wait <= bound:
                        self.wait_buckets[i] += 1
        for end in obs.ends:
            self.add_end(end)

    def add_end(self, end: Dict[str, Any]) -> None:
        seconds = device_seconds(end)
        if seconds is not None:
            self.device_seconds[end.get("user", "?")] = self.device_seconds.get(end.get("user", "?"), 0.0) + seconds


def device_seconds(end: Dict[str, Any]) -> Optional[float]:
    try:
        # A share counts as the part of its devices it held (devices_held), a lease as all of them.
        return max(float(end["end"]) - float(end["start"]), 0.0) * float(end.get("devices_held", len(end["devices"])))
    except (KeyError, TypeError, ValueError):
        return None


def render(devices: Sequence[Dict[str, Any]], waiting: Dict[int, int], counters: Counters,
           runs: Sequence[Dict[str, Any]] = (), leftovers: Optional[Dict[Tuple[str, str], int]] = None) -> str:
    """The metrics file's text. DEVICES: dicts with uuid, gpu, name, user ("" if free; a sharer's
    if shared), shares (shared runs on it), drained, memory_used_bytes (None if unknown). RUNS:
    memwatch's rows (pid, uid, program, device, used_mib, limit_mib). LEFTOVERS: (device, user)
    -> leftover processes. Pure."""
    out: List[str] = []

    def family(name: str, kind: str, text: str, samples: List[Tuple[str, Any]]) -> None:
        out.append(f"# HELP {name} {text}")
        out.append(f"# TYPE {name} {kind}")
        sample = name + "_bucket" if kind == "histogram" else name
        out.extend(f"{sample}{labels} {value}" for labels, value in samples)

    def dev(d: Dict[str, Any]) -> Dict[str, Any]:
        return {"device": d["uuid"], "gpu": d["gpu"], "name": d["name"]}

    family("cudawrap_device_held", "gauge", "1 while a lease on the device is held; user is the holder",
           [(_labels(**dev(d), user=d["user"]), int(bool(d["user"]))) for d in devices])
    family("cudawrap_device_shares", "gauge", "shared runs holding a slot of the device (0: free or held whole)",
           [(_labels(**dev(d)), d.get("shares", 0)) for d in devices])
    family("cudawrap_device_drained", "gauge", "1 while the device is drained (no new leases)",
           [(_labels(**dev(d)), int(d["drained"])) for d in devices])
    family("cudawrap_device_health", "gauge", "1 while the device is healthy, 0 while drained for an error "
           "([health]; `cudawrap health` says why)", [(_labels(**dev(d)), int(d.get("healthy", True))) for d in devices])
    family("cudawrap_lease_idle_seconds", "gauge", "how long the lease on the device has shown 0 % utilisation and "
           "unchanged memory (0: busy)", [(_labels(**dev(d)), d["idle_s"]) for d in devices if "idle_s" in d])
    family("cudawrap_leftover_processes", "gauge", "processes on the device left over from a user's ended run "
           "(`cudawrap health` names them)", [(_labels(device=d, user=u), n) for (d, u), n in sorted((leftovers or {}).items())])
    family("cudawrap_device_memory_used_bytes", "gauge", "device memory in use, as NVML reports it",
           [(_labels(**dev(d)), d["memory_used_bytes"]) for d in devices if d["memory_used_bytes"] is not None])
    family("cudawrap_run_memory_bytes", "gauge", "device memory a run's processes use on the device, summed",
           [(_labels(device=r["device"], user=user_name(r["uid"]), program=r["program"], pid=r["pid"]),
             r["used_mib"] << 20) for r in runs])
    family("cudawrap_queue_length", "gauge", "runs waiting for a device, per user",
           [(_labels(user=user_name(uid)), n) for uid, n in sorted(waiting.items())])
    family("cudawrap_grants_total", "counter", "leases granted, as the monitor observed them since it started",
           [("", counters.grants)])
    family("cudawrap_timeouts_total", "counter",
           "waits that ended without a grant (time limit, Ctrl-C, cancel, kill) since the monitor started",
           [("", counters.abandoned)])
    # add() counts each wait in every bucket it fits: the counts are cumulative, as Prometheus wants.
    buckets = [(_labels(le=f"{bound:g}"), n) for bound, n in zip(WAIT_BUCKETS, counters.wait_buckets)]
    buckets.append((_labels(le="+Inf"), counters.wait_count))
    family("cudawrap_wait_seconds", "histogram", "time from a run's start to its grant, observed since the "
           "monitor started", buckets)
    out.append(f"cudawrap_wait_seconds_sum {counters.wait_sum:.3f}")
    out.append(f"cudawrap_wait_seconds_count {counters.wait_count}")
    family("cudawrap_ledger_device_seconds_total", "counter", "device-seconds of finished leases in the ledger, "
           "per user", [(_labels(user=u), f"{s:.3f}") for u, s in sorted(counters.device_seconds.items())])
    family("cudawrap_monitor_start_time_seconds", "gauge", "when this monitor started",
           [("", f"{counters.started:.3f}")])
    return "\n".join(out) + "\n"


def open_textfile_dir(path: str, trusted: Optional[Collection[int]] = None) -> int:
    """A descriptor on the directory of the metrics file PATH, checked from /: every directory
    on the way root's (or the monitor's user's) and writable by nobody else, the last one
    allowed to be sticky like /tmp. Raises safepath.Unsafe (or OSError) otherwise: in a
    directory a user may write, they could make the file root is about to write into."""
    from ..base.safepath import open_dir

    return open_dir(os.path.dirname(os.path.abspath(path)), trusted, sticky_ok=True)


def textfile_problem(path: str, trusted: Optional[Collection[int]] = None) -> Optional[str]:
    """Why the monitor refuses to write the metrics file PATH, or None. TRUSTED: the users
    whose directories it may write in (default: root and this process's user, the monitor's)."""
    from ..base.safepath import Unsafe

    try:
        os.close(open_textfile_dir(path, trusted))
    except Unsafe as exc:
        return f"its directory is not root's alone: {exc.why}"
    except OSError as exc:
        return f"its directory cannot be opened: {exc.strerror or exc}"
    return None


def refuse_unsafe_textfile(layout: Layout) -> None:
    """Raise ConfigError when [metrics] textfile names a file the monitor would not write."""
    from ..policy.config import load_config
    from ..errors import ConfigError

    path = load_config(layout.config_file)["textfile"]
    problem = textfile_problem(path) if path else None
    if problem:
        raise ConfigError(f"[metrics] textfile {path}: {problem}",
                          hint="choose a directory only root may write (or a sticky one of root's, like /tmp)")


def write_textfile(path: str, text: str, private: bool = False) -> None:
    """Replace PATH with TEXT atomically (node_exporter reads only complete *.prom files).

    The text goes to a new file of a random name (O_EXCL, not *.prom: never collected) in the
    checked directory, then is renamed over PATH there; rename replaces whatever a user left
    at PATH in a sticky directory, and never follows it. PRIVATE ([service] private_status):
    the file names users, pids and programs, so it is readable by root and the directory's
    group only (node_exporter's, where it keeps its textfile directory), not by every user."""
    from ..base.safepath import create_new

    name = os.path.basename(path)
    dfd = open_textfile_dir(path)
    try:
        tmp = create_new(dfd, f".{name}.", text.encode(), suffix=".tmp", mode=0o640 if private else 0o644)
        try:
            if private:
                os.chown(tmp, -1, os.fstat(dfd).st_gid, dir_fd=dfd, follow_symlinks=False)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


def device_rows(layout: Layout, inventory: Any) -> List[Dict[str, Any]]:
    """One dict per device for render(): from INVENTORY (None without NVML: the lease files)."""
    held = holdings(str(layout.lease_dir))
    drains = drained(str(layout.root))
    sick = health_drained(str(layout.root))
    from ..health.state import idle_leases

    quiet, _, sampled = idle_leases(str(layout.root))
    if inventory is not None:
        devices = [(d.uuid, d.parent_uuid, d.gpu_index, d.name, d.memory_used_mib) for d in inventory.devices]
    else:
        names = sorted(os.listdir(layout.lease_dir)) if layout.lease_dir.is_dir() else []
        devices = [(u, "", -1, "?", None) for u in names]
    rows = []
    for uuid, parent, gpu, name, used in devices:
        holding = held.get(uuid)
        pid = holding.pid if holding is not None else None
        shares = len(holding.pids) if holding is not None and not holding.exclusive else 0
        user = ""
        if pid is not None:
            uid = real_uid(pid)
            user = "?" if uid is None else user_name(uid)
        rows.append({"uuid": uuid, "gpu": gpu, "name": name, "user": user, "shares": shares,
                     "drained": covering(drains, uuid, parent) is not None,
                     "healthy": covering(sick, uuid, parent) is None,
                     **({"idle_s": round(quiet[uuid].idle_s(sampled))} if uuid in quiet and pid == quiet[uuid].pid else {}),
                     "memory_used_bytes": None if used is None else used << 20})
    return rows


class MonitorHook:
    """The monitor's per-cycle step: the ledger, then the metrics file."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.counters = Counters()
        self.last_error: Optional[str] = None
        self.settings: Dict[str, Any] = {}
        self._signature: Any = None
        problems: List[str] = []
        self._reload()
        for record in ledgerfile.read(ledgerfile.rotated(ledgerfile.ledger_path(layout), self.settings["keep"]), problems):
            if record["event"] == "end":
                self.counters.add_end(record)
        for problem in problems[:10]:
            log.warning("%s", problem)

    def _reload(self) -> None:
        """The [metrics] and [ledger] settings, re-read when the config file changes."""
        from ..errors import ConfigError
        from ..policy.config import DEFAULTS, load_config

        path = self.layout.config_file
        signature = file_signature(path)
        if signature == self._signature and self.settings:
            return
        self._signature = signature
        try:
            config = load_config(path)
            self.settings = {k: config[k] for k in ("textfile", "max_mib", "keep", "private_status")}
        except Exception as exc:  # a broken config is the launch path's to report (exit 78), the monitor's once
            if not isinstance(exc, ConfigError):
                self._say(f"{exc}; accounting keeps its previous settings")
            self.settings = self.settings or {k: DEFAULTS[k] for k in ("textfile", "max_mib", "keep", "private_status")}

    def _say(self, error: Optional[str]) -> None:
        """Log a problem once, and once when it is over: every half second would flood the journal."""
        if error != self.last_error:
            if error:
                log.warning("%s", error)
            elif self.last_error:
                log.warning("accounting is back to normal")
            self.last_error = error

    def cycle(self, inventory: Any = None) -> ledger.Observation:
        self._reload()
        obs = ledger.observe(self.layout, "monitor", (self.settings["max_mib"] << 20, self.settings["keep"]),
                             unless_quiet=True)
        self.counters.add(obs)
        error = obs.error
        path = self.settings["textfile"]
        if path:
            try:
                if inventory is None:
                    inventory = _inventory()
                write_textfile(path, render(device_rows(self.layout, inventory), obs.waiting, self.counters,
                                            _run_rows(self.layout), leftover_counts(self.layout)),
                               self.settings["private_status"])
            except OSError as exc:
                error = error or f"cannot write the metrics file {path}: {exc.strerror or exc}"
            except Unsafe as exc:
                error = error or f"not writing the metrics file {path}: its directory is not root's alone: {exc.why}"
        self._say(error)
        return obs


def leftover_counts(layout: Layout) -> Dict[Tuple[str, str], int]:
    """(device, user) -> leftover processes, as the monitor's health step last saw them."""
    from ..health.state import leftover_list

    out: Dict[Tuple[str, str], int] = {}
    for left in leftover_list(str(layout.root)):
        out[(left.uuid, left.user)] = out.get((left.uuid, left.user), 0) + 1
    return out


def _run_rows(layout: Layout) -> List[Dict[str, Any]]:
    """memwatch's last rows (a cycle old at most, from the monitor)."""
    from ..memory.snapshot import read_snapshot

    snapshot = read_snapshot(layout)
    return list(snapshot["runs"]) if snapshot else []


def _inventory() -> Any:
    from ..devices import nvml
    from ..errors import NvmlUnavailable

    try:
        return nvml.inventory()
    except NvmlUnavailable:
        return None
