"""How each wrapped program on disk compares with its registry entry.

Used by ``cudawrap list`` (any user), ``cudawrap unwrap`` (to refuse when disk and
registry disagree) and ``cudawrap doctor``. Reading only: nothing here changes a file.
"""
from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

from ..paths import Layout
from ..policy.registry import WRAPPED, WRAPPING, Entry

# States of a wrap, as `cudawrap list` shows them.
OK = "ok"
REAL_MISSING = "real-missing"  # the real program is gone (its package removed?)
SHIM_REPLACED = "shim-replaced"  # the name is a regular file again (an upgrade overwrote the link)
BINARY_CHANGED = "binary-changed"  # the real program differs from when it was wrapped
NOT_A_LINK = "not-a-cudawrap-link"  # the name is missing or leads somewhere other than the shim
INTERRUPTED = "interrupted"  # a create or unwrap stopped half-way; doctor --repair finishes it
SHIM_OVERWRITTEN = "shim-overwritten"  # a file was copied through the link into the program's own shim
STATES = (OK, REAL_MISSING, SHIM_REPLACED, BINARY_CHANGED, NOT_A_LINK, INTERRUPTED, SHIM_OVERWRITTEN)

# What stands at a wrap's link path.
LINK_SHIM = "shim"  # a symlink that leads to the shim
LINK_SAME = "same-file"  # the same inode as the real program (mid-create or mid-unwrap)
LINK_MISSING = "missing"
LINK_SYMLINK = "symlink"  # a symlink leading elsewhere (or nowhere)
LINK_FILE = "file"  # a regular file that is not the real program
LINK_OTHER = "other"  # a directory, device, ...


