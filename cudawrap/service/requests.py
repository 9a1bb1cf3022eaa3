"""A client's request, read under the policy as the service reads it (never the client's).

The program comes from peer.program (the kernel's word), its settings from the config the
service reads; what the client says (its count, wait, share, CUDA_VISIBLE_DEVICES, filter asks)
only narrows them, through the same rules the daemonless launch applies to the
environment (policy.narrow, sched.candidates.usable).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional

from .. import locations as loc
from .. import wire
from ..devices.model import Inventory
from ..errors import NoDeviceError, SetupError, UsageError
from ..lease.sharing import Sharing, of_run
from ..sched.request import Request
from ..sched.schedule import Waiter
from .slurmjob import JobGpus

MAX_COUNT = 999  # as the queue's names allow


@dataclass
class Ask:
    """One client's request, checked: what its waiter asks (REQUEST), how long it may wait."""

    request: Request
    wait: float
    program: str  # the link of a wrapped program, "" for the API and `cudawrap run`
    sharing: Sharing = field(default_factory=Sharing)  # the policy's [sharing]
    memory_limit_mib: Optional[int] = None  # the program's, for its shares
    limited: bool = False  # the policy's [limits] apply (read_kept)

    @property
    def share(self) -> bool:
        return self.request.share  # a share of each device that has slots (docs/admin/sharing.md)

    def waiter(self, key: str, uid: int, pid: int, arrival: float) -> Waiter:
        name = self.program.rsplit("/", 1)[-1] if self.program else "(not a wrapped program)"
        return Waiter(key, uid, pid, self.request, arrival, name)

    def variables(self, root: str, shared: List[str], current: Dict[str, Any], slots: Dict[str, int]
                  ) -> Dict[str, str]:
        """The GRANT fields that give a run sharing SHARED what a run deciding for itself
        sets (sharing.run_env: MPS's variables, the memory limit, the frameworks' defaults)."""
        extra, defaults = self.sharing.run_env(root, shared, current, slots, self.memory_limit_mib)
        fields = {"env": wire.pairs(extra)} if extra else {}
        if defaults is not None:
            fields["defaults"] = wire.pairs(defaults)
        return fields


def _number(fields: Dict[str, str], key: str, default: str) -> float:
    raw = fields.get(key, default)
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"{key}={raw[:40]!r}: not a number") from None
    if value != value or value < 0:
        raise UsageError(f"{key}={raw[:40]!r}: not a number of 0 or more")
    return value


def _variables(text: str) -> Dict[str, str]:
    """The CUDAWRAP_* variables of an ``asks`` field (wire.pairs): the only ones policy.effective reads."""
    out: Dict[str, str] = {}
    for line in text.split("\n"):
        name, sep, value = line.partition("=")
        if sep and name.startswith("CUDAWRAP_") and name not in out:
            out[name] = value
    return out


def read(root: str, inventory: Inventory, fields: Dict[str, str], link: Optional[str], uid: int,
         present: FrozenSet[str], job: Optional[JobGpus] = None) -> Ask:
    """The Ask of FIELDS from UID running LINK (None: not a wrapped program); CudawrapError
    (with the exit status the client passes on) when it can never be met or is malformed.
    PRESENT: the devices that have lease files. JOB: the GPUs of the Slurm job the client
    runs in, as Slurm says (None outside one)."""
    from ..sched import candidates as narrow
    from ..policy import effective as policy

    if "asks" in fields:  # a shim's run (wire.RUN): its variables, read as the launch reads its own
        settings = policy.effective(root, link, _variables(fields["asks"]))
        count = settings.values()["gpus"]
    else:
        settings = policy.effective(root, link, {})
        if "share" in fields:  # a share takes less than the device: anyone may ask (ask_share)
            policy.ask_share(settings, fields["share"], "the run's environment", f"share={fields['share'][:40]!r}")
        for key in ("model", "min_memory_mib", "min_free_memory_mib", "max_utilization"):
            if key in fields:
                policy.ask(settings, key, fields[key], "the run's environment", f"{key}={fields[key][:40]!r}")
        count = _number(fields, "count", "1")
        if count != int(count) or not 1 <= count <= MAX_COUNT:
            raise UsageError(f"count={fields.get('count', '')[:40]!r}: not a number of devices")
        count = int(count)
    policy.check_count(settings, count)
    value = settings.values()
    sharing, share = of_run(value, count)
    wait = min(float(value["wait"]), _number(fields, "wait", "inf"))
    allow = narrow.allow_list(value)
    preset = fields.get("visible")
    if preset is not None and not preset.strip():
        raise UsageError("CUDA_VISIBLE_DEVICES is empty: this run asks for no device")
    candidates = narrow.usable(inventory, value, allow, preset, count, fields.get("order"))
    if job is not None:
        candidates = _in_job(inventory, candidates, job, count, preset is not None)
    narrow.check_drained(root, candidates, count)  # refused at once, as the launch refuses it
    limited = bool(narrow.limits_of(value, count, uid))
    usable = frozenset(d.uuid for d in candidates if d.uuid in present)
    if len(usable) < count:
        from ..lease.files import SYNC_HINT

        raise SetupError(f"{len(candidates) - len(usable)} of the usable devices have no lease file", hint=SYNC_HINT)
    everything = frozenset(d.uuid for d in inventory.devices)
    request = Request.of(value, count, share).replace(candidates=None if usable >= everything else usable)
    return Ask(request, wait, link or "", sharing, value.get("memory_limit_mib"), limited)


