"""A restarted service follows again the grants its predecessor made, a part of Grants.

Each grant the ledger's state names open is followed again (its client's pidfd, its shares'
slots as the lock table says): its end is recorded when it happens, not at some later look.
Then [confine]'s run cgroups and leased device nodes are made to match who holds what now.

Apart from grants.py because it runs once, at the start, from the ledger and the lock
table; what it adopts is the Grants' to follow from then on, of which this is a part.
"""
from __future__ import annotations

import os
from typing import Dict, List

from ..base.proc import real_uid
from ..lease.files import lock_table
from . import bookkeeping
from .granted import Held


class Adoption:
    """The grants of a service before this one, followed again (a part of grants.Grants)."""

    def slots_held(self, pid: int, devices: List[str], slots: Dict[str, int]) -> Dict[str, int]:
        """uuid -> the slot of it whose lock PID took, as the lock table says (0: none now),
        for each of DEVICES shared in slots (SLOTS: uuid -> its slots): a share a service
        before this one granted."""
        table = lock_table()
        out: Dict[str, int] = {}
        for uuid in devices:
            if slots.get(uuid, 1) < 2:
                continue
            out[uuid] = 0
            for k in range(1, slots[uuid] + 1):
                try:
                    st = os.stat(self.leases.slot_path(uuid, k), follow_symlinks=False)
                except OSError:
                    continue
                if any(p == pid for p, _ex in table.get((st.st_dev, st.st_ino), ())):
                    out[uuid] = k
        return out

    def adopt(self, slots: Dict[str, int]) -> List[Held]:
        """Follow again the grants a service before us made that have not ended (a restart):
        their ends are recorded when they happen, not at some later look. Those whose client
        still runs, to watch (their pidfds); the others end now, or when the child holding
        them lets go. SLOTS: uuid -> its slots."""
        from ..ledger import looks as ledger

        running: List[Held] = []
        for record in bookkeeping.still_open(self.layout):
            pid = record["pid"]
            try:
                pidfd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                pidfd = -1
            alive = ledger.proc(pid)
            held = Held(record["uid"], pid, pidfd if pidfd >= 0 else os.open("/dev/null", os.O_RDONLY),
                        list(record["devices"]), record.get("program", ""), record["start"], lease_id=record["id"])
            if record.get("shared"):
                held.slots = self.slots_held(pid, held.devices, slots)
            self.follow(held)
            if pidfd >= 0 and alive is not None and alive.ticks == record["ticks"]:
                running.append(held)
            else:  # its client is gone
                held.exited = True
                self.check(held)
        if self.confine is not None:
            self.confine.reconcile(self._holds(), [h.pid for h in self.held.values()])
        if self.nodes is not None:
            followed = {h.pid for h in self.held.values()}
            unfollowed = {pid: (real_uid(pid), uuids) for pid, uuids in self._holds().items() if pid not in followed}
            self.nodes.reconcile(self._lessees(), {p: (u, d) for p, (u, d) in unfollowed.items() if u is not None})
        return running

    def strays(self) -> List[int]:
        """The holders no adopted grant follows whose nodes stay open to them while they live
        (nodes.reconcile): the loop watches for their exits."""
        return sorted(self.nodes.extra) if self.nodes is not None else []

    def stray_gone(self) -> None:
        """A stray exited: the nodes opened to who holds what now (it no longer)."""
        if self.nodes is not None:
            self.nodes.lessees(self._lessees())

    def _holds(self) -> Dict[int, List[str]]:
        """pid -> the devices it holds: the kernel's locks (a grant sent just before a crash may
        be missing from the ledger's state), and the grants adopted (a child holds a lease its
        exited client took, which the lock table credits to the client)."""
        out: Dict[int, List[str]] = {}
        table = lock_table()
        for uuid, ident in self.leases.idents(self.leases.names()).items():
            for pid, _exclusive in table.get(ident, []) if ident is not None else []:
                out.setdefault(pid, []).append(uuid)
        for h in self.held.values():
            out.setdefault(h.pid, []).extend(u for u in h.devices if u not in h.ended)
        return out
