"""`cudawrap doctor`'s checks of the wraps: the registry, each wrapped program as it is on
disk, and strays (wraps without an entry, leftovers of interrupted steps, diversions nobody
owns). With --repair, repairs.py's fixes are tried."""
from __future__ import annotations

import os
from functools import partial
from typing import List, Optional, Set

from .. import __version__
from ..base.safepath import unsafe_reason
from ..errors import CudawrapError
from ..paths import REAL_PREFIX
from ..policy import registry
from ..policy.registry import Registry
from . import repairs
from .divert import PACKAGE, real_name
from .findings import LEVEL_ERROR, LEVEL_NOTE, LEVEL_OK, LEVEL_WARNING, Checkup
from .inspect_wraps import (
    BINARY_CHANGED, INTERRUPTED, LINK_MISSING, LINK_SHIM, NOT_A_LINK, OK, REAL_MISSING, SHIM_OVERWRITTEN,
    SHIM_REPLACED, inspect_all, is_shim_link, own_shim_state, same_file, symlink_chain,
)
from .shimlinks import TMP_PREFIX, own_shim
from .wrap import unsafe_dir


class WrapChecks(Checkup):
    """The checks of the wraps, for the doctor (which adds the installation's)."""

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
            why = unsafe_dir(entry)
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
                         partial(own_shim, self.layout, entry), LEVEL_WARNING)
            return False
        found = shim_version(own)
        if found != __version__:
            self.problem(link, f"its shim {own} is version {found}, not {__version__}",
                         partial(own_shim, self.layout, entry))
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
                if name.startswith(TMP_PREFIX):
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
