"""Installing: an install root laid out (runtime.py), its shim (shimfile.py), units (units.py)
enabled where systemd runs (systemctl.py), and everything recorded in a manifest (manifest.py),
which uninstalling (removal.py) reads back.

install.sh calls this (through the CLI) for a system install and for ``--prefix``; the
test suite calls it on a temporary root. One code path for all three. The names of those
modules that callers use are importable from here too.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from .. import __version__
from ..paths import SERVICE, Layout
# Re-exported: callers (the CLI, install.sh's check, doctor, sync, the tests) import these from here.
from .manifest import (  # noqa: F401
    CONFFILE, DIR, FILE, LINK, TREE, InstallError, Manifest, manifest_file, missing_dirs, sha256_of,
)
from .removal import stop_monitor, uninstall  # noqa: F401
from .runtime import ensure_dir, prepare, prepare_runtime  # noqa: F401
from .shimfile import install_program_shim, install_shim, shim_version  # noqa: F401
from .systemctl import systemctl, systemd_running
from .units import (  # noqa: F401
    MONITOR_UNIT, MPS_UNIT, SERVICE_UNIT, UNIT_NAME, UNITS, mps_mode, render_monitor_unit, render_mps_unit,
    render_service_unit, render_tmpfiles,
    render_unit, tmpfiles_file, unit_file, unit_wants_link,
)
from .voice import PROG, installer_say, package_say
from .waiter import build_waiter

# The wrapped programs' shims, rewritten: yields one line per program (cudawrap.admin.shimlinks.refresh_shims).
Refresh = Callable[[Layout], Iterable[str]]


def prepare_package(layout: Layout, python: str, refresh: Refresh) -> None:
    """The .deb's postinst: prepare, then the wrapped programs' own shims (an upgrade, or
    programs handed over by `install.sh --uninstall --keep-wraps`)."""
    prepare(layout, python)
    refresh_program_shims(layout, package_say, refresh)


# --- install.sh's second half -----------------------------------------------------------
#
# install.sh makes the virtual environment and pip-installs the package into it, then runs
# ``python -m cudawrap.cli.installer install`` from that environment for everything else,
# and ``... uninstall`` to take it all away again. Everything created is recorded in a
# manifest in the state directory, so an uninstall removes exactly what an install made.

COMPLETION_SOURCE = "packaging/cudawrap.bash-completion"
COMMANDS = ("cudawrap", "create-cudawrap")


def wheel_dir(layout: Layout) -> Path:
    """Where the client wheel lies for users to pip-install (root/opt/cudawrap/wheels)."""
    return layout.lib_dir / "wheels"


def completion_file(layout: Layout) -> Path:
    return layout.root / "etc" / "bash_completion.d" / "cudawrap"


def command_links(layout: Layout) -> Dict[Path, Path]:
    """bin_dir/NAME -> the venv's console script, for each command put on PATH."""
    return {layout.bin_dir / name: layout.venv_dir / "bin" / name for name in COMMANDS}


def _write_text(path: Path, text: str, mode: int = 0o644) -> bool:
    """Write PATH atomically if its text differs; True if it changed."""
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return True


def check_command_links(layout: Layout) -> None:
    for link, target in command_links(layout).items():
        if os.path.lexists(link) and not (link.is_symlink() and os.readlink(link) == str(target)):
            raise InstallError(f"{link} exists and is not cudawrap's link to {target}: move it "
                               f"aside, then run install.sh again", 73)


def install(layout: Layout, python: str, source: Optional[Path], created: List[Path],
            say: Callable[[str], None] = installer_say, wheel: Optional[Path] = None, build: str = "", *,
            man_pages: Mapping[Path, str], refresh: Refresh, way: Optional[str] = None) -> None:
    """Everything after pip: the install root, config, boot files, commands on PATH.

    CREATED are the directories install.sh made for the virtual environment. WAY: how a new
    install runs (None: a root install with its service, a --prefix one daemonless); an
    upgrade keeps the way it runs (docs/admin/ways.md). MAN_PAGES
    (path -> text) and REFRESH (the wrapped programs' shims, rewritten) come from the
    layers above, which own the CLI definitions and the wraps. Idempotent:
    a re-run (an upgrade) refreshes the shim and the boot files and keeps the config.
    """
    check_command_links(layout)
    manifest = Manifest.load(layout) or Manifest(layout.root)
    upgrade = bool(manifest.entries)
    for path in created:
        if path != layout.venv_dir:
            manifest.add(DIR, path)
    manifest.add(TREE, layout.venv_dir)
    try:
        _install(layout, python, source, manifest, say, man_pages, refresh, way)
        if build:
            write_build(layout, build)
            say(f"==> build: {build} (`cudawrap --version` and `cudawrap doctor` show it)")
        if wheel is not None:
            _install_wheel(layout, wheel, manifest, say)
    finally:
        if layout.state_dir.is_dir():
            manifest.save(layout)
    say(f"==> {'upgraded' if upgrade else 'installed'} cudawrap {__version__} in {layout.root}")


