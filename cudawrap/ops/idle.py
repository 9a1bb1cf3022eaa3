"""Idle leases: a held device showing 0 % utilisation and no change in used memory for
[health] idle_after_min is marked IDLE (status, `cudawrap health`, the metric
cudawrap_lease_idle_seconds); idle_action = "notify" adds an audit line naming its holder.
Nothing here ends a run.

On a MIG instance NVML gives no utilisation: unchanged memory alone is the sign, and the
basis says so. `step()` is pure: the last state and this cycle's samples in, the new state out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

UTILISATION = "0 % utilisation and unchanged memory"
MEMORY_ONLY = "unchanged memory (no utilisation reported: MIG)"


@dataclass(frozen=True)
class Lease:
    """One held device as the sampler saw it last: whose, since when quiet, on what basis."""

    pid: int
    user: str
    quiet_since: float
    memory_mib: Optional[int]
    basis: str
    told: bool = False  # the holder was notified of this idle spell

    def idle_s(self, now: float) -> float:
        return max(0.0, now - self.quiet_since)

    def to_tuple(self) -> tuple:
        return (self.pid, self.user, self.quiet_since, self.memory_mib, self.basis, self.told)


# uuid -> (holder pid, holder's user, utilisation % or None, used memory MiB or None)
Sample = Tuple[int, str, Optional[int], Optional[int]]


def step(last: Mapping[str, Lease], samples: Mapping[str, Sample], now: float) -> Dict[str, Lease]:
    """Each held device's quiet spell: kept while the same holder shows no utilisation and
    the same memory, started again by any activity or a new holder."""
    out: Dict[str, Lease] = {}
    for uuid, (pid, user, util, memory) in samples.items():
        old = last.get(uuid)
        basis = UTILISATION if util is not None else MEMORY_ONLY
        quiet = (util is None or util == 0) and memory is not None
        if old is not None and old.pid == pid and quiet and old.memory_mib == memory:
            out[uuid] = Lease(pid, user, old.quiet_since, memory, basis, old.told)
        else:
            out[uuid] = Lease(pid, user, now, memory, basis)
    return out


class IdleWatch:
    """The monitor's part: sample the held devices, flag and (if asked) tell about idle ones."""

    def __init__(self) -> None:
        self.leases: Dict[str, Lease] = {}

    def cycle(self, layout: object, inventory: object, utilization, after_s: float,  # type: ignore[no-untyped-def]
              action: str, now: float) -> Dict[str, Lease]:
        from ..base import audit
        from ..lease.holders import holdings
        from ..proc import real_uid
        from ..users import user_name

        held = holdings(str(layout.lease_dir))  # type: ignore[attr-defined]
        samples: Dict[str, Sample] = {}
        for d in inventory.devices:  # type: ignore[attr-defined]
            holding = held.get(d.uuid)
            if holding is None or not holding.exclusive or holding.pid is None:
                continue  # free, shared (a share's idleness is not the device's) or unnamed
            uid = real_uid(holding.pid)
            util = utilization(d.uuid) if d.mig_slot is None else None
            samples[d.uuid] = (holding.pid, user_name(uid) if uid is not None else "?", util, d.memory_used_mib)
        self.leases = step(self.leases, samples, now)
        for uuid, lease in list(self.leases.items()):
            if action == "notify" and lease.idle_s(now) >= after_s and not lease.told:
                audit.log("idle-lease", device=uuid, pid=lease.pid, owner=lease.user,
                          idle_s=round(lease.idle_s(now)), basis=lease.basis)
                self.leases[uuid] = Lease(lease.pid, lease.user, lease.quiet_since, lease.memory_mib,
                                          lease.basis, True)
        return self.leases


def describe(lease: Lease, now: float) -> str:
    minutes = lease.idle_s(now) / 60
    return f"IDLE for {minutes:.0f} min: pid {lease.pid} {lease.user} ({lease.basis})"
