"""What one memory cycle sees: every lease and share held now (a run), from the kernel's lock
table, the processes that belong to each run, and what NVML says each uses on each device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

from ..paths import Layout
from .rule import owner

MIB = 1 << 20


@dataclass(frozen=True)
class Run:
    """One lease or share: its holder and the lock files that make it one."""

    pid: int
    uid: int
    program: str
    devices: Tuple[str, ...]
    shared: Tuple[str, ...]  # those of DEVICES it holds a share of (the others whole)
    files: Tuple[Tuple[int, int], ...]  # (st_dev, st_ino) of its lease or slot files


class _Parents(Mapping[int, int]):
    """pid -> ppid, read from /proc when asked and kept for the cycle. A walk up from each of
    NVML's processes reads a few; reading every process's parent each cycle cost the monitor
    ~1100 reads every half second with 1000 runs waiting (~4 % of a core). Iterating gives
    those read so far."""

    def __init__(self) -> None:
        self._read: Dict[int, Optional[int]] = {}

    def __getitem__(self, pid: int) -> int:
        from ..base.proc import parent

        if pid not in self._read:
            self._read[pid] = parent(pid)
        ppid = self._read[pid]
        if ppid is None:
            raise KeyError(pid)
        return ppid

    def __iter__(self) -> Iterator[int]:
        return iter([pid for pid, ppid in self._read.items() if ppid is not None])

    def __len__(self) -> int:
        return sum(1 for ppid in self._read.values() if ppid is not None)


def runs(layout: Layout) -> List[Run]:
    """Every lease and share held now, from the kernel's lock table."""
    from ..lease.holders import holdings, locked_files
    from ..lease.files import lock_table
    from ..ledger.processes import proc

    table = lock_table()
    found: Dict[int, Dict[str, Any]] = {}

    def add(pid: Optional[int], uuid: str, shared: bool, key: Tuple[int, int]) -> None:
        if pid is not None:
            entry = found.setdefault(pid, {"devices": set(), "shared": set(), "files": set()})
            entry["devices"].add(uuid)
            entry["files"].add(key)
            if shared:
                entry["shared"].add(uuid)

    leases = {name: key for key, name in locked_files(str(layout.lease_dir), table).items()}
    for uuid, holding in holdings(str(layout.lease_dir), table).items():
        if holding.exclusive:
            add(holding.pid, uuid, False, leases[uuid])
    slots = {name: key for key, name in locked_files(str(layout.share_dir), table).items()}
    for name, holding in holdings(str(layout.share_dir), table).items():
        add(holding.pid, name.rpartition(".")[0], True, slots[name])
    out = []
    for pid, entry in sorted(found.items()):
        devices = tuple(sorted(entry["devices"]))
        p = proc(pid, devices)
        if p is not None:
            out.append(Run(pid, p.uid, p.program, devices, tuple(sorted(entry["shared"])),
                           tuple(sorted(entry["files"]))))
    return out


def members(gpu_pids: Iterable[int], held: Sequence[Run]) -> Dict[int, int]:
    """pid -> holder pid for each of GPU_PIDS (NVML's processes) that belongs to a run: a
    descendant of its holder, or a process holding one of its lock files."""
    from ..lease.holders import fd_holders

    holders = {r.pid: r.pid for r in held}
    parents = _Parents()
    out: Dict[int, int] = {}
    strays = []
    for pid in gpu_pids:
        found = owner(pid, parents, holders)
        if found is not None:
            out[pid] = found
        else:
            strays.append(pid)
    if strays:
        by_file = {key: r.pid for r in held for key in r.files}
        for key, pids in fd_holders(by_file, strays).items():
            for pid in pids:
                out.setdefault(pid, by_file[key])
    return out


def process_memory(uuids: Iterable[str]) -> Dict[str, Dict[int, Optional[int]]]:
    """device -> pid -> MiB NVML says each compute process uses (None where it hides it)."""
    from ..devices import nvml

    out: Dict[str, Dict[int, Optional[int]]] = {}
    uuids = list(uuids)
    if not uuids:
        return out
    nv = nvml.init()
    for uuid in uuids:
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(nv.nvmlDeviceGetHandleByUUID(uuid))
        except nv.NVMLError:
            continue
        out[uuid] = {}
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            out[uuid][int(p.pid)] = None if used is None else int(used) // MIB
    return out
