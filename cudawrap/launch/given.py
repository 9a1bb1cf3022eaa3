"""Devices a run is given rather than decides on: its wrapped parent's lease (inherited, and
narrowed by the child's CUDA_VISIBLE_DEVICES), and the service's grant asked the general way
(with the Slurm job's GPUs where the run is in one).

Apart from the rest of the launch because a launch without either (the monitor's, deciding for
itself) never needs it: the shim pays ~0.1 ms for each module it loads.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional

from ..lease.files import Lease
from .. import say
from . import Grant, whole_devices


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



def inherited_grant(lease_dir: str, marker: Optional[str], preset: Optional[str]) -> Optional[Grant]:
    """A child's grant within the lease its parent passed on (MARKER); None when there is
    none, or the child names devices outside it (leased anew, like any run's)."""
    if not marker:
        return None
    from ..lease.known import inherited_lease  # only a wrapped program's child has a marker: off a usual launch's path

    inherited = inherited_lease(lease_dir, marker)
    if inherited is None:
        return None
    if preset is not None and not preset.strip():
        return Grant(None, None)  # the caller asked for no device at all
    narrowed = narrow_inherited(inherited, preset)
    return Grant(narrowed, ",".join(narrowed.uuids)) if narrowed is not None else None



def from_service(root: str, prog: str, value: Dict[str, Any], environ: Any, count: int, job: Any = None,
                  must: bool = False, ticket: str = "") -> Optional[Grant]:
    """Devices (or shares) granted by `cudawrap serve` (README "The cudawrap service"); None
    when it does not answer, and the run decides for itself as without it. MUST: it cannot
    (the service is the install's arbiter): the service is tried again for connect_retry_s
    (a restart), then ServiceUnavailable."""
    from .. import client

    def on_wait(text: str) -> None:
        say(prog, text)

    fields = client.request_fields(value, environ, count)
    if ticket:
        fields["ticket"] = ticket
    if job is not None:
        devices = _job_devices(job)
        if devices is not None:
            fields["visible"] = devices
    if not must:
        granted = client.ask(root, fields, on_wait)
    else:
        granted = client.ask_retrying(root, fields, on_wait, float(value.get("connect_retry_s", 10.0)))
    if granted is None:
        return None
    # The service writes the grant's audit line (and its ledger record) itself.
    return whole_devices(root, granted.lease, environ, granted.extra, granted.defaults)


def _job_devices(job: Any) -> Optional[str]:
    """The UUIDs of a Slurm job's GPUs, as the service is asked to narrow to them; None
    where Slurm's variables do not say (CUDA_VISIBLE_DEVICES narrows, as for any run).
    Slurm numbers GPUs in NVML's (PCI) order: NVML is read to name them."""
    from ..devices import nvml
    from ..devices.slurm import uuids_of

    inventory = nvml.inventory()
    visible = job.visible({g.index for g in inventory.gpus})
    if visible is None:
        return None
    wanted: List[int] = []
    for token in visible.split(","):
        if not token.strip().isdigit():
            break  # outside the job: the list ends there, as CUDA ends it
        wanted.append(int(token))
    # A device of no GPU in the job matches nothing: the service then refuses, one line.
    return ",".join(uuids_of(inventory.devices, wanted)) or "-"
