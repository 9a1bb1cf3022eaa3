"""Drained devices: no new lease is granted on them; their current holders finish undisturbed.

Root keeps the drains in ``var/lib/cudawrap/drains`` (so they survive a reboot), a
``marshal`` file replaced atomically (rootfile), which the shim reads at no import cost.
A file not written by the install's owner, or writable by others, is ignored.

Two kinds of drain live there apart: an admin's (`cudawrap drain`, lifted only by
`cudawrap resume`) and a health drain (made and lifted by the monitor, cudawrap/health.py).
Where both cover a device the admin's is the one shown and kept: a health drain never
replaces it, and lifting a health drain never lifts it.

A drained GPU UUID covers the GPU's MIG instances, those that exist now and those created
later (a drain for MIG reconfiguration must hold across it).
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Iterable, List, Optional, Sequence

from .. import locations as loc
from ..base import rootfile

DRAINS = loc.DRAINS
DRAINS_LOCK = loc.STATE_DIR + "/drains.lock"
VERSION = 1


class Drain:
    """Why a device is drained, by whom (a user name) and when (seconds since the epoch);
    KIND is ADMIN or HEALTH."""

    __slots__ = ("reason", "by", "at", "kind")

    def __init__(self, reason: str, by: str, at: float, kind: str = "admin") -> None:
        self.reason = reason
        self.by = by
        self.at = at
        self.kind = kind

    def to_tuple(self) -> tuple:
        return (self.reason, self.by, self.at)

    def __repr__(self) -> str:
        return f"Drain({self.reason!r}, by={self.by!r}, at={self.at})"


ADMIN = "admin"
HEALTH = "health"
HEALTH_BY = "cudawrap health"  # who a health drain is by, as status shows it


def _table(data: object, key: str, kind: str) -> Dict[str, Drain]:
    out: Dict[str, Drain] = {}
    try:
        for uuid, (reason, by, at) in data.get(key, {}).items():  # type: ignore[attr-defined]
            out[str(uuid)] = Drain(str(reason), str(by), float(at), kind)
    except (TypeError, ValueError, AttributeError):
        return {}
    return out


def _read(root: str) -> Dict[str, Dict[str, Drain]]:
    data = rootfile.read(root, loc.under(root, DRAINS), VERSION)
    if data is None:
        return {ADMIN: {}, HEALTH: {}}
    return {ADMIN: _table(data, "drains", ADMIN), HEALTH: _table(data, HEALTH, HEALTH)}


def drained(root: str) -> Dict[str, Drain]:
    """UUID -> Drain for every drained device (GPU or MIG UUID, as the admin named it);
    a device an admin drained shows the admin's drain, whatever its health."""
    tables = _read(root)
    out = dict(tables[HEALTH])
    out.update(tables[ADMIN])
    return out


def health_drained(root: str) -> Dict[str, Drain]:
    """UUID -> Drain for the health drains alone (an admin's drain of the same GPU aside)."""
    return _read(root)[HEALTH]


def covering(drains: Dict[str, Drain], uuid: str, parent_uuid: str = "") -> Optional[str]:
    """The drained UUID that covers a device (itself, or its GPU), or None."""
    if uuid in drains:
        return uuid
    if parent_uuid and parent_uuid in drains:
        return parent_uuid
    return None


def undrained(devices: Iterable, drains: Dict[str, Drain]) -> List:
    """DEVICES (devices.Device) that no drain covers."""
    return [d for d in devices if covering(drains, d.uuid, d.parent_uuid) is None]


def is_drained(root: str, device: object) -> bool:
    """Whether DEVICE is drained now (re-reads the file: for a waiter's fresh look)."""
    return covering(drained(root), device.uuid, device.parent_uuid) is not None  # type: ignore[attr-defined]


