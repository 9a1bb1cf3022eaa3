"""Uninstalling: what an install's manifest records removed (install.sh --uninstall), the
daemons stopped first, the wraps refused, unwrapped or kept for the Debian package.

The state directory stays unless --purge, as dpkg's remove keeps a package's state.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Dict, List, Set

from ..paths import Layout
from .manifest import CONFFILE, DIR, FILE, LINK, TREE, InstallError, Manifest, manifest_file, sha256_of
from .systemctl import systemctl, systemd_running
from .units import UNITS, unit_file
from .voice import installer_say


def _wrapped(layout: Layout, environ: Dict[str, str]) -> List[str]:
    """The links of the wrapped programs, as `cudawrap list --json` reports them."""
    import json
    import subprocess

    done = subprocess.run([str(layout.venv_dir / "bin" / "cudawrap"), "list", "--json"], env=environ,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise InstallError(f"cannot list the wrapped programs: {last}", done.returncode or 1)
    return [row["link"] for row in json.loads(done.stdout)]


def stop_monitor(layout: Layout, say: Callable[[str], None] = installer_say, why: str = "") -> None:
    """Stop a `cudawrap monitor --daemon` and a `cudawrap serve --daemon` of LAYOUT (the monitor
    would recreate the runtime area, the service keep its socket there), and say so."""
    from .. import locations as loc
    from ..base.daemon import stop

    for command, where in (("monitor", loc.MONITOR_PID), ("serve", loc.SERVICE_PID)):
        pid_file = loc.under(str(layout.root), where)
        try:
            pid = stop(pid_file)
        except OSError as exc:  # it will not exit, its pid is unreadable, or it is not ours to signal
            raise InstallError(f"cannot stop `cudawrap {command} --daemon` ({pid_file}): {exc.strerror or exc}; "
                               f"stop it yourself, then run this again", 75) from None
        if pid is not None:
            say(f"==> stopped `cudawrap {command} --daemon` (pid {pid}){why}")


# What --keep-wraps leaves for the Debian package, which takes over the same layout.
def _handed_over(layout: Layout) -> List[Path]:
    return [layout.state_dir, layout.runtime_dir, layout.config_file, layout.shim]


def uninstall(layout: Layout, unwrap_all: bool, say: Callable[[str], None] = installer_say,
              keep_wraps: bool = False, purge: bool = False) -> None:
    """Remove what the manifest records; refuse while programs are wrapped (unless UNWRAP_ALL).

    The state directory (the registry, drains, the ledger and the usage history) stays, as
    dpkg's remove keeps a package's state, unless PURGE, which also removes an edited
    configuration. The install's device claims go (lease/claims.py): the devices are free
    for another install at once.

    KEEP_WRAPS is the move to the Debian package: the wrapped programs, their shims, the
    registry and state, the configuration, the runtime area (the leases of running
    programs) and the device claims stay for the package, which installs the same layout.
    """
    manifest = Manifest.load(layout)
    if manifest is None:
        raise InstallError(f"no install manifest {manifest_file(layout)}: cudawrap was not installed "
                           f"in {layout.root} by install.sh", 66)
    environ = dict(os.environ, CUDAWRAP_ROOT=str(layout.root))
    wrapped = _wrapped(layout, environ)
    if wrapped and not (unwrap_all or keep_wraps):
        raise InstallError(
            f"{len(wrapped)} program(s) still wrapped: {', '.join(wrapped)}; unwrap them with install.sh "
            f"--uninstall --unwrap-all, or, moving to the Debian package, keep them for it with "
            f"install.sh --uninstall --keep-wraps", 65)
    # Before anything is removed, so that a monitor that will not stop leaves all as it was.
    stop_monitor(layout, say, " (once the package is installed, start it again where systemd does not run)"
                 if keep_wraps else "")
    if wrapped and unwrap_all:
        _unwrap_all(layout, environ, len(wrapped), say)
    _stop_units(layout, environ, say)
    _open_nodes(layout, say)
    kept = {str(p) for p in _handed_over(layout)} if keep_wraps else set() if purge else {str(layout.state_dir)}
    if not keep_wraps:
        _release_claims(layout, say)
    _remove_recorded(layout, manifest, kept, say, purge)
    if purge:
        _purge_kept(layout, say)
    if not keep_wraps:
        say(f"==> removed cudawrap from {layout.root}")
        if not purge and layout.state_dir.is_dir():
            again = "" if layout.is_system else f" --prefix {layout.root}"
            say(f"==> kept {layout.state_dir}/ (the registry, the ledger and the usage history), as a reinstall "
                f"takes it up again; remove it with: install.sh --uninstall --purge{again}")
        return
    say(f"==> removed install.sh's cudawrap from {layout.root}, keeping for the Debian package: the wrapped "
        f"programs and their shims ({layout.shim_dir}), {layout.state_dir} (registry, drains, ledger), "
        f"{layout.config_file} and {layout.runtime_dir} (the leases of running programs)")
    say("==> wrapped programs cannot start until the package is installed: now run "
        "`sudo apt-get install ./cudawrap_VERSION_ARCH.deb` (or `sudo ./install.sh` to go back)")


def _open_nodes(layout: Layout, say: Callable[[str], None]) -> None:
    """GPU nodes the stopped service closed ([confine] nodes = "leased") put back as they were."""
    from ..base import nodemodes

    state = os.path.join(layout.state_dir, "nodes.saved")  # confine/nodes.py's STATE_NAME
    try:
        count = nodemodes.put_back(state)
    except (OSError, ValueError) as exc:
        say(f"==> warning: the GPU nodes could not be put back as they were ({state}): {exc}")
        return
    if count:
        say(f"==> put back {count} GPU node(s) as they were before [confine] nodes = \"leased\"")


def _unwrap_all(layout: Layout, environ: Dict[str, str], count: int, say: Callable[[str], None]) -> None:
    """`cudawrap unwrap --all`; InstallError, with nothing removed, unless all COUNT are unwrapped."""
    import subprocess

    say(f"==> unwrapping {count} program(s)")
    done = subprocess.run([str(layout.venv_dir / "bin" / "cudawrap"), "unwrap", "--all"], env=environ)
    left = _wrapped(layout, environ)
    if done.returncode != 0 or left:
        raise InstallError(f"`cudawrap unwrap --all` failed (exit {done.returncode}); nothing else was "
                           f"removed: fix what it says, or `cudawrap unwrap --force` what is left",
                           done.returncode or 65)


def _stop_units(layout: Layout, environ: Dict[str, str], say: Callable[[str], None]) -> None:
    """Disable the install's units, and stop MPS daemons started without them."""
    import subprocess

    for name in UNITS:
        if unit_file(layout, name).exists() and systemd_running(layout):
            problem = systemctl("disable", "--now", name)
            if problem:
                say(f"install.sh: warning: could not disable {name}: {problem}")
            else:
                say(f"==> disabled {name}")
    if layout.mps_dir.is_dir() and os.listdir(layout.mps_dir):
        # Daemons started by hand, or without systemd: their pipe directories are about to go.
        done = subprocess.run([str(layout.venv_dir / "bin" / "cudawrap"), "mps", "stop"], env=environ)
        if done.returncode != 0:
            say(f"install.sh: warning: `cudawrap mps stop` failed (exit {done.returncode}); "
                f"MPS control daemons may still run")


