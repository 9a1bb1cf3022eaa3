"""Inside a Slurm job: which GPUs Slurm gave it, and when cudawrap should step aside.

Slurm sets ``CUDA_VISIBLE_DEVICES`` to indices of the GPUs it allocated, and the same
indices in ``GPU_DEVICE_ORDINAL``; ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS`` hold Slurm's
own (node-wide) indices of those GPUs. Slurm numbers a node's GPUs in gres.conf order,
which is NVML's order with ``AutoDetect=nvml`` or a gres.conf listing ``/dev/nvidiaN`` in
``nvidia-smi`` order: cudawrap reads Slurm's indices in that order (``PCI_BUS_ID``), not in
CUDA's default FASTEST_FIRST order, because they are Slurm's numbering, not CUDA's, and
it hands the program UUIDs, which mean the same GPU to everyone.

With device cgroups (``ConstrainDevices=yes``) Slurm renumbers: ``CUDA_VISIBLE_DEVICES``
counts from 0 within the job while ``SLURM_*_GPUS`` keep the node-wide indices. Where NVML
still lists the node-wide indices, cudawrap translates the job's indices through
``SLURM_STEP_GPUS`` (or ``SLURM_JOB_GPUS``); where NVML, like CUDA, lists only the job's
GPUs numbered from 0, the indices are used as they are.

A user can set these variables by hand; that gives nothing a ``CUDA_VISIBLE_DEVICES`` of
their choosing would not, and touches no one else's leases. The service does not believe
them: it reads the job from the client's cgroup and its GPUs from Slurm (service/slurmjob.py),
and what the client says only narrows those.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Collection, Iterable, List, Mapping, Optional

CVD = "CUDA_VISIBLE_DEVICES"


def _index(token: str) -> Optional[str]:
    """"03" -> "3", as CUDA reads an index; None for anything that is not one."""
    token = token.strip()
    return str(int(token)) if token.isascii() and token.isdigit() and len(token) < 10 else None


def _indices(value: Optional[str]) -> Optional[List[str]]:
    """"0,2,3" -> ["0", "2", "3"]; None unless every entry is an index."""
    items = [_index(t) for t in value.split(",")] if value else [None]
    return None if None in items else items  # type: ignore[return-value]


class SlurmJob:
    """What Slurm's variables say about the devices of the job (step) we run in."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.job_id = environ.get("SLURM_JOB_ID", "")
        self.cvd = environ.get(CVD)
        self.shards = int(_index(environ.get("SLURM_SHARDS_ON_NODE", "")) or 0)
        self.ordinals = _indices(environ.get("GPU_DEVICE_ORDINAL"))  # what Slurm set CVD to
        self.gpus = _indices(environ.get("SLURM_STEP_GPUS")) or _indices(environ.get("SLURM_JOB_GPUS"))

    @property
    def shares(self) -> bool:
        """A --gres=shard job: Slurm lets several jobs share this GPU, so a lease must not serialise them."""
        return self.shards > 0 and bool(self.cvd and self.cvd.strip())

    @property
    def has_no_gpu(self) -> bool:
        """Slurm gave this job no GPU: it set neither CUDA_VISIBLE_DEVICES nor SLURM_*_GPUS."""
        return self.cvd is None and not self.gpus

    def visible(self, nvml_indices: Collection[int]) -> Optional[str]:
        """CUDA_VISIBLE_DEVICES in NVML's numbering (read it as PCI_BUS_ID), or None when
        Slurm's variables do not say how (the caller's CUDA rules apply then).

        NVML_INDICES are the GPU indices NVML lists here. Where Slurm renumbered (a device
        cgroup), they tell whether NVML sees the whole node (translate to node-wide indices)
        or, like CUDA, only the job's GPUs numbered from 0.
        """
        if not self.gpus:
            return None
        local = self.ordinals if self.ordinals and len(self.ordinals) == len(self.gpus) else None
        if local is None:
            return ",".join(self.gpus) if self.cvd is None else None
        node_wide = local == self.gpus or all(int(g) in nvml_indices for g in self.gpus)
        to_nvml = dict(zip(local, self.gpus if node_wide else local))
        tokens = (",".join(local) if self.cvd is None else self.cvd).split(",")
        # An index outside the job becomes "-", which ends the list as CUDA ends it at an invalid entry.
        return ",".join(t if _index(t) is None else to_nvml.get(_index(t), "-") for t in tokens)


def uuids_of(devices: Iterable[Any], indices: Collection[int]) -> List[str]:
    """The UUIDs of DEVICES (an inventory's, MIG instances included) on the GPUs of Slurm's
    node-wide INDICES, which are NVML's (gres.conf order, above)."""
    return [d.uuid for d in devices if d.gpu_index in indices]


def within_job(environ: Mapping[str, str]) -> Optional[SlurmJob]:
    """The Slurm job this process runs in, or None outside Slurm."""
    return SlurmJob(environ) if environ.get("SLURM_JOB_ID") else None