def refresh_program_shims(layout: Layout, say: Callable[[str], None], refresh: Refresh) -> None:
    """An upgrade: each wrapped program's own shim, rewritten for this version by REFRESH."""
    from ..errors import CudawrapError

    try:
        for done in refresh(layout):
            say(f"==> {done}")
    except (CudawrapError, OSError) as exc:
        why = exc.message if isinstance(exc, CudawrapError) else exc.strerror
        say(f"{PROG}: warning: the wrapped programs' shims were not refreshed ({why}); "
            "run `cudawrap doctor --repair` once that is fixed")


def write_build(layout: Layout, build: str) -> None:
    """Record which build this install is (the source's commit, the date) in its venv."""
    from ..paths import BUILD_MARKER

    _write_text(layout.venv_dir / BUILD_MARKER, build.strip() + "\n")


def _install(layout: Layout, python: str, source: Optional[Path], manifest: Manifest,
             say: Callable[[str], None], man_pages: Mapping[Path, str], refresh: Refresh,
             asked: Optional[str] = None) -> None:
    from ..base.cgroup import confinable
    from ..policy.defaults import install_choices, render_config
    from ..paths import ROOT_MARKER

    (layout.venv_dir / ROOT_MARKER).write_text(f"{layout.root}\n", encoding="utf-8")
    trees = (layout.state_dir, layout.runtime_dir)
    for target in (layout.etc_dir, layout.state_dir, layout.runtime_dir, layout.shim.parent, layout.shim_dir):
        for path in missing_dirs(target):
            manifest.add(TREE if path in trees else DIR, path)
    way = _record_way(layout, asked, say)
    shim_existed = layout.shim.exists()
    prepare(layout, python)
    if not shim_existed:
        manifest.add(FILE, layout.shim)
    say(f"==> shim {layout.shim} (interpreter {python}, version {shim_version(layout.shim)})")
    refresh_program_shims(layout, say, refresh)
    waiter_existed = layout.waiter.exists()
    if build_waiter(layout, say) and not waiter_existed:
        manifest.add(FILE, layout.waiter)

    config = layout.config_file
    if os.path.lexists(config):
        say(f"==> kept the configuration {config}")
    elif way == SERVICE and systemd_running(layout) and confinable():
        # The service runs here (enabled below): it confines each run to its own GPUs.
        _write_text(config, render_config(install_choices(True)))
        manifest.replace(CONFFILE, config, sha256=sha256_of(config))
        say(f"==> wrote the default configuration {config} (every setting commented out but "
            f"[confine] runs = true: each run opens its own GPUs only)")
    else:
        _write_text(config, render_config())
        manifest.replace(CONFFILE, config, sha256=sha256_of(config))
        say(f"==> wrote the default configuration {config} (every setting, commented out)")

    _write_files(layout, source, manifest, say, man_pages)

    for parent in missing_dirs(layout.bin_dir):
        manifest.add(DIR, parent)
    layout.bin_dir.mkdir(parents=True, exist_ok=True)
    for link, target in command_links(layout).items():
        if not os.path.lexists(link):
            link.symlink_to(target)
            manifest.add(LINK, link, target=str(target))
        say(f"==> command {link} -> {target}")

    _enable_units(layout, manifest, say, way)


def _record_way(layout: Layout, asked: Optional[str], say: Callable[[str], None]) -> str:
    """The way this install runs: kept on an upgrade (an older install's, as it ran),
    else ASKED, else a root install's service or a --prefix install's daemonless."""
    from .way import DAEMONLESS, record_way

    # State, as the registry is: kept by --uninstall for a later install, gone with --purge.
    way = record_way(layout, asked or (SERVICE if layout.is_system else DAEMONLESS))
    if asked and asked != way:
        say(f"{PROG}: warning: kept the way this install runs ({way}): switch it with `cudawrap way {asked}`")
    else:
        say(f"==> runs {'with the service as its only arbiter' if way == SERVICE else 'daemonless'} "
            f"({layout.way_file}; `cudawrap way` switches it)")
    return way


