"""Every location cudawrap uses, derived from one install root.

A system install has root ``/``; ``install.sh --prefix DIR`` (and the test suite) use
DIR, so the same code paths run inside a temporary directory without root.
"""
from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import locations as loc

# install.sh writes the root here, inside the private virtual environment, so the CLI
# entry points know where they were installed without any environment variable.
ROOT_MARKER = "cudawrap-root"
# Which build is installed (the source's commit, the install or build date), beside it:
# written once by install.sh or the .deb's build, read by --version and doctor.
BUILD_MARKER = "cudawrap-build"
REAL_PREFIX = loc.REAL_PREFIX
# Room for a temporary name's prefix and the digest within NAME_MAX (255 bytes).
SHIM_NAME_BYTES = 200


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def etc_dir(self) -> Path:
        return (self.root / loc.CONFIG_FILE).parent

    @property
    def config_file(self) -> Path:
        return self.root / loc.CONFIG_FILE

    @property
    def state_dir(self) -> Path:
        return self.root / loc.STATE_DIR

    @property
    def registry_file(self) -> Path:
        return self.root / loc.REGISTRY_FILE

    @property
    def way_file(self) -> Path:
        return self.root / loc.WAY_FILE

    @property
    def registry_lock(self) -> Path:
        return self.root / loc.REGISTRY_LOCK

    @property
    def runtime_dir(self) -> Path:
        # /run is tmpfs: recreated at boot by systemd-tmpfiles and `cudawrap sync`.
        return self.root / loc.RUNTIME_DIR

    @property
    def lease_dir(self) -> Path:
        return self.root / loc.LEASE_DIR

    @property
    def queue_dir(self) -> Path:
        return self.root / loc.QUEUE_DIR

    @property
    def share_dir(self) -> Path:
        return self.root / loc.SHARE_DIR

    @property
    def mps_dir(self) -> Path:
        return self.root / loc.MPS_DIR

    @property
    def mps_log_dir(self) -> Path:
        return self.root / loc.MPS_LOG_DIR

    @property
    def queue_lock(self) -> Path:
        return self.root / loc.QUEUE_LOCK

    @property
    def launch_cache(self) -> Path:
        return self.root / loc.LAUNCH_CACHE

    @property
    def usage_snapshot(self) -> Path:
        return self.root / loc.USAGE_SNAPSHOT

    @property
    def inventory_cache(self) -> Path:
        return self.root / loc.INVENTORY_CACHE

    @property
    def service_key(self) -> Path:
        return self.root / loc.SERVICE_KEY

    @property
    def service_waiters(self) -> Path:
        return self.root / loc.SERVICE_WAITERS

    @property
    def lib_dir(self) -> Path:
        return self.root / loc.LIB_DIR

    @property
    def venv_dir(self) -> Path:
        return self.lib_dir / "venv"

    @property
    def shim(self) -> Path:
        return self.root / loc.SHIM

    @property
    def waiter(self) -> Path:
        return self.root / loc.WAITER

    @property
    def shim_dir(self) -> Path:
        return self.root / loc.SHIM_DIR

    def program_shim(self, link: str) -> Path:
        """The shim file of the program wrapped at LINK: its name, cut short, and a digest of
        the whole path (two programs may share a name in different directories)."""
        digest = hashlib.sha256(os.fsencode(link)).hexdigest()[:16]
        name = os.fsencode(os.path.basename(link))[:SHIM_NAME_BYTES].decode("utf-8", "surrogateescape")
        return self.shim_dir / f"{name}.{digest}"

    def is_shim_path(self, path: str) -> bool:
        """Whether PATH resolves to a shim of this install: the prototype, or any program's own."""
        real = os.path.realpath(path)
        return (real == os.path.realpath(self.shim)
                or os.path.dirname(real) == os.path.realpath(self.shim_dir))

    @property
    def bin_dir(self) -> Path:
        return self.root / "usr" / "local" / "bin"

    @property
    def is_system(self) -> bool:
        return self.root == Path("/")

    @property
    def installed(self) -> bool:
        """Whether an install is at the root: the shim, the state directory or the config that
        install.sh, the .deb or a --prefix install lays out (the runtime area alone is not one:
        it is gone after a reboot, and `cudawrap sync` makes it)."""
        return self.shim.exists() or self.state_dir.is_dir() or self.config_file.exists()

    def lease_file(self, uuid: str) -> Path:
        return self.lease_dir / uuid


# The two ways an install runs, and the one recorded (locations.py: the general launch reads it).
SERVICE, DAEMONLESS, WAYS, recorded_way = loc.SERVICE, loc.DAEMONLESS, loc.WAYS, loc.recorded_way


def installed_root() -> Optional[Path]:
    """The root recorded by install.sh in the running virtual environment, if any."""
    try:
        text = (Path(sys.prefix) / ROOT_MARKER).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return Path(text) if text else None


def installed_build() -> str:
    """What install.sh or the .deb recorded about the running build ("" if nothing)."""
    try:
        return (Path(sys.prefix) / BUILD_MARKER).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return ""


def version_text() -> str:
    """The version, with the installed build when one was recorded: `0.1.0 (commit …, installed …)`."""
    from . import __version__

    build = installed_build()
    return f"{__version__} ({build})" if build else __version__


def default_layout() -> Layout:
    """The layout the admin CLI works on: ``$CUDAWRAP_ROOT``, else the installed root, else ``/``."""
    env = os.environ.get("CUDAWRAP_ROOT")
    if env:
        return Layout(Path(env).absolute())
    return Layout(installed_root() or Path("/"))
