"""The install manifest: what install.sh created under one root, so that an uninstall
removes exactly that."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

from .. import __version__
from ..paths import Layout

MANIFEST_NAME = "install-manifest.json"
MANIFEST_VERSION = 1
# Kinds of manifest entry and what an uninstall does with each.
DIR = "dir"  # removed when empty
TREE = "tree"  # removed with everything in it (venv, state and runtime directories only)
FILE = "file"  # removed
LINK = "link"  # removed while it still points where we pointed it
CONFFILE = "conffile"  # removed unless edited since (its sha256 differs), like dpkg's conffiles


class InstallError(Exception):
    """One line for install.sh to print; the exit code it should return."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def manifest_file(layout: Layout) -> Path:
    return layout.state_dir / MANIFEST_NAME


def sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


class Manifest:
    """What install.sh created under one root, in creation order (paths are absolute)."""

    def __init__(self, root: Path, entries: Optional[List[Dict[str, str]]] = None) -> None:
        self.root = root
        self.entries: List[Dict[str, str]] = list(entries or [])

    def get(self, path: Path) -> Optional[Dict[str, str]]:
        for entry in self.entries:
            if entry["path"] == str(path):
                return entry
        return None

    def add(self, kind: str, path: Path, **extra: str) -> None:
        """Record PATH (the first record of a path wins: it says what was there before us)."""
        if self.get(path) is None:
            self.entries.append({"kind": kind, "path": str(path), **extra})

    def drop(self, path: Path) -> None:
        """Forget PATH (it is no longer ours to remove at uninstall)."""
        self.entries = [e for e in self.entries if e["path"] != str(path)]

    def replace(self, kind: str, path: Path, **extra: str) -> None:
        """Record PATH anew (a file written again, whose old record is out of date)."""
        self.drop(path)
        self.add(kind, path, **extra)

    @classmethod
    def load(cls, layout: Layout) -> Optional["Manifest"]:
        import json

        path = manifest_file(layout)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise InstallError(f"{path}: cannot read the install manifest ({exc}); remove what "
                               f"cudawrap installed by hand") from None
        if not isinstance(doc, dict) or doc.get("version") != MANIFEST_VERSION or \
                not isinstance(doc.get("entries"), list):
            raise InstallError(f"{path}: not an install manifest this install.sh can read")
        if doc.get("root") != str(layout.root):
            raise InstallError(f"{path}: it records an install into {doc.get('root')}, not {layout.root}")
        return cls(layout.root, [e for e in doc["entries"] if isinstance(e, dict) and "path" in e])

    def save(self, layout: Layout) -> None:
        import json

        path = manifest_file(layout)
        doc = {"version": MANIFEST_VERSION, "root": str(self.root), "cudawrap_version": __version__,
               "entries": self.entries}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)


def missing_dirs(path: Path) -> List[Path]:
    """PATH and those of its ancestors that do not exist yet, outermost first."""
    out: List[Path] = []
    while not os.path.lexists(path) and path != path.parent:
        out.append(path)
        path = path.parent
    return out[::-1]
