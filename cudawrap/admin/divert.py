"""dpkg ownership and diversions: so a package upgrade writes a wrapped program's new binary
to ``CUDAWRAP_<name>`` instead of overwriting the shim link.

The system tools are called through plumbum with explicit ``--root``/``--admindir``. The
dpkg root and data directory come from dpkg's own variables, ``DPKG_ROOT`` and
``DPKG_ADMINDIR``, so cudawrap and the dpkg tools agree on them; the tests point them at
a sandbox. A path on disk is ``DPKG_ROOT`` + the name dpkg knows it by.

Why ``--no-rename`` when adding: wrapping first hard-links the program to
``CUDAWRAP_<name>``; ``dpkg-divert --rename --add`` would then find the target present
(the same inode) and *unlink* ``<name>``, leaving a moment where the program does not
exist. Adding the diversion without renaming and then renaming the shim link over the
name keeps the program runnable throughout. Removing is the mirror image: the real
program is first hard-linked back over the name, then ``--rename --remove`` finds both
names on one inode and just unlinks ``CUDAWRAP_<name>``.
"""
from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Mapping, Optional, Tuple

from ..errors import StateError
from ..paths import REAL_PREFIX

log = logging.getLogger(__name__)

PACKAGE = "cudawrap"

# Top-level directories that merged-/usr systems turn into symlinks to /usr/<dir>: a file
# a package lists as /bin/x lives at /usr/bin/x on disk (and the other way round).
_MERGED_DIRS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

_TOOLS = ("dpkg-query", "dpkg-divert")


