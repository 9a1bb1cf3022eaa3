"""Idle leases: a held device showing 0 % utilisation and no change in used memory for
[health] idle_after_min is marked IDLE (status, `cudawrap health`, the metric
cudawrap_lease_idle_seconds); idle_action = "notify" adds an audit line naming its holder
and writes the holder a line on the run's terminal (its stderr, where that is a tty the
run's user owns). Nothing here ends a run.

When an idle spell that reached idle_after_min ends (activity, a new holder, the lease
ended), the ledger gets an ``idle`` note: device, holder, from (the last change seen) to
(the last quiet sample); `cudawrap usage` sums these as idle device-hours. A spell is
counted whole once it was long enough to be flagged; a shorter quiet spell counts nothing.

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


def ended(last: Mapping[str, Lease], now_leases: Mapping[str, Lease], after_s: float,
          seen: float) -> Dict[str, Lease]:
    """The spells of LAST, flagged idle (AFTER_S long by SEEN, their last quiet sample), that
    NOW_LEASES no longer continues."""
    return {u: old for u, old in last.items()
            if old.idle_s(seen) >= after_s
            and (u not in now_leases or now_leases[u].quiet_since != old.quiet_since or now_leases[u].pid != old.pid)}


class IdleWatch:
    """The monitor's part: sample the held devices, flag and (if asked) tell about idle ones,
    note each flagged spell in the ledger when it ends."""

    def __init__(self, notes: object = None, leases: Optional[Mapping[str, Lease]] = None,
                 sampled: float = 0.0) -> None:
        self.notes = notes  # ledgerfile.Notes
        self.leases: Dict[str, Lease] = dict(leases or {})  # the monitor's last, across a restart
        self.sampled = sampled  # when the leases were last sampled
        self.who: Dict[int, Tuple[int, str]] = {}  # holder pid -> (uid, program), for the notes

    def cycle(self, layout: object, inventory: object, utilization, after_s: float,  # type: ignore[no-untyped-def]
              action: str, now: float) -> Dict[str, Lease]:
        from ..base import audit
        from ..lease.holders import holdings
        from ..base.proc import real_uid
        from ..base.users import user_name

        held = holdings(str(layout.lease_dir))  # type: ignore[attr-defined]
        samples: Dict[str, Sample] = {}
        for d in inventory.devices:  # type: ignore[attr-defined]
            holding = held.get(d.uuid)
            if holding is None or not holding.exclusive or holding.pid is None:
                continue  # free, shared (a share's idleness is not the device's) or unnamed
            uid = real_uid(holding.pid)
            util = utilization(d.uuid) if d.mig_slot is None else None
            samples[d.uuid] = (holding.pid, user_name(uid) if uid is not None else "?", util, d.memory_used_mib)
            if holding.pid not in self.who and uid is not None:
                self.who[holding.pid] = (uid, _program(holding.pid, d.uuid))
        leases = step(self.leases, samples, now)
        for uuid, spell in ended(self.leases, leases, after_s, self.sampled).items():
            self._note(uuid, spell, self.sampled)
        self.leases, self.sampled = leases, now
        self.who = {pid: w for pid, w in self.who.items() if any(x.pid == pid for x in leases.values())}
        for uuid, lease in list(self.leases.items()):
            if action == "notify" and lease.idle_s(now) >= after_s and not lease.told:
                audit.log("idle-lease", device=uuid, pid=lease.pid, owner=lease.user,
                          idle_s=round(lease.idle_s(now)), basis=lease.basis)
                self._tell(uuid, lease, now)
                self.leases[uuid] = Lease(lease.pid, lease.user, lease.quiet_since, lease.memory_mib,
                                          lease.basis, True)
        return self.leases

    def _tell(self, uuid: str, lease: Lease, now: float) -> None:
        from ..base.terminal import tell

        uid = self.who.get(lease.pid, (None, ""))[0]
        if uid is not None:
            tell(lease.pid, uid, f"cudawrap: your run (pid {lease.pid}) has held {uuid} idle for "
                                 f"{lease.idle_s(now) / 60:.0f} min ({lease.basis}); end it if it is done, "
                                 "so others can use the device")

    def _note(self, uuid: str, spell: Lease, seen: float) -> None:
        if self.notes is None:
            return
        uid, program = self.who.get(spell.pid, (-1, "?"))
        self.notes.add("idle", uuid, seen, pid=spell.pid, uid=uid, user=spell.user,  # type: ignore[attr-defined]
                       program=program, start=round(spell.quiet_since, 3), end=round(seen, 3), basis=spell.basis)


def _program(pid: int, uuid: str) -> str:
    from ..base.procinfo import wrapped_name

    return wrapped_name(pid, [uuid]) or "?"


def describe(lease: Lease, now: float) -> str:
    minutes = lease.idle_s(now) / 60
    return f"IDLE for {minutes:.0f} min: pid {lease.pid} {lease.user} ({lease.basis})"