# (link, uid, job, the request's fields) -> (the policy's files, the inventory, the devices with
# lease files, the Ask read from them): a program's runs ask the same again and again.
_kept: Dict[tuple, tuple] = {}
_KEPT_MAX = 1024


def read_kept(root: str, inventory: Inventory, fields: Dict[str, str], link: Optional[str], uid: int,
              present: FrozenSet[str], job: Optional[JobGpus] = None) -> Ask:
    """read(), remembered while what it reads is the same: the policy's files and the drains
    (their identities), the machine, the request. Reading it costs a launch through the service
    ~0.15 ms (more on a cold cache); checking the files' identities, four stat calls. A request
    the policy's [limits] apply to is read every time (its user's groups may change)."""
    from ..policy.effective import file_signature, files_signature

    key = (link, uid, job, tuple(sorted((k, v) for k, v in fields.items() if k != "ticket")))
    files = files_signature(root) + (file_signature(loc.under(root, loc.DRAINS)),)  # a drain refuses at once
    kept = _kept.get(key)
    if kept is not None and kept[0] == files and kept[1] is inventory and kept[2] == present:
        return kept[3]
    ask = read(root, inventory, fields, link, uid, present, job)
    if not ask.limited:
        if len(_kept) >= _KEPT_MAX:
            _kept.clear()
        _kept[key] = (files, inventory, present, ask)
    return ask


def _in_job(inventory: Inventory, candidates: List[Any], job: JobGpus, count: int, narrowed: bool) -> List[Any]:
    """CANDIDATES on JOB's GPUs: what the client says (CUDA_VISIBLE_DEVICES, Slurm's variables
    as it read them) narrows Slurm's word, never widens it."""
    from ..devices.slurm import uuids_of

    mine = set(uuids_of(inventory.devices, job.indices))
    kept = [d for d in candidates if d.uuid in mine]
    if len(kept) >= count:
        return kept
    hint = f"a run in a Slurm job gets only its job's GPUs (`scontrol show job -d {job.job_id}` lists them)"
    if not mine:
        raise NoDeviceError(f"Slurm job {job.job_id} has no GPU on this machine",
                            hint="submit with --gres=gpu:N")
    why = ", narrowed by CUDA_VISIBLE_DEVICES" if narrowed else ""
    raise NoDeviceError(f"{count} device{'s' if count > 1 else ''} asked for, but only {len(kept)} can be used "
                        f"here (Slurm job {job.job_id} has {len(mine)} device{'s' if len(mine) > 1 else ''} on "
                        f"this machine{why})", hint=hint)


def arrival_key(pid: int, now_ns: Optional[int] = None) -> "tuple[str, float]":
    """A waiter's key (sorts by arrival, unique) and its arrival, from the service's clock
    (NOW_NS: the arrival a reconnect ticket restored)."""
    if now_ns is None:
        now_ns = time.time_ns()
    return f"{now_ns:020d}.{pid}.service", now_ns / 1e9