@dataclass(frozen=True)
class Facts:
    """What a real program looks like now: contents, permissions, and the stat stamp."""

    sha256: str
    mode: int
    uid: int
    gid: int
    stamp: Tuple[int, int, int, int]  # inode, size, mtime_ns, ctime_ns
    symlink: Optional[str]  # link text when the path itself is a symlink


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stamp_of(st: os.stat_result) -> Tuple[int, int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def facts_of(path: str) -> Facts:
    """Facts of the program at PATH; a symlink is followed for contents and mode."""
    symlink = os.readlink(path) if os.path.islink(path) else None
    st = os.stat(path)
    return Facts(sha256_of(path), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, stamp_of(st), symlink)


def is_shim_link(layout: Layout, path: str) -> bool:
    """Whether PATH is a symlink that leads (possibly through others) to a shim of LAYOUT."""
    return os.path.islink(path) and layout.is_shim_path(path)


def own_shim_state(layout: Layout, link: str) -> str:
    """How the shim LINK leads to stands: "own" (its own shim, intact), "shared" (the
    prototype: wrapped by a version before per-program shims), "missing", or "overwritten"
    (its own shim file holds something else: a build copied through the link)."""
    from ..install.installation import shim_version

    own = layout.program_shim(link)
    if os.path.realpath(link) != os.path.realpath(own):
        return "shared"
    if not os.path.lexists(own):
        return "missing"
    return "own" if shim_version(own) else "overwritten"


def canonical(path: str) -> str:
    """PATH with its directory resolved but not its last component (a link stays a link)."""
    head, tail = os.path.split(os.path.abspath(path))
    return os.path.join(os.path.realpath(head), tail)


def symlink_chain(path: str) -> List[str]:
    """Every name PATH leads through, itself first and the final target last (canonical)."""
    chain = [canonical(path)]
    for _ in range(40):  # the kernel's own limit on symlink chains
        current = chain[-1]
        if not os.path.islink(current):
            break
        target = os.readlink(current)
        chain.append(canonical(os.path.join(os.path.dirname(current), target)))
    return chain


def same_file(a: str, b: str) -> bool:
    """Whether the names A and B are one inode (hard links), without following symlinks."""
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def link_kind(layout: Layout, entry: Entry) -> str:
    """What stands at ENTRY's link path (one of the LINK_* names)."""
    try:
        st = os.lstat(entry.link)
    except FileNotFoundError:
        return LINK_MISSING
    if same_file(entry.link, entry.real):
        return LINK_SAME
    if stat.S_ISLNK(st.st_mode):
        return LINK_SHIM if is_shim_link(layout, entry.link) else LINK_SYMLINK
    if stat.S_ISREG(st.st_mode):
        return LINK_FILE
    return LINK_OTHER


def is_original(entry: Entry, path: str) -> bool:
    """Whether PATH still looks like the program ENTRY recorded before it was wrapped."""
    if entry.symlink is not None:
        return os.path.islink(path) and os.readlink(path) == entry.symlink
    return os.path.isfile(path) and not os.path.islink(path)


def changes(entry: Entry, path: Optional[str] = None) -> List[str]:
    """How the real program (or PATH) differs from ENTRY's record; [] if it does not.

    The checksum is only recomputed when the stat stamp moved, so listing big CUDA
    binaries stays cheap. Raises FileNotFoundError if the program is gone.
    """
    path = entry.real if path is None else path
    found: List[str] = []
    if entry.symlink is not None:
        now = os.readlink(path) if os.path.islink(path) else None
        if now != entry.symlink:
            found.append(f"now {'points to ' + now if now else 'not a symlink'} (was a symlink to {entry.symlink})")
    st = os.stat(path)
    if stat.S_IMODE(st.st_mode) != entry.mode:
        found.append(f"mode {entry.mode:04o} -> {stat.S_IMODE(st.st_mode):04o}")
    if (st.st_uid, st.st_gid) != (entry.uid, entry.gid):
        found.append(f"owner {entry.uid}:{entry.gid} -> {st.st_uid}:{st.st_gid}")
    if entry.stat is None or tuple(entry.stat) != stamp_of(st):
        try:
            sha = sha256_of(path)
        except PermissionError:
            found.append("modified since wrapping (not readable as this user, checksum not compared)")
        else:
            if sha != entry.sha256:
                found.append(f"contents (sha256 {entry.sha256[:12]}... -> {sha[:12]}...)")
    return found


@dataclass(frozen=True)
class WrapStatus:
    """One wrap's state on disk; ``detail`` says in one sentence what differs."""

    entry: Entry
    state: str
    detail: str
    link: str  # one of the LINK_* names
    real_present: bool


def _describe_link(entry: Entry, kind: str) -> str:
    if kind == LINK_MISSING:
        return f"{entry.link} is missing"
    if kind == LINK_SYMLINK:
        return f"{entry.link} now points to {os.readlink(entry.link)}, not to the cudawrap shim"
    if kind == LINK_SAME:
        return f"{entry.link} is the real program again (a hard link of {entry.real})"
    if kind == LINK_FILE:
        return f"{entry.link} is a regular file again, not the shim link (an upgrade or install replaced it)"
    return f"{entry.link} is no longer a file or a link"


def inspect_entry(layout: Layout, entry: Entry) -> WrapStatus:
    kind = link_kind(layout, entry)
    real_present = os.path.lexists(entry.real)
    try:
        diffs = changes(entry) if real_present else []
    except FileNotFoundError:  # a moved symlink whose target is gone
        real_present, diffs = False, []

    def status(state: str, detail: str) -> WrapStatus:
        return WrapStatus(entry, state, detail, kind, real_present)

    if entry.phase != WRAPPED:
        verb = "create" if entry.phase == WRAPPING else "unwrap"
        return status(INTERRUPTED, f"a {verb} of {entry.link} was interrupted; "
                                   "run 'cudawrap doctor --repair' to finish it")
    if kind == LINK_FILE:
        return status(SHIM_REPLACED, _describe_link(entry, kind))
    if kind != LINK_SHIM:
        return status(NOT_A_LINK, _describe_link(entry, kind))
    shim = own_shim_state(layout, entry.link)
    if shim == "overwritten":
        return status(SHIM_OVERWRITTEN, f"the shim of {entry.link} ({layout.program_shim(entry.link)}) was "
                                        "overwritten by another file: a deploy copied a new build through the "
                                        "link? It now runs without a lease")
    if shim == "missing":
        return status(NOT_A_LINK, f"{entry.link} leads to its shim {layout.program_shim(entry.link)}, "
                                  "which is missing")
    if not real_present:
        return status(REAL_MISSING, f"the real program {entry.real} is gone (its package removed?)")
    if layout.is_shim_path(entry.real):
        # Only reachable by hand: cudawrap refuses to wrap the target of a wrapped symlink.
        return status(REAL_MISSING, f"{entry.real} leads back to the cudawrap shim (the program it "
                                    "pointed to was wrapped as well), so it cannot run")
    if diffs:
        return status(BINARY_CHANGED, f"{entry.real} changed since it was wrapped: " + ", ".join(diffs))
    return status(OK, "")


def inspect_all(layout: Layout, entries: Iterable[Entry]) -> List[WrapStatus]:
    return [inspect_entry(layout, e) for e in sorted(entries, key=lambda e: e.link)]