def _write_files(layout: Layout, source: Optional[Path], manifest: Manifest, say: Callable[[str], None],
                 man_pages: Mapping[Path, str]) -> None:
    """The tmpfiles entry, the units, the man pages and the bash completion, recorded in MANIFEST."""
    files: List[Tuple[Path, str, str]] = [
        (tmpfiles_file(layout), render_tmpfiles(layout), "runtime directory at boot (systemd-tmpfiles)"),
    ] + [(unit_file(layout, name), render(layout), f"unit {name}") for name, render in UNITS.items()]
    files += [(path, text, f"man page {path.name}") for path, text in man_pages.items()]
    completion = source / COMPLETION_SOURCE if source else None
    if completion is not None and completion.is_file():
        files.append((completion_file(layout), completion.read_text(encoding="utf-8"), "bash completion"))
    else:
        say(f"install.sh: warning: no {COMPLETION_SOURCE} in the source; bash completion not installed")
    for path, text, what in files:
        for parent in missing_dirs(path.parent):
            manifest.add(DIR, parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(path):
            manifest.add(FILE, path)
        _write_text(path, text)
        say(f"==> {what}: {path}")


def _enable_units(layout: Layout, manifest: Manifest, say: Callable[[str], None], way: str) -> None:
    """Enable the units that should run (where systemd runs), or say what to run instead."""
    mps = mps_mode(layout)
    if systemd_running(layout):
        enable = [(UNIT_NAME, "`cudawrap sync` runs at every boot")]
        if way == SERVICE:
            enable.append((SERVICE_UNIT, "`cudawrap serve` grants leases and runs the monitor's loop"))
        _retire_monitor_unit(layout, manifest, say)
        if mps:
            enable.append((MPS_UNIT, "an MPS control daemon runs for each shared device"))
        elif unit_wants_link(layout, MPS_UNIT).is_symlink():
            say(f"{PROG}: warning: {MPS_UNIT} is enabled but [sharing] mode is not \"mps\": "
                f"`systemctl disable --now {MPS_UNIT}` stops its daemons")
        else:
            say(f"==> {MPS_UNIT} not enabled: [sharing] mode is not \"mps\" (once it is: "
                f"`systemctl enable --now {MPS_UNIT}`)")
        for name, started in enable:
            # Not the MPS unit --now: its daemons are for the lease files, which the `cudawrap sync`
            # after this makes; install.sh starts the unit after that. The service starts now and
            # takes up the lease files as sync makes them.
            now = ["--now"] if name == SERVICE_UNIT else []
            problem = systemctl("daemon-reload") or systemctl("enable", *now, name)
            if name == SERVICE_UNIT and not problem:
                problem = systemctl("restart", name)  # an upgrade must run the new code
            if problem:
                say(f"install.sh: warning: could not enable {name}: {problem}")
                continue
            if unit_wants_link(layout, name).is_symlink():
                manifest.add(LINK, unit_wants_link(layout, name),
                             target=os.readlink(unit_wants_link(layout, name)))
            say(f"==> enabled {name}: {started}")
    elif layout.is_system:
        say(f"==> {UNIT_NAME} not enabled: systemd is not running here; run `cudawrap sync` "
            f"after every boot (the runtime directory is on /run)")
        if way == SERVICE:
            say(_service_without_systemd(layout, "systemd is not running here"))
        if mps:
            say(f"==> {MPS_UNIT} not enabled: systemd is not running here; run `cudawrap mps start` "
                f"after every boot")
    else:
        say(f"==> {UNIT_NAME} not enabled (a --prefix install); run `cudawrap sync` after a reboot "
            f"or a MIG change")
        if way == SERVICE:
            say(_service_without_systemd(layout, "a --prefix install"))
        if mps:
            say(f"==> {MPS_UNIT} not enabled (a --prefix install); run `cudawrap mps start` yourself")


def _service_without_systemd(layout: Layout, why: str) -> str:
    """The one line on the service (which runs the monitor's loop) where no unit runs it:
    whether it runs already, else how to start it; the monitor alone only where no service
    runs, and then only as the way for launches to skip NVML."""
    from .. import locations as loc
    from ..base.daemon import running

    cudawrap = "cudawrap" if layout.is_system else str(layout.bin_dir / "cudawrap")
    pid = running(loc.under(str(layout.root), loc.SERVICE_LOCK))
    if pid is not None:
        how = (f"`{cudawrap} serve --stop`, then `{cudawrap} serve --daemon`"
               if running(loc.under(str(layout.root), loc.SERVICE_PID)) == pid else "as it was started")
        return f"==> the cudawrap service runs (pid {pid}), the monitor's loop with it; restart it to run this version: {how}"
    return (f"==> {SERVICE_UNIT} not enabled ({why}); start the service, which runs the monitor's loop too, with "
            f"`{cudawrap} serve --daemon` (docs/admin/service.md)")


def _retire_monitor_unit(layout: Layout, manifest: Manifest, say: Callable[[str], None]) -> None:
    """An earlier install's cudawrap-monitor unit: the service runs the same loop, so it goes
    (were it kept, it would only wait for the service's loop: one runs at a time)."""
    link = unit_wants_link(layout, MONITOR_UNIT)
    if not link.is_symlink():
        return
    problem = systemctl("disable", "--now", MONITOR_UNIT)
    if problem:
        say(f"install.sh: warning: could not disable {MONITOR_UNIT}: {problem}")
        return
    manifest.drop(link)
    say(f"==> disabled {MONITOR_UNIT}: {SERVICE_UNIT} runs the monitor's loop")


def _install_wheel(layout: Layout, wheel: Path, manifest: Manifest, say: Callable[[str], None]) -> None:
    """Put WHEEL in wheel_dir, in place of the wheels of earlier versions."""
    import shutil

    target = wheel_dir(layout)
    for parent in missing_dirs(target):
        manifest.add(DIR, parent)
    ensure_dir(target, 0o755)
    for old in target.glob("cudawrap-*.whl"):
        if old.name != wheel.name:
            old.unlink()
            manifest.drop(old)
    dest = target / wheel.name
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    shutil.copyfile(wheel, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)
    manifest.add(FILE, dest)
    say(f"==> client wheel for users' own environments: {dest} (pip install it; see docs/user/python.md)")