def _store(root: str, tables: Dict[str, Dict[str, Drain]]) -> None:
    path = loc.under(root, DRAINS)
    rootfile.write(path, {"version": VERSION,
                          "drains": {u: d.to_tuple() for u, d in tables[ADMIN].items()},
                          HEALTH: {u: d.to_tuple() for u, d in tables[HEALTH].items()}})
    # A drain must survive a crash or power cut as well as a reboot: flush file and directory.
    for target, flags in ((path, os.O_RDONLY), (os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)):
        fd = os.open(target, flags | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _update(root: str, change, kind: str = ADMIN) -> Dict[str, Drain]:  # type: ignore[no-untyped-def]
    """Apply CHANGE to the drains of KIND under their lock, so two admins (or an admin and
    the monitor) never lose each other's; returns that kind's drains now."""
    import fcntl

    fd = os.open(loc.under(root, DRAINS_LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        tables = _read(root)
        change(tables[kind])
        _store(root, tables)
        return tables[kind]
    finally:
        os.close(fd)


def drain(root: str, uuids: Sequence[str], reason: str, by: str) -> Dict[str, Drain]:
    """Drain UUIDS (draining one again replaces its reason); returns all drains now."""
    import time

    now = time.time()

    def change(drains: Dict[str, Drain]) -> None:
        for uuid in uuids:
            drains[uuid] = Drain(reason, by, now)

    return _update(root, change)


def resume(root: str, uuids: Sequence[str]) -> Dict[str, Drain]:
    """Undo the drains of UUIDS (those not drained are left as they are); returns all drains now."""

    def change(drains: Dict[str, Drain]) -> None:
        for uuid in uuids:
            drains.pop(uuid, None)

    return _update(root, change)


def health_drain(root: str, uuid: str, reason: str, at: float) -> None:
    """Drain the GPU UUID for its health (its MIG instances with it); an admin's drain stays."""

    def change(drains: Dict[str, Drain]) -> None:
        drains[uuid] = Drain(reason, HEALTH_BY, at, HEALTH)

    _update(root, change, HEALTH)


def health_resume(root: str, uuid: str) -> None:
    """Lift the health drain of UUID (never an admin's)."""
    _update(root, lambda drains: drains.pop(uuid, None), HEALTH)


# --- naming devices on the command line (admin commands only, not the shim) -----------------


def resolve(args: Sequence[str], inventory, known: Iterable[str] = ()) -> List[str]:  # type: ignore[no-untyped-def]
    """The UUIDs that DEVICE arguments name, in order, each once.

    An argument is a GPU index (NVML order, as `nvidia-smi` shows), a GPU or MIG UUID, or a
    prefix matching exactly one of them, as CUDA_VISIBLE_DEVICES accepts GPU UUIDs.
    INVENTORY may be None (no NVML): then only UUIDs in KNOWN (lease files, drains) match.
    """
    from ..errors import UsageError
    from .selection import by_prefix

    gpus = list(inventory.gpus) if inventory is not None else []
    pool = sorted({g.uuid for g in gpus} | {d.uuid for d in (inventory.devices if inventory else ())}
                  | set(known))
    hint = "`cudawrap status` lists the devices; name them by index, UUID or a unique UUID prefix"
    out: List[str] = []
    for arg in args:
        token = arg.strip()
        shown = "".join(c if c.isprintable() else "?" for c in token[:60]) or "''"
        if token.isascii() and token.isdigit():
            if inventory is None:
                raise UsageError(f"device {shown}: an index needs NVML, which is unavailable here",
                                 hint="name the device by its UUID (the names in the lease directory)")
            index = int(token) if len(token) <= 9 else -1
            found = [g.uuid for g in gpus if g.index == index]
            if not found:
                have = f"GPUs 0 to {len(gpus) - 1}" if gpus else "no GPU"
                raise UsageError(f"device {shown}: no GPU with that index (this machine has {have})", hint=hint)
            uuid = found[0]
        elif token.startswith(("GPU-", "MIG-")) and len(token) > 4:
            match = by_prefix(token, pool)
            if match is None:
                n = sum(u.startswith(token) for u in pool)
                raise UsageError(f"device {shown}: " + (f"matches {n} devices; give more of the UUID" if n
                                                        else "no such device on this machine"), hint=hint)
            uuid = match
        else:
            raise UsageError(f"device {shown}: not a GPU index or a GPU-…/MIG-… UUID", hint=hint)
        if uuid not in out:
            out.append(uuid)
    return out


def leases_covered(named: Iterable[str], inventory, lease_names: Iterable[str]) -> List[str]:  # type: ignore[no-untyped-def]
    """The lease files (device UUIDs) that drains of NAMED cover: the devices themselves and,
    for a GPU, its MIG instances (known from INVENTORY; without it, exact names only)."""
    named = set(named)
    parents = {d.uuid: d.parent_uuid for d in inventory.devices} if inventory is not None else {}
    return sorted(u for u in lease_names if u in named or parents.get(u) in named)
