"""The shim: its prototype rendered with the install's interpreter, version, import path and
root, written where it belongs (the shared prototype, and each wrapped program's own)."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

from .. import __version__
from ..paths import Layout

SHIM_TEMPLATE = "cudawrap-shim.in"
SHIM_STAMP = "# cudawrap shim, version "


def shim_template() -> str:
    """The shim's prototype, unrendered (shims/cudawrap-shim.in)."""
    # shims/ ships as the package cudawrap.shims (see pyproject.toml), installed or editable;
    # run straight from a source checkout (PYTHONPATH), it is shims/ beside the package.
    try:
        from .. import shims
    except ImportError:
        where = Path(__file__).resolve().parents[2] / "shims"  # cudawrap/install/ -> the checkout
    else:
        where = Path(shims.__file__).parent
    return (where / SHIM_TEMPLATE).read_text(encoding="utf-8")


def _import_dirs() -> List[str]:
    """sys.path entries the shim needs: where cudawrap and pynvml are importable from."""
    import pynvml

    dirs = []
    # cudawrap/install/installation.py -> the directory that holds the package cudawrap
    for module_dir in (str(Path(__file__).resolve().parents[2]), str(Path(pynvml.__file__).resolve().parent)):
        if module_dir not in dirs:
            dirs.append(module_dir)
    return dirs


def render_shim(layout: Layout, python: str = sys.executable, link: Optional[str] = None) -> str:
    """The shim prototype, or with LINK the own shim of the program wrapped there."""
    text = shim_template()
    for key, value in (("@PYTHON@", python), ("@VERSION@", __version__),
                       ("@SYSPATH@", repr(_import_dirs())), ("@ROOT@", repr(str(layout.root))),
                       ("@LINK@", repr(link))):
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


def _write_shim(path: Path, text: str) -> bool:
    """Write a shim atomically if it differs; True if it changed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    tmp = path.with_name(f".new.{os.getpid()}.{path.name[-16:]}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)  # a running launch keeps the old file; a new one gets the new
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


def install_shim(layout: Layout, python: str = sys.executable) -> bool:
    """Write the shim prototype if it differs; True if it changed."""
    return _write_shim(layout.shim, render_shim(layout, python))


def shim_python(layout: Layout) -> str:
    """The interpreter install.sh baked into the prototype (this one if there is none)."""
    try:
        with open(layout.shim, "rb") as f:
            first = f.readline(4096).decode("utf-8", "surrogateescape")
    except OSError:
        return sys.executable
    words = first[2:].split() if first.startswith("#!") and shim_version(layout.shim) else []
    return words[0] if words else sys.executable


def install_program_shim(layout: Layout, link: str) -> bool:
    """Write the own shim of the program wrapped at LINK (its interpreter: the prototype's)."""
    layout.shim_dir.mkdir(parents=True, exist_ok=True)
    return _write_shim(layout.program_shim(link), render_shim(layout, shim_python(layout), link))
