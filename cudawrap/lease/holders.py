"""Who holds which device's lease: the lock table checked against the holders' descriptors.

For status, the ledger, metrics, cancel and the monitor. Apart from leases.py so that
the shim, which only takes leases, does not load it on every launch.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Iterable, List, Optional, Tuple

    Table = Dict[Tuple[int, int], List[Tuple[int, bool]]]

from .files import first_pids, lock_kind, lock_table


def proc_locks() -> Dict[Tuple[int, int], int]:
    """(device, inode) -> pid that took a granted flock on it (/proc/locks); see lock_table."""
    return first_pids(lock_table())


def every_pid() -> List[int]:
    """The pid of every process now, in order (/proc)."""
    return sorted(int(p) for p in os.listdir("/proc") if p.isdigit())


def fd_holders(files: Iterable[Tuple[int, int]], pids: Iterable[int],
               named: Optional[Dict[Tuple[int, int], str]] = None) -> Dict[Tuple[int, int], List[int]]:
    """(device, inode) -> those of PIDS that hold a flock on that file now.

    A process counts when one of its descriptors is open on the file and that descriptor's
    open file description owns the lock: what holding a lease means. Processes whose
    descriptors we may not read (another user's, for a user) are not counted. With NAMED
    ((device, inode) -> a name), only a descriptor the kernel names so counts (a replaced
    file is "PATH (deleted)"; a new file given its freed inode's number is named otherwise).
    """
    wanted = set(files)
    found: Dict[Tuple[int, int], List[int]] = {}
    for pid in pids:
        base = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(base)
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"{base}/{fd}")
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key not in wanted or pid in found.get(key, ()):
                continue
            if named is not None and _target(f"{base}/{fd}") != named[key]:
                continue
            if lock_kind(int(fd), str(pid)) is not None:
                found.setdefault(key, []).append(pid)
    return found


def _target(link: str) -> str:
    try:
        return os.readlink(link)
    except OSError:
        return ""


class Holding:
    """Who holds one device's lease: one exclusive holder, or its sharers."""

    __slots__ = ("exclusive", "pids")

    def __init__(self, exclusive: bool, pids: List[Optional[int]]) -> None:
        self.exclusive = exclusive
        self.pids = pids  # one per lock (a share each), None where the holder cannot be named

    @property
    def pid(self) -> Optional[int]:
        known = [p for p in self.pids if p is not None]
        return min(known) if known else None


def locked_files(directory: str, table: Table) -> Dict[Tuple[int, int], str]:
    """(device, inode) -> name of each file in DIRECTORY that TABLE (lock_table()) shows
    locked: which lease or slot file each locked file of the table is."""
    files: Dict[Tuple[int, int], str] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return files
    for name in names:
        try:
            st = os.stat(directory + "/" + name, follow_symlinks=False)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in table:
            files[(st.st_dev, st.st_ino)] = name
    return files


def holdings(lease_dir: str, table: Optional[Table] = None) -> Dict[str, Holding]:
    """uuid -> who holds each held lease, a pid per lock (None where none can be named).

    /proc/locks says which lease files are locked and which pid took each lock, but that
    process may be gone (its child holds the lease now) and the pid reused by an innocent
    one: a pid is named only if it holds the lock through a descriptor now. Otherwise
    every process is searched; None (held, holder unknown) where the holder's descriptors
    cannot be read. TABLE: the lock table to read (default: read now).
    """
    table = lock_table() if table is None else table
    return _holdings(locked_files(lease_dir, table), table)


def takers(lease_dir: str, table: Table) -> Dict[str, List[int]]:
    """uuid -> the pids that took the locks on its lease file, as TABLE (the lock table)
    names them: no descriptor is read, so a taker may have exited since (its child holding the
    lease) or its pid been reused. For a look that only asks whether anything changed."""
    return {name: [pid for pid, _ex in table[key]] for key, name in locked_files(lease_dir, table).items()}


def slots_apart(lease_dir: str, share_dir: str, table: Optional[Table] = None) -> Dict[str, List[Optional[int]]]:
    """uuid -> the holder of each of its slot files locked apart from its lease file (by a
    process that took no lock on the lease file: a share nobody sees in the lease, which
    keeps sharers out all the same); None where the holder cannot be named. Processes
    closing their files (a share ending) are left out."""
    from ..base.proc import closing

    table = lock_table() if table is None else table
    lease_pids = takers(lease_dir, table)
    apart = {key: name for key, name in locked_files(share_dir, table).items()
             if any(pid not in lease_pids.get(name.rpartition(".")[0], ()) and not closing(pid)
                    for pid, _ex in table[key])}
    out: Dict[str, List[Optional[int]]] = {}
    for name, holding in sorted(_holdings(apart, table).items()):
        out.setdefault(name.rpartition(".")[0], []).extend(holding.pids)
    return out


def _holdings(files: Dict[Tuple[int, int], str], table: Table) -> Dict[str, Holding]:
    """name -> who holds each of FILES (locked in TABLE); see holdings."""
    found = fd_holders(files, {pid for key in files for pid, _ex in table[key]})
    takers = {key: [pid if pid in found.get(key, []) else None for pid, _ex in table[key]] for key in files}
    takers = heirs(takers)
    return {name: Holding(any(ex for _pid, ex in table[key]), takers[key]) for key, name in files.items()}


def heirs(takers: Dict[Tuple[int, int], List[Optional[int]]]) -> Dict[Tuple[int, int], List[Optional[int]]]:
    """TAKERS (file -> a pid per lock, None where the pid that took it no longer holds it)
    with each None replaced by a process that holds the lock through its own descriptor
    now, where one is found: the taker exited and its child (fork, daemon) holds the lease.

    Every process is searched, once for all files, and only when a taker is gone; a user
    can search only their own processes (root every one), so another user's heir, or a
    setuid program's, stays None.
    """
    wanted = [key for key, pids in takers.items() if None in pids]
    if not wanted:
        return takers
    found = fd_holders(wanted, every_pid())
    out = dict(takers)
    for key in wanted:
        others = [p for p in found.get(key, []) if p not in takers[key]]
        out[key] = [p if p is not None else (others.pop(0) if others else None) for p in takers[key]]
    return out


def holders(lease_dir: str) -> Dict[str, Optional[int]]:
    """uuid -> pid of a process holding each held lease (one of its sharers for a shared
    device); None where none can be named. See holdings."""
    return {name: holding.pid for name, holding in holdings(lease_dir).items()}