def _purge_kept(layout: Layout, say: Callable[[str], None]) -> None:
    """--purge: the state and the configuration that an earlier uninstall kept and this install
    took up (so its manifest does not record them), and their directories where empty: in a
    prefix, those an install makes; in the system's, /etc/cudawrap only."""
    import shutil

    state, config = layout.state_dir, layout.config_file
    if state.is_dir() and not state.is_symlink():
        shutil.rmtree(state)
        say(f"==> removed {state}/")
    if config.is_file() and not config.is_symlink():
        config.unlink()
        say(f"==> removed {config}")
    dirs = [config.parent] + ([] if layout.is_system else [state.parent, state.parent.parent, config.parent.parent])
    for path in dirs:
        try:
            path.rmdir()
        except OSError:
            pass  # not empty, or gone


def _release_claims(layout: Layout, say: Callable[[str], None]) -> None:
    """Remove the install's machine-wide device claims, and say how many."""
    from ..lease.claims import claims_dir, release

    released = release(str(layout.root))
    if released:
        say(f"==> released the claims on {len(released)} device(s) in {claims_dir()}")


def _remove_recorded(layout: Layout, manifest: Manifest, kept: Set[str], say: Callable[[str], None],
                     purge: bool = False) -> None:
    """Remove what MANIFEST records but the paths in KEPT: files first, then the manifest, then
    the directories deepest first."""
    entries = manifest.entries
    dirs = sorted((e for e in entries if e.get("kind") == DIR), key=lambda e: -e["path"].count("/"))
    others = [e for e in entries if e.get("kind") != DIR]
    # The venv goes last: this very interpreter runs from it.
    others.sort(key=lambda e: e["path"] == str(layout.venv_dir))
    for entry in others:
        _remove(layout, entry, kept, say, purge)
    if os.path.lexists(manifest_file(layout)):
        manifest_file(layout).unlink()
    for entry in dirs:
        _remove(layout, entry, kept, say, purge)
    if systemd_running(layout):
        systemctl("daemon-reload")


def _remove(layout: Layout, entry: Dict[str, str], kept: Set[str], say: Callable[[str], None],
            purge: bool = False) -> None:
    """Remove one thing the manifest records, as far as it is still what install.sh made
    (PURGE: an edited configuration too)."""
    import shutil

    kind, path = entry.get("kind"), Path(entry["path"])
    if str(path) in kept:
        return
    if not (str(path).startswith(str(layout.root).rstrip("/") + "/") or str(path) == str(layout.root)):
        say(f"install.sh: warning: {path} is outside {layout.root}; left alone")
        return
    if kind == TREE and str(path) in {str(layout.venv_dir), str(layout.state_dir), str(layout.runtime_dir)}:
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            return
        say(f"==> removed {path}/")
    elif kind == LINK:
        if path.is_symlink() and os.readlink(path) == entry.get("target"):
            path.unlink()
            say(f"==> removed {path}")
    elif kind == CONFFILE:
        if not os.path.lexists(path):
            return
        if path.is_file() and not path.is_symlink() and (purge or sha256_of(path) == entry.get("sha256")):
            path.unlink()
            say(f"==> removed {path}")
        else:
            say(f"==> kept {path}: it was edited after install (install.sh --uninstall --purge removes it)")
    elif kind == FILE:
        if os.path.lexists(path) and not path.is_dir():
            path.unlink()
            say(f"==> removed {path}")
    elif kind == DIR:
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            if path != layout.root and not any(k.startswith(f"{path}/") for k in kept):
                say(f"==> kept {path}/: not empty")
