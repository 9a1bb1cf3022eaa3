"""``cudawrap doctor``: check the installation and every wrap; ``--repair`` fixes what it can.

Each finding is one line. Levels: ``ok``, ``note`` (something not checked, and why),
``warning`` (worth knowing, not broken: e.g. a binary upgraded through its diversion),
``error`` (broken: the install is unhealthy), ``fixed`` (was broken, repaired just now).
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, List, Mapping, Optional, Set

from .. import __version__
from ..base import audit
from ..policy import registry
from . import repairs, wrap
from ..devices.model import Inventory
from .divert import PACKAGE, Dpkg, real_name
from ..errors import CudawrapError
from .inspect_wraps import (
    BINARY_CHANGED, INTERRUPTED, LINK_MISSING, LINK_SHIM, NOT_A_LINK, OK, REAL_MISSING, SHIM_OVERWRITTEN,
    SHIM_REPLACED, inspect_all, is_shim_link, own_shim_state, same_file, symlink_chain,
)
from ..paths import REAL_PREFIX, Layout
from ..policy.registry import Registry
from ..base.safepath import unsafe_reason
from ..base.text import printable

log = logging.getLogger(__name__)

LEVEL_OK = "ok"
LEVEL_NOTE = "note"
LEVEL_WARNING = "warning"
LEVEL_ERROR = "error"
LEVEL_FIXED = "fixed"


@dataclass(frozen=True)
class Finding:
    level: str
    subject: str
    message: str

    def line(self) -> str:
        """One line for the admin's terminal: names found on disk are chosen by users, so
        control characters are escaped (a planted name cannot fake or hide a finding)."""
        return printable(f"{self.level}: {self.subject}: {self.message}")


def healthy(findings: Iterable[Finding]) -> bool:
    return not any(f.level == LEVEL_ERROR for f in findings)


class _Doctor:
    def __init__(self, layout: Layout, repair: bool, dpkg: Dpkg, environ: Mapping[str, str]) -> None:
        self.layout = layout
        self.repair = repair
        self.dpkg = dpkg
        self.environ = environ
        self.findings: List[Finding] = []

    def add(self, level: str, subject: str, message: str) -> None:
        self.findings.append(Finding(level, subject, message))

    def problem(self, subject: str, message: str, fix: Optional[Callable[[], str]],
                level: str = LEVEL_ERROR) -> None:
        """Report a problem; with --repair and a FIX, try it and report the outcome instead."""
        if not (self.repair and fix):
            self.add(level, subject, message)
            return
        try:
            done = fix()
        except (CudawrapError, OSError) as exc:
            why = exc.message if isinstance(exc, CudawrapError) else (exc.strerror or str(exc))
            self.add(LEVEL_ERROR, subject, f"{message}; repair failed: {why}")
        else:
            self.add(LEVEL_FIXED, subject, f"{message}; {done}")
            audit.log("repair", subject=subject, problem=message, done=done)

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

    # --- the wraps -------------------------------------------------------------------

    def load_registry(self) -> Optional[Registry]:
        try:
            reg = registry.load(self.layout)
        except CudawrapError as exc:
            self.add(LEVEL_ERROR, "registry", exc.message)
            return None
        self.add(LEVEL_OK, "registry", f"{self.layout.registry_file}: {len(reg)} wrapped program(s)")
        return reg

    def check_wraps(self, reg: Registry) -> None:
        layout, dpkg = self.layout, self.dpkg
        for status in inspect_all(layout, reg):
            entry, state, link = status.entry, status.state, status.entry.link
            why = wrap.unsafe_dir(entry)
            if why is not None:  # never repaired: its owner could redirect whatever root does there
                self.add(LEVEL_ERROR, link, f"{why}: cudawrap no longer acts there; 'cudawrap unwrap --force "
                                            f"{link}' drops its entry and leaves the files to their owner")
            elif state == OK:
                if self._check_own_shim(entry):
                    self._check_diversion(entry)
            elif state == BINARY_CHANGED:
                # Expected after a package upgrade through the diversion: not broken.
                self.problem(link, status.detail, partial(repairs.accept, layout, entry), LEVEL_WARNING)
            elif state == INTERRUPTED:
                self.problem(link, status.detail, partial(repairs.finish, layout, entry, dpkg))
            elif state == SHIM_REPLACED:
                self.problem(link, status.detail, partial(repairs.rewrap, layout, entry, dpkg))
            elif state == SHIM_OVERWRITTEN:
                self.problem(link, status.detail, partial(repairs.adopt_build, layout, entry))
            elif state == REAL_MISSING or (state == NOT_A_LINK and not status.real_present):
                self.problem(link, status.detail + ("" if state == REAL_MISSING else
                                                    f", and {entry.real} is gone"),
                             partial(repairs.forget, layout, entry, dpkg))
            elif state == NOT_A_LINK and status.link in (LINK_MISSING, LINK_SHIM):
                self.problem(link, status.detail, partial(repairs.relink, layout, entry))
            else:
                self.add(LEVEL_ERROR, link, f"{status.detail}; decide by hand: 'cudawrap unwrap --force {link}' "
                                            "keeps both it and the wrapped program")

    def _check_own_shim(self, entry: registry.Entry) -> bool:
        """Whether ENTRY's link leads to its own, current shim (else a finding is added)."""
        from ..install.installation import shim_version

        link, own = entry.link, self.layout.program_shim(entry.link)
        if own_shim_state(self.layout, link) == "shared":
            self.problem(link, "leads to the shim that every wrapped program shared before each got its own: a `cp` "
                               "through any one link would replace them all",
                         partial(wrap.own_shim, self.layout, entry), LEVEL_WARNING)
            return False
        found = shim_version(own)
        if found != __version__:
            self.problem(link, f"its shim {own} is version {found}, not {__version__}",
                         partial(wrap.own_shim, self.layout, entry))
            return False
        return True

    def _check_diversion(self, entry: registry.Entry) -> None:
        link = entry.link
        try:
            if entry.diversion is not None:
                if self.dpkg.diverter(entry.diversion) != PACKAGE:
                    self.problem(link, f"the dpkg diversion of {entry.diversion} is gone: an upgrade of "
                                       f"{entry.package} would replace the shim link",
                                 partial(repairs.ensure_diversion, self.layout, entry, self.dpkg))
                    return
            else:
                owner = self.dpkg.owner(link)
                if owner is not None:
                    self.problem(link, f"package {owner[0]} ships it but it is not diverted: an upgrade "
                                       f"of {owner[0]} would replace the shim link",
                                 partial(repairs.ensure_diversion, self.layout, entry, self.dpkg))
                    return
        except CudawrapError as exc:
            self.add(LEVEL_NOTE, link, f"dpkg not consulted: {exc.message}")
        self.add(LEVEL_OK, link, "wrapped" + (f", diverted from {entry.package}" if entry.diversion else ""))

    def _directories(self, reg: Registry, diversions: List[str]) -> List[str]:
        """Where to look for wraps the registry does not know."""
        dirs: Set[str] = {os.path.dirname(e.link) for e in reg}
        dirs.update(os.path.dirname(p) for p in diversions)
        dirs.add(os.fspath(self.layout.bin_dir))
        dirs.update(d for d in self.environ.get("PATH", "").split(os.pathsep) if os.path.isabs(d))
        try:  # after a lost registry, its last copy still says where the wraps were
            bak = registry.load_path(os.fspath(self.layout.registry_file) + ".bak")
            dirs.update(os.path.dirname(e.link) for e in bak)
        except CudawrapError:
            pass
        return sorted(d for d in dirs if os.path.isdir(d))

    def check_strays(self, reg: Registry) -> None:
        """Wraps without an entry, leftovers of interrupted steps, diversions nobody owns."""
        layout, dpkg = self.layout, self.dpkg
        try:
            diversions = dpkg.diversions()
        except CudawrapError as exc:
            self.add(LEVEL_NOTE, "dpkg", f"diversions not checked: {exc.message}")
            diversions = []
        known = {e.link for e in reg}
        for directory in self._directories(reg, [p for p, _ in diversions]):
            if unsafe_reason(directory) is not None:
                continue  # a user's directory: what is there is theirs, never adopted or moved
            try:
                names = sorted(os.listdir(directory))
            except OSError:
                continue
            for name in names:
                path = os.path.join(directory, name)
                if name.startswith(wrap.TMP_PREFIX):
                    self.problem(path, "a temporary name left by an interrupted cudawrap command",
                                 partial(repairs.remove_tmp, path), LEVEL_WARNING)
                elif name.startswith(REAL_PREFIX) and len(name) > len(REAL_PREFIX):
                    link = os.path.join(directory, name[len(REAL_PREFIX):])
                    if link not in known and not is_shim_link(layout, link):
                        self._stray_real(link, path)
                elif path not in known and self._stray_wrap(path):
                    self._stray_link(path)
        known = {e.link for e in registry.load(layout)} if self.repair else known
        for path, target in diversions:
            if path not in known:
                name = dpkg.name_of(path) or path
                self.problem(path, f"dpkg diverts it to {target} for cudawrap, but nothing is wrapped there",
                             partial(repairs.drop_stray_diversion, dpkg, name))

    def _stray_wrap(self, path: str) -> bool:
        """Whether PATH looks like a wrap: a link straight to the shim, or one leading to it
        with a CUDAWRAP_ program beside it. A user's alias of a wrapped program
        (/usr/local/bin/x -> /opt/app/bin/x -> shim) is neither."""
        if not is_shim_link(self.layout, path):
            return False
        chain = symlink_chain(path)
        return len(chain) == 2 or os.path.lexists(real_name(path))

    def _stray_link(self, path: str) -> None:
        real = real_name(path)
        if os.path.lexists(real):
            self.problem(path, f"a shim link with its real program {real} but no registry entry",
                         lambda: repairs.adopt(self.layout, path, self.dpkg))
        else:
            self.add(LEVEL_ERROR, path, f"a shim link without a real program ({real} is missing) or a "
                                        "registry entry; remove it, or put the program back as "
                                        f"{real} and run 'cudawrap doctor --repair'")

    def _stray_real(self, link: str, real: str) -> None:
        if same_file(link, real):
            def fix() -> str:
                os.unlink(real)
                return f"removed the second name {real} (the program itself is untouched)"

            self.problem(real, f"left by an interrupted create: the same file as {link}, no registry entry",
                         fix, LEVEL_WARNING)
        elif not os.path.lexists(link):
            def fix() -> str:
                os.link(real, link, follow_symlinks=False)  # fails rather than overwrite
                os.unlink(real)
                return f"put it back as {link}"

            self.problem(real, f"a real program renamed by cudawrap, but {link} is missing and there is "
                               "no registry entry", fix)
        else:
            self.add(LEVEL_NOTE, real, f"not managed by cudawrap ({link} is not a shim link; "
                                       "left by the old cudawrap scripts?); left alone")


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
