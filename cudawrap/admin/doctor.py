"""``cudawrap doctor``: check the installation and every wrap; ``--repair`` fixes what it can.

Each finding is one line (findings.py says its levels). The installation's checks are here,
the wraps' in doctorwraps.py.
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Callable, Iterable, List, Mapping, Optional

from .. import __version__
from ..base import audit
from ..devices.model import Inventory
from ..errors import CudawrapError
from ..paths import Layout
from ..policy import registry
from ..base.text import printable
from . import wrap
from .divert import Dpkg
from .doctorwraps import WrapChecks
from .findings import LEVEL_ERROR, LEVEL_NOTE, LEVEL_OK, LEVEL_WARNING, Finding

log = logging.getLogger(__name__)


def healthy(findings: Iterable[Finding]) -> bool:
    return not any(f.level == LEVEL_ERROR for f in findings)


class _Doctor(WrapChecks):
    """The installation's checks, over the wraps' (doctorwraps.py)."""

    # --- the installation ------------------------------------------------------------

    def _reinstall(self) -> Optional[Callable[[], str]]:
        try:
            from ..install.installation import install_shim
        except ImportError:
            return None

        def fix() -> str:
            install_shim(self.layout)
            return "reinstalled the shim"

        return fix

    def check_version(self) -> None:
        """Which build runs: the commit or date install.sh or the .deb recorded, if any."""
        from ..paths import version_text

        self.add(LEVEL_OK, "version", f"cudawrap {version_text()}")

    def check_shim(self) -> None:
        shim = os.fspath(self.layout.shim)
        subject = "shim"
        if not os.path.isfile(shim):
            self.problem(subject, f"{shim} is missing; every wrapped program fails (run install.sh)",
                         self._reinstall())
            return
        if not os.access(shim, os.X_OK):
            self.problem(subject, f"{shim} is not executable; every wrapped program fails", self._reinstall())
            return
        with open(shim, "rb") as f:
            first = f.readline(512)
        if first.startswith(b"#!"):
            words = first[2:].decode("utf-8", "replace").split()
            interpreter = words[0] if words else ""
            if os.path.basename(interpreter) == "env" and len(words) > 1:
                interpreter = shutil.which(words[1]) or words[1]
            if not (os.path.isfile(interpreter) and os.access(interpreter, os.X_OK)):
                self.problem(subject, f"the interpreter {interpreter!r} of {shim} is missing or not "
                                      "executable; every wrapped program fails", self._reinstall())
                return
        try:
            from ..install.installation import shim_version
        except ImportError:
            pass
        else:
            found = shim_version(self.layout.shim)
            if found != __version__:
                self.problem(subject, f"{shim} is {'version ' + found if found else 'not a cudawrap shim'}, "
                                      f"not version {__version__}", self._reinstall())
                return
        self.add(LEVEL_OK, subject, shim)

    def check_waiter(self) -> None:
        """The waiter (install/waiter.py) is optional: without it, a run told to wait waits in
        the shim's interpreter, and its hand-over is ~1 ms slower."""
        from .. import waiter_usable

        path, subject = self.layout.waiter, "waiter"
        try:
            st = os.stat(path)
        except OSError:
            self.problem(subject, f"{path} is missing: runs told to wait by the service wait in the shim's "
                                  "interpreter, ~1 ms slower to start once granted (it is built where a C "
                                  "compiler is found)", self._build_waiter(), level=LEVEL_NOTE)
            return
        try:
            owner = os.stat(self.layout.shim).st_uid
        except OSError:
            owner = st.st_uid  # check_shim reports a missing shim
        if not waiter_usable(st, owner):
            self.problem(subject, f"{path} is not the install's own (owner or mode): the shim does not use it",
                         self._build_waiter(), level=LEVEL_WARNING)
            return
        self.add(LEVEL_OK, subject, f"{path}: runs told to wait wait in it")

    def _build_waiter(self) -> Optional[Callable[[], str]]:
        from ..install.waiter import build_waiter

        def fix() -> str:
            said: List[str] = []
            if not build_waiter(self.layout, said.append):
                raise CudawrapError(said[-1].removeprefix("==> ") if said else "not built")
            return "built the waiter"

        return fix

    def check_config(self) -> None:
        from ..policy.config import load_config

        path = self.layout.config_file
        try:
            load_config(path)
        except CudawrapError as exc:
            self.add(LEVEL_ERROR, "config", exc.message)
            return
        self.add(LEVEL_OK, "config", f"{path}" if path.exists() else f"{path} absent: all defaults")

    def check_confine(self) -> None:
        from ..ledger.looks import service_running
        from ..policy.config import load_config
        from .confinecheck import findings

        try:
            config = load_config(self.layout.config_file)
        except CudawrapError:
            return  # check_config reports it
        for level, message in findings(config, service_running(self.layout), self.environ):
            self.add(level, "confine", message)

    def _sync(self) -> Optional[Callable[[], str]]:
        try:
            from ..ops.sync import sync
        except ImportError:
            return None

        def fix() -> str:
            report = sync(self.layout)
            return "ran 'cudawrap sync'" + (f": {len(report.created)} lease file(s) created" if report.created else "")

        return fix

    def check_runtime(self) -> None:
        runtime, lease_dir = self.layout.runtime_dir, self.layout.lease_dir
        devices = self._devices()
        if not runtime.is_dir() or not lease_dir.is_dir():
            missing = runtime if not runtime.is_dir() else lease_dir
            fix = self._sync()
            message = f"{missing} is missing (recreated at boot and by 'cudawrap sync')"
            if self.repair and fix is None:
                message += "; not repaired: cudawrap.ops.sync is not available"
            self.problem("runtime", message, fix)
            return
        try:
            from ..lease.files import SYNC_HINT, check_dir

            check_dir(os.fspath(lease_dir), "lease directory", SYNC_HINT)
        except ImportError:
            pass
        except CudawrapError as exc:
            self.problem("runtime", exc.message, self._sync())
            return
        self.add(LEVEL_OK, "runtime", os.fspath(lease_dir))
        if devices is None:
            return
        from ..lease.claims import elsewhere

        present = devices.uuids()
        others = elsewhere(str(self.layout.root), present)
        if others:
            self.add(LEVEL_NOTE, "leases", f"{len(others)} device(s) managed by another cudawrap install: "
                     + ", ".join(f"{u} by {root}" for u, root in sorted(others.items())))
        present = [u for u in present if u not in others]
        missing_uuids = [u for u in present if not (lease_dir / u).is_file()]
        if missing_uuids:
            self.problem("leases", f"no lease file for {len(missing_uuids)} device(s): {', '.join(missing_uuids)} "
                                   "(run 'cudawrap sync')", self._sync())
        else:
            self.add(LEVEL_OK, "leases", f"a lease file for each of {len(present)} device(s)")
        self._check_slots(devices, present)
        from ..ops.sync import not_renewed

        held = not_renewed(self.layout)
        if held:
            self.add(LEVEL_WARNING, "leases", held)

    def _check_slots(self, devices: Any, present: List[str]) -> None:
        """Slot files for the shared devices: fewer than configured means fewer sharers."""
        from ..lease.sharing import configured

        try:
            sharing = configured(os.fspath(self.layout.root))
        except CudawrapError:
            return  # a broken config is reported by the config check
        if not sharing.anywhere:
            return
        parents = {d.uuid: d.parent_uuid for d in devices.devices}
        short = [u for u in present if any(not (self.layout.share_dir / f"{u}.{k}").is_file()
                                           for k in range(2, sharing.slots_for(u, parents.get(u)) + 1))]
        if short:
            self.problem("sharing", f"fewer slot files than [sharing] slots for {len(short)} device(s): "
                                    f"{', '.join(short)} (run 'cudawrap sync')", self._sync())
        else:
            self.add(LEVEL_OK, "sharing", "slot files for every shared device")
        from ..ops.sync import limit_warnings

        for line in limit_warnings(self.layout, devices):
            self.add(LEVEL_WARNING, "sharing", line)
        self._check_slots_apart()

    def _check_slots_apart(self) -> None:
        """Slots locked by a process that holds no lock on the lease file: shares that keep
        sharers out while the device looks free in its lease (a hand-made flock on slot files)."""
        from ..lease.holders import slots_apart
        from ..ops.status import process_info

        apart = slots_apart(os.fspath(self.layout.lease_dir), os.fspath(self.layout.share_dir))
        if not apart:
            return
        who = "; ".join(f"{uuid}: " + ", ".join("holder unknown" if pid is None else
                                               f"pid {pid} of {process_info(pid)['user']}" for pid in pids)
                        for uuid, pids in sorted(apart.items()))
        self.add(LEVEL_WARNING, "sharing", f"{sum(map(len, apart.values()))} slot(s) locked without the lease "
                                           f"(they count as shares of their holders; shared runs cannot use them): "
                                           f"{printable(who)}")

    def check_monitor(self) -> None:
        """Whether launches are spared NVML: only a fresh snapshot (a live monitor) does that."""
        from ..devices import invcache, snapshot
        from .. import locations as loc
        from ..base.daemon import running

        root = os.fspath(self.layout.root)
        if snapshot.read_fresh(root) is not None:
            self.add(LEVEL_OK, "monitor", "running: launches read its snapshot instead of NVML")
            return
        how = ("each reads NVML for the devices it tries" if invcache.read(root) is not None else
               "each enumerates every device through NVML: no device layout cache, run 'cudawrap sync'")
        pid = running(loc.under(root, loc.MONITOR_LOCK)) or running(loc.under(root, loc.MONITOR_PID))
        if pid:
            self.add(LEVEL_WARNING, "monitor", f"pid {pid} runs but writes no fresh snapshot (see "
                                               f"{loc.under(root, loc.MONITOR_LOG)}): launches pay NVML ({how})")
            return
        self.add(LEVEL_NOTE, "monitor", f"not running: launches pay NVML themselves ({how}); the service runs "
                                        "it ('systemctl enable --now cudawrap', or without systemd "
                                        "'cudawrap serve --daemon'), or alone: 'cudawrap monitor --daemon'")

    def check_service(self) -> None:
        """Which way this install runs (its way file), whether the service answers, and what
        that means: where it is the only arbiter, a user's run without it fails after
        connect_retry_s. And the retired [service] enforce, in one line where it is set."""
        from ..launch import client
        from ..paths import SERVICE, recorded_way
        from ..policy.config import load_config, retired_notes

        root = os.fspath(self.layout.root)
        try:
            config = load_config(self.layout.config_file)
        except CudawrapError:
            config = None  # check_config reports it
        for line in retired_notes(config) if config is not None else []:
            self.add(LEVEL_NOTE, "config", line)
        way = recorded_way(root)
        sock = client.connect(root)
        if sock is not None:
            sock.close()
            said = ("" if way == SERVICE else
                    f" (started by hand: this install runs {way or 'daemonless'}; `cudawrap way service` "
                    f"records it, `cudawrap way daemonless` ends it)")
            self.add(LEVEL_OK, "service", f"this install runs with the service, its only arbiter: answering on "
                                          f"{client.socket_path(root)}{said}")
            return
        if way == SERVICE:
            retry = float(config["connect_retry_s"]) if config is not None else 10.0
            self.add(LEVEL_ERROR, "service", f"this install runs with the service, its only arbiter, and it is not "
                                             f"running: every run of a user other than root fails after "
                                             f"{retry:g} s (exit 69); start it: {client.start_command(root)}")
        else:
            self.add(LEVEL_OK, "service", "this install runs daemonless: runs decide for themselves "
                                          "(`cudawrap way service` switches it)")

    def _devices(self) -> Optional[Inventory]:
        try:
            from ..devices import nvml

            return nvml.inventory()
        except ImportError as exc:
            self.add(LEVEL_NOTE, "leases", f"NVML not importable ({exc}): lease files not checked")
        except CudawrapError as exc:
            self.add(LEVEL_NOTE, "leases", f"NVML unavailable ({exc.message}): lease files not checked")
        return None

    def check_metrics(self) -> None:
        """Whether the monitor will write the metrics file: never where a user could plant it."""
        from ..policy.config import load_config
        from ..monitor.metrics import textfile_problem

        try:
            path = load_config(self.layout.config_file)["textfile"]
        except CudawrapError:
            return  # check_config reports it
        if not path:
            return
        try:  # the monitor runs as root, or as the owner of a prefix install
            trusted = {0, os.stat(self.layout.state_dir).st_uid}
        except OSError:
            trusted = {0}
        problem = textfile_problem(path, trusted)
        if problem:
            self.add(LEVEL_ERROR, "metrics", f"[metrics] textfile {path}: {problem}; the monitor refuses to "
                                             "write it (choose a directory only root may write, or a sticky "
                                             "one of root's)")
        else:
            self.add(LEVEL_OK, "metrics", f"{path}: written by the monitor every cycle")

    def check_audit(self) -> None:
        problem = audit.channel_problem()
        if problem:
            # A note, not a warning: many containers have no syslog, and the ledger still records.
            self.add(LEVEL_NOTE, "audit", f"{problem}; leases are still recorded in the ledger "
                                             f"({self.layout.state_dir}/ledger)")
        else:
            self.add(LEVEL_OK, "audit", f"syslog reachable at {audit.SYSLOG_SOCKET}")


def check(
    layout: Layout,
    *,
    repair: bool = False,
    dpkg: Optional[Dpkg] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> List[Finding]:
    """Every finding about LAYOUT; with REPAIR (admins only), fix what can be fixed."""
    doctor = _Doctor(layout, repair, Dpkg.from_environment() if dpkg is None else dpkg,
                     os.environ if environ is None else environ)
    doctor.check_version()
    doctor.check_shim()
    doctor.check_waiter()
    doctor.check_config()
    doctor.check_runtime()
    doctor.check_service()
    doctor.check_monitor()
    doctor.check_metrics()
    doctor.check_audit()
    doctor.check_confine()
    if repair and os.path.isdir(layout.state_dir):
        with registry.lock(layout):
            reg = doctor.load_registry()
            if reg is not None:
                doctor.check_wraps(reg)
                doctor.check_strays(registry.load(layout))
                if registry.load(layout) != reg:
                    wrap.refresh_launch_cache(layout)
    else:
        reg = doctor.load_registry()
        if reg is not None:
            doctor.check_wraps(reg)
            doctor.check_strays(reg)
    return doctor.findings