@dataclass(frozen=True)
class Dpkg:
    """Where dpkg keeps its files; ``available`` is False on systems without dpkg."""

    root: Path = Path("/")
    admindir: Optional[Path] = None
    available: bool = True

    @classmethod
    def from_environment(cls, environ: Optional[Mapping[str, str]] = None) -> Dpkg:
        environ = os.environ if environ is None else environ
        root = Path(environ.get("DPKG_ROOT") or "/").absolute()
        admindir = environ.get("DPKG_ADMINDIR")
        available = all(shutil.which(tool) for tool in _TOOLS)
        return cls(root, Path(admindir).absolute() if admindir else None, available)

    # --- names -------------------------------------------------------------------

    def name_of(self, path: str) -> Optional[str]:
        """The name dpkg knows PATH by (relative to the dpkg root), None if outside it."""
        root = os.fspath(self.root)
        if root == "/":
            return path
        if not (path == root or path.startswith(root.rstrip("/") + "/")):
            return None
        return "/" + os.path.relpath(path, root)

    def path_of(self, name: str) -> str:
        """The path on disk of the dpkg name NAME."""
        return os.path.join(os.fspath(self.root), name.lstrip("/"))

    def _aliases(self, name: str) -> List[str]:
        """NAME and the other names the same file has on a merged-/usr system."""
        names = [name]
        head, tail = os.path.split(name)
        canonical_dir = self.name_of(os.path.realpath(self.path_of(head)))
        if canonical_dir and os.path.join(canonical_dir, tail) not in names:
            names.append(os.path.join(canonical_dir, tail))
        for top in _MERGED_DIRS:
            short, long = f"/{top}/", f"/usr/{top}/"
            linked = os.path.islink(self.path_of(f"/{top}")) and (
                os.path.realpath(self.path_of(f"/{top}")) == os.path.realpath(self.path_of(f"/usr/{top}"))
            )
            if not linked:
                continue
            for a, b in ((short, long), (long, short)):
                if name.startswith(a) and b + name[len(a):] not in names:
                    names.append(b + name[len(a):])
        return names

    # --- tools ---------------------------------------------------------------------

    def _options(self) -> List[str]:
        opts = [f"--root={self.root}"]
        if self.admindir is not None:
            opts.append(f"--admindir={self.admindir}")
        return opts

    def _run(self, tool: str, args: Iterable[str], ok: Tuple[int, ...] = (0,)) -> Tuple[int, str, str]:
        from plumbum import local

        # The C locale keeps the "diversion by ..." lines recognisable in any language; the
        # explicit --root/--admindir say where, so dpkg's own variables must not interfere.
        env = {"LC_ALL": "C.UTF-8", "DPKG_ROOT": "", "DPKG_ADMINDIR": ""}
        argv = self._options() + list(args)
        log.debug("running %s %s", tool, " ".join(argv))
        # From /: the admin's working directory may be one the command cannot enter (a
        # prefix owner's, or an unmounted one), and dpkg never needs it.
        rc, out, err = local[tool].with_env(**env).run(argv, retcode=None, cwd="/")
        if rc not in ok:
            detail = (err.strip().splitlines() or [f"exit status {rc}"])[-1]
            raise StateError(f"{tool} {' '.join(args)} failed: {detail}")
        return rc, out, err

    def owner(self, path: str) -> Optional[Tuple[str, str]]:
        """(package, dpkg name) of the package that ships PATH, or None if none does."""
        name = self.name_of(path) if self.available else None
        if name is None:
            return None
        names = self._aliases(name)
        # 1 = some pattern matched nothing, not a failure
        _, out, _ = self._run("dpkg-query", ["--search", "--"] + names, ok=(0, 1))
        for line in out.splitlines():
            if line.startswith("diversion by "):
                continue
            packages, sep, listed = line.partition(": ")
            if sep and listed in names:
                return packages, listed
        return None

    def system_package(self, packages: str) -> Optional[Tuple[str, str]]:
        """(package, why) for the first of PACKAGES (as `dpkg-query --search` lists them: "a, b")
        that every system of this kind has: marked Essential, or of Priority required or
        important. None when none is."""
        for package in (p.strip() for p in packages.split(",") if p.strip()):
            _, out, _ = self._run("dpkg-query", ["--show", "--showformat", "${Essential} ${Priority}\\n",
                                                 "--", package], ok=(0, 1))
            essential, _, priority = (out.splitlines() or [""])[0].partition(" ")
            if essential == "yes":
                return package, "marked Essential"
            if priority in ("required", "important"):
                return package, f"of Priority {priority}"
        return None

    def diverter(self, name: str) -> Optional[str]:
        """The package diverting dpkg name NAME ("LOCAL" for a local diversion), or None."""
        if not self.available:
            return None
        _, out, _ = self._run("dpkg-divert", ["--listpackage", name])
        return out.strip() or None

    def add(self, name: str) -> str:
        """Divert NAME to its CUDAWRAP_ name without touching files; returns the target name."""
        target = real_name(name)
        self._run("dpkg-divert", ["--package", PACKAGE, "--no-rename", "--divert", target, "--add", name])
        log.info("dpkg-divert: %s diverted to %s", name, target)
        return target

    def remove(self, name: str, rename: bool) -> None:
        """Remove cudawrap's diversion of NAME; RENAME lets dpkg-divert drop ``CUDAWRAP_<name>``
        (it only unlinks it when NAME is already the same file, see the module doc)."""
        flag = "--rename" if rename else "--no-rename"
        self._run("dpkg-divert", ["--package", PACKAGE, flag, "--divert", real_name(name), "--remove", name])
        log.info("dpkg-divert: diversion of %s removed", name)

    def diversions(self) -> List[Tuple[str, str]]:
        """(path, diverted-to path) on disk of every diversion cudawrap made."""
        if not self.available:
            return []
        _, out, _ = self._run("dpkg-divert", ["--list"])
        found = []
        for line in out.splitlines():
            # "diversion of /usr/bin/x to /usr/bin/CUDAWRAP_x by cudawrap"
            if not (line.startswith("diversion of ") and line.endswith(f" by {PACKAGE}")):
                continue
            body = line[len("diversion of "):-len(f" by {PACKAGE}")]
            name, sep, target = body.rpartition(" to ")
            if sep:
                found.append((self.path_of(name), self.path_of(target)))
        return found


def rpm_package(path: str) -> Optional[str]:
    """The RPM package that owns PATH, or None (also where there is no rpm).

    rpm has nothing like dpkg-divert: an update of the package writes the new binary over
    the shim link, which silently unwraps the program, so wrapping refuses such programs.
    """
    rpm = shutil.which("rpm")
    if rpm is None:
        return None
    from plumbum import local

    rc, out, _ = local[rpm].with_env(LC_ALL="C.UTF-8").run(
        ["-qf", "--queryformat", "%{NAME}\\n", "--", path], retcode=None, cwd="/")
    names = out.split()
    return names[0] if rc == 0 and names else None


def real_name(path: str) -> str:
    """The name the real program of PATH gets: same directory, ``CUDAWRAP_`` prefix."""
    head, tail = os.path.split(path)
    return os.path.join(head, REAL_PREFIX + tail)
