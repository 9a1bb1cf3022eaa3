"""Devices a run is given by its wrapped parent: the parent's lease (inherited), narrowed by
the child's CUDA_VISIBLE_DEVICES.

Apart from the rest of the launch because a launch without one (the monitor's, deciding for
itself) never needs it: the shim pays ~0.1 ms for each module it loads.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import List, Optional, Tuple

from ..lease.files import Lease


def narrow_inherited(lease: Lease, preset: Optional[str]) -> Optional[Lease]:
    """The part of an inherited LEASE that the caller's CUDA_VISIBLE_DEVICES names.

    The child lives in its parent's devices: an index counts in the parent's list (the
    order the parent was given them), a UUID (or a unique GPU- prefix) must be one of them,
    and, as in CUDA, the first entry that is neither, or repeats one, ends the list. Unset
    keeps the whole lease; None when nothing of the lease is named (set but empty: no device).
    """
    if preset is None:
        return lease
    from ..sched.selection import by_prefix

    uuids = lease.uuids
    kept: List[str] = []
    for token in preset.split(","):
        token = token.strip()
        if token.isascii() and token.isdigit():
            uuid = uuids[int(token)] if len(token) <= 9 and int(token) < len(uuids) else None
        elif token.startswith("GPU-") and len(token) > len("GPU-"):
            uuid = by_prefix(token, uuids)
        else:
            uuid = token if token in lease.fds else None
        if uuid is None or uuid in kept:
            break
        kept.append(uuid)
    return lease.part(kept) if kept else None



def inherited_devices(lease_dir: str, marker: Optional[str],
                      preset: Optional[str]) -> Optional[Tuple[Optional[Lease], Optional[str]]]:
    """A child's grant within the lease its parent passed on (MARKER): its lease and its
    CUDA_VISIBLE_DEVICES (the launch's Grant of them); None when there is none, or the child
    names devices outside it (leased anew, like any run's)."""
    if not marker:
        return None
    from ..lease.known import inherited_lease  # only a wrapped program's child has a marker: off a usual launch's path

    inherited = inherited_lease(lease_dir, marker)
    if inherited is None:
        return None
    if preset is not None and not preset.strip():
        return None, None  # the caller asked for no device at all
    narrowed = narrow_inherited(inherited, preset)
    return (narrowed, ",".join(narrowed.uuids)) if narrowed is not None else None
