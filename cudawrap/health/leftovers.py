"""Leftover processes: a process on a GPU that holds no lease there but was started by a
wrapped run of that GPU that has ended (a worker that outlived its parent and closed the
lease descriptor). The commonest cause of "CUDA out of memory" on a shared server.

Seen by root, once per monitor cycle: NVML lists the device's processes, the kernel's locks
say which of them hold its lease, and the environment a shim gave the run (inherited by
its children, surviving their execs) says which of the others came from a wrapped run of
that device. One whose ancestors include the current lessee is part of a running run; a
process with no such environment never held a lease there and stays "foreign", as before.
Either way it is a foreign process to the scheduler, so `foreign = "avoid"` (the default)
keeps new exclusive runs off its device while it lasts.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Leftover:
    pid: int
    uuid: str
    user: str
    program: str
    ended: Optional[float]  # when its run's lease ended, from the ledger (None: not recorded)
    ticks: int  # its start time in clock ticks: a reused pid is another process
    first_seen: float

    def describe(self) -> str:
        when = time.strftime("%H:%M", time.localtime(self.ended)) if self.ended else "?"
        return f"leftover: pid {self.pid} {self.user} (from {self.program}, ended {when})"

    def to_tuple(self) -> tuple:
        return (self.pid, self.uuid, self.user, self.program, self.ended, self.ticks, self.first_seen)


def _stat(pid: int) -> Optional[Tuple[int, int]]:
    """(parent pid, start ticks) of PID, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _descends_from(pid: int, ancestors: Set[int]) -> bool:
    seen = 0
    while pid > 1 and seen < 256:
        if pid in ancestors:
            return True
        st = _stat(pid)
        if st is None:
            return False
        pid, seen = st[0], seen + 1
    return False


def _ends(ledger_records: Iterable[Mapping[str, Any]]) -> Dict[Tuple[str, int, str], float]:
    """(device, uid, program) -> the latest end of such a lease in the ledger."""
    out: Dict[Tuple[str, int, str], float] = {}
    for r in ledger_records:
        if r.get("event") != "end" or not isinstance(r.get("end"), (int, float)):
            continue
        for uuid in r.get("devices") or ():
            key = (str(uuid), int(r.get("uid", -1)), str(r.get("program", "?")))
            out[key] = max(out.get(key, 0.0), float(r["end"]))
    return out


def find(layout: Any, inventory: Any, known: Mapping[int, Leftover], now: float) -> Dict[int, Leftover]:
    """Every leftover process on the devices of INVENTORY now (KNOWN: those of the last look,
    which keep their first sighting)."""
    from ..lease.holders import holdings
    from ..base.proc import real_uid
    from ..lease.lessees import foreign_pids
    from ..base.procinfo import wrapped_name
    from ..base.users import user_name

    held = holdings(str(layout.lease_dir))
    out: Dict[int, Leftover] = {}
    ends: Optional[Dict[Tuple[str, int, str], float]] = None
    for d in inventory.devices:
        if not d.pids:
            continue
        lessees = set(held[d.uuid].pids) if d.uuid in held else set()
        for pid in foreign_pids(str(layout.lease_dir), d.uuid, d.pids):
            program = wrapped_name(pid, [d.uuid])
            st = _stat(pid)
            if program is None or st is None or _descends_from(pid, lessees):
                continue  # never leased here (foreign), gone, or part of the run holding it now
            old = known.get(pid)
            if old is not None and old.ticks == st[1] and old.uuid == d.uuid:
                out[pid] = old
                continue
            uid = real_uid(pid)
            if ends is None:
                ends = _ends(_ledger(layout))
            ended = ends.get((d.uuid, uid if uid is not None else -1, program))
            out[pid] = Leftover(pid, d.uuid, user_name(uid) if uid is not None else "?", program, ended,
                                st[1], now)
    return out


def _ledger(layout: Any) -> Iterable[Mapping[str, Any]]:
    from ..ledger import files as ledgerfile

    problems: List[str] = []
    return list(ledgerfile.read(ledgerfile.rotated(ledgerfile.ledger_path(layout), 1), problems))


def end(leftover: Leftover) -> bool:
    """End LEFTOVER: in a run cgroup of the service's ([confine] runs), that whole cgroup
    (the run's other leftovers with it); else SIGTERM if it is still that very process (a
    pidfd, its start time checked)."""
    from ..confine.runkill import kill_run_of

    if kill_run_of(leftover.pid, leftover.ticks):
        return True
    try:
        fd = os.pidfd_open(leftover.pid)  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        return False
    try:
        st = _stat(leftover.pid)
        if st is None or st[1] != leftover.ticks:
            return False  # the pid was reused
        signal.pidfd_send_signal(fd, signal.SIGTERM)  # type: ignore[attr-defined]
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


class LeftoverWatch:
    """The monitor's part: find leftovers, say so once each, end them after the grace period
    where [health] leftover_action = "kill"."""

    def __init__(self, layout: Any, notes: Any = None) -> None:
        self.layout = layout
        self.notes = notes  # ledgerfile.Notes: each leftover seen and ended goes into the ledger
        self.known: Dict[int, Leftover] = {}

    def cycle(self, inventory: Any, action: str, grace_s: float, now: float) -> Dict[int, Leftover]:
        from ..base import audit

        found = find(self.layout, inventory, self.known, now)
        for pid, left in found.items():
            if pid not in self.known:
                audit.log("leftover", "warning", device=left.uuid, pid=pid, owner=left.user, program=left.program,
                          ended=left.ended or "?")
                log.warning("%s on %s", left.describe(), left.uuid)
                self._note("leftover", left, now)
            if action == "kill" and now - left.first_seen >= grace_s and end(left):
                audit.log("leftover-killed", "warning", device=left.uuid, pid=pid, owner=left.user,
                          program=left.program, grace_s=grace_s)
                self._note("leftover-killed", left, now, grace_s=grace_s)
        self.known = found
        return found

    def _note(self, event: str, left: Leftover, now: float, **facts: Any) -> None:
        from ..base.proc import real_uid

        if self.notes is not None:
            uid = real_uid(left.pid)
            self.notes.add(event, left.uuid, now, pid=left.pid, uid=uid if uid is not None else -1, user=left.user,
                           program=left.program, ended=left.ended, **facts)
