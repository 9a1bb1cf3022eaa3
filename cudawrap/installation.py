"""Laying out an install root: directories with their modes, the runtime area, the shim.

install.sh calls this (through the CLI) for a system install and for ``--prefix``; the
test suite calls it on a temporary root. One code path for all three.
"""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import List

from . import __version__
from .paths import Layout

SHIM_TEMPLATE = "cudawrap-shim.in"
SHIM_STAMP = "# cudawrap shim, version "


def _template() -> str:
    # Installed copies carry the template as package data; a source checkout has it in shims/.
    here = Path(__file__).resolve().parent
    for candidate in (here / "data" / SHIM_TEMPLATE, here.parent / "shims" / SHIM_TEMPLATE):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    raise FileNotFoundError(f"the shim template {SHIM_TEMPLATE} is not installed")


def _import_dirs() -> List[str]:
    """sys.path entries the shim needs: where cudawrap and pynvml are importable from."""
    import pynvml

    dirs = []
    for module_dir in (str(Path(__file__).resolve().parent.parent), str(Path(pynvml.__file__).resolve().parent)):
        if module_dir not in dirs:
            dirs.append(module_dir)
    return dirs


def render_shim(layout: Layout, python: str = sys.executable) -> str:
    text = _template()
    for key, value in (("@PYTHON@", python), ("@VERSION@", __version__),
                       ("@SYSPATH@", repr(_import_dirs())), ("@ROOT@", repr(str(layout.root)))):
        text = text.replace(key, value)
    return text


def shim_version(path: Path) -> str:
    """The version stamped into an installed shim, or "" if it is not one of ours."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(400)
    except OSError:
        return ""
    for line in head.splitlines():
        if line.startswith(SHIM_STAMP):
            return line[len(SHIM_STAMP):].split(". ", 1)[0].rstrip(".")
    return ""


def install_shim(layout: Layout, python: str = sys.executable) -> bool:
    """Write the shim atomically if it differs; True if it changed."""
    text = render_shim(layout, python)
    layout.shim.parent.mkdir(parents=True, exist_ok=True)
    try:
        if layout.shim.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        pass
    tmp = layout.shim.with_name(f".{layout.shim.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, 0o755)
    os.replace(tmp, layout.shim)  # a running launch keeps the old file; a new one gets the new
    return True


def _dir(path: Path, mode: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def prepare_runtime(layout: Layout) -> None:
    """The tmpfs part (/run/cudawrap): lease and queue directories and the queue lock."""
    _dir(layout.runtime_dir, 0o755)
    _dir(layout.lease_dir, 0o755)
    # Sticky and world-writable like /tmp: everyone may queue, nobody may unqueue others.
    _dir(layout.queue_dir, 0o1777)
    fd = os.open(layout.queue_lock, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    os.fchmod(fd, 0o644)
    os.close(fd)


def prepare(layout: Layout, python: str = sys.executable) -> None:
    """Every directory of an install root, the runtime area and the shim."""
    _dir(layout.etc_dir, 0o755)
    _dir(layout.state_dir, 0o755)
    prepare_runtime(layout)
    install_shim(layout, python)
