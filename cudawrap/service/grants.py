"""Each grant from the descriptors sent to the lock taken, and on to its release.

The service opens a granted device's lease file read-only and sends the descriptor; the
client takes the lock on it. Until the client says so (HELD; a run granted whole devices
instead closes its connection as it execs), the devices count as claimed by it (held, in
every decision), for at most DEADLINE_S: then the service closes its copies and the grant
is void (a stopped or slow client holds nothing: an unlocked descriptor holds no device;
should it lock later, the lock table shows it, as any lock). Either word is checked, not
believed: the service still has the same open file descriptions, and /proc/self/fdinfo
lists the locks each of them holds, and of which kind.

A share (docs/admin/sharing.md) is sent as two descriptors, as a run deciding for itself
holds it: the device's lease file, to be locked shared, and one of its slot files, chosen
here among those nobody holds, to be locked exclusively.

A held grant is followed by a pidfd of its client (no polling): once the client exits the
service tries each lease (LOCK_EX|LOCK_NB on its own descriptor; for a share, on its slot
file, as the device's other sharers hold the lease file): free, the grant ends; still held
(a child inherited the descriptor), it ends at a later close of that lease or slot file.

A grant void (declined, "lost", lapsed at its deadline unlocked) leaves its client the
descriptors, which it may lock whenever it likes (a flock belongs to the open file
description, and SCM_RIGHTS passed that whole: closing our copies takes nothing back). So
each of its files is replaced by a fresh one (lease/renew.py) while nobody holds it, the
first time it is found free: what the client kept names a file nobody reads. And
every lease and slot file is replaced so at the service's start, descriptors opened before
it made the directories root's being worth no more (RENEWING lists those not yet replaced:
renewals.py). A restarted service follows its predecessor's grants again (adoption.py).

A shared device's MPS pipe directory is open to the uids of its
sharers alone (lease/mpsaccess.py): set when a share is confirmed, again as shares end.

Under [confine] runs = true each client's run cgroup (confine/cgroups.py) opens what it holds
through the service: widened before a grant is sent, narrowed when one is void, not taken
or ended (``_confine``).
"""
from __future__ import annotations

import array
import os
import socket
import time
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from .. import wire
from ..errors import NotConfined
from ..lease.files import LeaseFiles
from ..paths import Layout
from . import bookkeeping
from .adoption import Adoption
from .granted import Held, Pending
from .renewals import Renewals

DEADLINE_S = 2.0
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class Grants(Renewals, Adoption):
    """The grants sent and held, followed; replacing the files whose descriptors are out
    there (renewals.py) and a restart's adoption (adoption.py) are parts of it."""

    def __init__(self, leases: LeaseFiles, layout: Layout,
                 say: Callable[[str], None] = lambda line: None) -> None:
        from ..lease.mpsaccess import PipeAccess

        self.leases = leases
        self.layout = layout
        self.pending: Dict[str, Pending] = {}
        self.held: Dict[int, Held] = {}  # pidfd -> grant
        self.pipes = PipeAccess(layout, say)
        # (uuid, slot) of each lease file (slot 0) and slot file to replace once found free.
        self.renewing: Set[Tuple[str, int]] = set()
        self.renewing_file = layout.runtime_dir / "service.renewing"
        # uuid -> {pid: uid} of a void grant's client, while its lease file waits in RENEWING
        # (held when the grant was voided: by that client, through what it was sent, as a rule).
        self.voided: Dict[str, Dict[int, int]] = {}
        from ..policy.config import load_config
        from ..confine import nodes as leasednodes
        from ..confine.cgroups import for_install

        config = load_config(layout.config_file)
        self.confine = for_install(config, str(layout.root), say)
        self.nodes = leasednodes.for_install(config, str(layout.state_dir), say)

    def close(self) -> None:
        if self.confine is not None:
            self.confine.close()
        if self.nodes is not None:
            from ..policy.config import load_config
            from ..confine import nodes as leasednodes

            self.nodes.close()
            if load_config(self.layout.config_file)["nodes"] != "leased":  # set to "open" since the start
                leasednodes.put_back(str(self.layout.state_dir))

    def enter(self, pid: int, uid: int) -> None:
        """A client asked for devices: under [confine] runs, into a run cgroup of its own, now."""
        if self.confine is not None:
            self.confine.enter(pid, uid)

    def _confine(self, pid: int, more: Sequence[str] = (), uid: int = -1) -> bool:
        """PID's run cgroup set to what it holds through the service, and MORE (about to be
        sent, to UID); under nodes = "leased" every node to its lessees; False where it could
        not be done."""
        if self.nodes is not None and not self.nodes.lessees(self._lessees(more, uid)):
            return False
        if self.confine is None:
            return True
        devices = {u for p in self.pending.values() if p.pid == pid for u in p.devices}
        devices.update(u for h in self.held.values() if h.pid == pid for u in h.devices
                       if u not in h.ended and u not in h.let_go)
        return self.confine.allow(pid, sorted(devices.union(more)))

    def gone(self, pid: int) -> None:
        """PID's connection is closed: its run cgroup opens what it still holds through the
        service (nothing, for a run killed while it waited: its cgroup goes once empty)."""
        if self.confine is not None:
            self._confine(pid)
            self.confine.forget(pid)

    def _lessees(self, more: Sequence[str] = (), uid: int = -1) -> Dict[str, Set[int]]:
        """uuid -> the uids holding it through the service now (and UID, MORE about to be sent)."""
        out: Dict[str, Set[int]] = {u: {uid} for u in more}
        for p in self.pending.values():
            for u in p.devices:
                out.setdefault(u, set()).add(p.uid)
        for h in self.held.values():
            for u in h.devices:
                if u not in h.ended and u not in h.let_go:
                    out.setdefault(u, set()).add(h.uid)
        return out

    def let_go(self, held: Held) -> None:
        """HELD's leases were found free (its client let go, or is exiting): its cgroup and the
        nodes no longer open them, before they go to anyone else (the API's release())."""
        if self.confine is not None or self.nodes is not None:
            held.let_go = list(held.devices)
            self._confine(held.pid)

    def sharers(self, uuid: str) -> Set[int]:
        """The uids holding a share of UUID through the service now."""
        return {h.uid for h in self.held.values() if h.slots.get(uuid) and uuid not in h.ended}

    def _mps_access(self, held: Held) -> None:
        """HELD's shared devices' pipe directories for their sharers now."""
        for uuid in held.slots:
            self.pipes.set(uuid, self.sharers(uuid))

    def restore_mps_access(self) -> None:
        """Every pipe directory for the shares followed now: a restart's, after adopting."""
        self.pipes.rebuild({u: self.sharers(u) for h in self.held.values() for u in h.slots})

    def claimed(self) -> Dict[str, List[Tuple[int, bool]]]:
        """uuid -> (client pid, exclusive) of each grant sent whose lock may not show yet."""
        out: Dict[str, List[Tuple[int, bool]]] = {}
        for p in self.pending.values():
            for u in p.devices:
                out.setdefault(u, []).append((p.pid, u not in p.slots))
        return out

    def holders(self) -> Dict[str, int]:
        """uuid -> client pid of each whole device granted, taken and not let go, whose client
        still runs: the lock table would name that pid (the client took the lock)."""
        return {u: h.pid for h in self.held.values() if not h.exited
                for u in h.devices if u not in h.slots and u not in h.ended}

    def books(self) -> Dict[str, Dict[int, int]]:
        """uuid -> {client pid: uid} of every grant sent and not seen let go, its client
        running or not: a lease is its user's while its lock is held, wherever its descriptor
        went (sent on into a socket, mapped), until the service finds it free (check); and
        of a void grant's lease held when it was voided (VOIDED)."""
        out: Dict[str, Dict[int, int]] = {u: dict(taken) for u, taken in self.voided.items()}
        for p in self.pending.values():  # sent, its word not read yet: its lock may show all the same
            for u in p.devices:
                out.setdefault(u, {})[p.pid] = p.uid
        for h in self.held.values():
            for u in h.devices:
                if u not in h.ended:
                    out.setdefault(u, {})[h.pid] = h.uid
        return out

    def free_slots(self, shared: List[str], slots: Dict[str, int]) -> Optional[Dict[str, int]]:
        """uuid -> a slot of it nobody holds nor was sent, for each of SHARED (SLOTS: uuid ->
        its slots); None if one has none now (taken past the line since the decision)."""
        sent = {(u, k) for p in self.pending.values() for u, k in p.slots.items()}
        chosen: Dict[str, int] = {}
        for uuid in shared:
            free = next((k for k in range(1, slots[uuid] + 1)
                         if (uuid, k) not in sent and self.leases.slot_free(uuid, k)), None)
            if free is None:
                return None
            chosen[uuid] = free
        return chosen

    def offer(self, sock: socket.socket, key: str, pid: int, uid: int, devices: List[str], program: str,
              asked: float, slots: Optional[Dict[str, int]] = None, fields: Optional[Dict[str, str]] = None,
              counts_as: Optional[float] = None, ticks: Optional[int] = None, exe: Optional[str] = None) -> bool:
        """Open DEVICES' lease files, record the grant and send their descriptors to the client
        PID on SOCK (bookkeeping.grant); False if that failed (a record then ends at once). SLOTS: uuid -> the slot file of each
        device taken as a share; FIELDS: more of the GRANT (the run's variables); COUNTS_AS:
        what a grant with shares counts as, in devices; TICKS, EXE: the client's start and
        executable, where they were read when it connected."""
        slots = slots or {}
        stale = sorted({(u, k) for u in devices for k in (0, slots.get(u, 0)) if (u, k) in self.renewing})
        if stale:
            self.renew(stale)  # found free by the decision: replaced before it goes out (held: LOST)
        fds: List[int] = []
        described: List[str] = []
        exclusive: List[bool] = []
        try:
            for uuid in devices:
                fds.append(os.open(self.leases.path(uuid), _OPEN))
                described.append(f"{wire.LEASE}:{uuid}:{wire.SHARED if uuid in slots else wire.EXCLUSIVE}")
                exclusive.append(uuid not in slots)
                if uuid in slots:
                    fd = self.leases.open_slot(uuid, slots[uuid])
                    if fd is None:
                        raise OSError(f"slot {slots[uuid]} of {uuid} is gone")
                    fds.append(fd)
                    described.append(f"{wire.SLOT}:{uuid}:{wire.EXCLUSIVE}")
                    exclusive.append(True)
        except OSError:
            for fd in fds:
                os.close(fd)
            return False
        if not self._confine(pid, devices, uid):
            for fd in fds:
                os.close(fd)
            try:  # its one line, then it is dropped as a client gone
                sock.send(wire.encode(wire.ERROR, {"code": str(NotConfined.exit_code), "text": "the cudawrap service could not "
                                      "confine this run to its devices ([confine] runs = true): nothing was granted",
                                      "hint": "the service's log says why; `cudawrap doctor` checks the host"}))
            except OSError:
                pass
            return False
        data = wire.encode(wire.GRANT, {"devices": ",".join(devices), "fds": ",".join(described), **(fields or {})})

        def send() -> bool:
            try:
                sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())])
            except OSError:
                return False
            return sent == len(data)

        lease_id = bookkeeping.grant(self.layout, pid, uid, devices, program, asked, counts_as if slots else None, send,
                                  ticks, exe)
        if lease_id is None:
            for fd in fds:
                os.close(fd)
            self._confine(pid)
            return False
        self.pending[key] = Pending(key, pid, list(devices), fds, time.monotonic() + DEADLINE_S, lease_id,
                                    exclusive, dict(slots), uid=uid)
        return True

    def void(self, key: str) -> List[str]:
        """Take back the grant KEY sent and not taken: its devices."""
        pending = self.pending.pop(key, None)
        if pending is None:
            return []
        pending.close()
        bookkeeping.end(self.layout, pending.lease_id, "not taken")
        self._confine(pending.pid)  # narrowed first: before anything else happens
        self._renew_void(pending)
        return pending.devices

    def confirm(self, key: str) -> Optional[Pending]:
        """The pending grant KEY if every lock is now held through what was sent; void otherwise."""
        pending = self.pending.pop(key, None)
        if pending is None:
            return None
        ok = pending.taken()
        pending.close()
        if not ok:
            bookkeeping.end(self.layout, pending.lease_id, "not taken")
            self._confine(pending.pid)  # narrowed first: before anything else happens
            self._renew_void(pending)
        return pending if ok else None

    def _renew_void(self, pending: Pending) -> None:
        """PENDING is void: its files replaced; one held now (its client locked it as it was
        voided, or a run took it past us) counts as its client's until it is (books)."""
        self.renew(_files(pending))
        for uuid in pending.devices:
            if (uuid, 0) in self.renewing:
                self.voided.setdefault(uuid, {})[pending.pid] = pending.uid

    def expired(self, now: float) -> List[str]:
        return [k for k, p in self.pending.items() if p.deadline <= now]

    def follow(self, held: Held) -> None:
        self.held[held.pidfd] = held
        self._mps_access(held)

    def check(self, held: Held) -> bool:
        """Whether every lease of HELD is let go (its client has exited): free now, or sent
        since to another run; frees the pidfd then."""
        held.ended = [u for u in held.devices if u in held.ended or self.sent_since(held, u)
                      or (self.leases.slot_free(u, held.slots[u]) if u in held.slots else self.leases.free_now(u))]
        if len(held.ended) < len(held.devices):
            self._mps_access(held)
            return False
        self.held.pop(held.pidfd, None)
        self._mps_access(held)
        os.close(held.pidfd)
        bookkeeping.end(self.layout, held.lease_id, held.how)
        self._confine(held.pid)
        return True


    def sent_since(self, held: Held, uuid: str) -> bool:
        """Whether HELD's hold on UUID went to another run since, which the service found free
        then: its share's slot (0: none was taken), or the whole device. In a burst the next
        run has the device locked before this client's exit is read, so its lease reads held;
        taken for this grant's, its end was recorded at the next run's (a second late:
        tests/test_grants_ended.py)."""
        pending, held_now = self.pending.values(), [g for g in self.held.values() if g is not held]
        if uuid in held.slots:
            slot = held.slots[uuid]
            return slot == 0 or any(g.slots.get(uuid) == slot for g in list(pending) + held_now)
        return (any(uuid in p.devices and uuid not in p.slots for p in pending)
                or any(g.since > held.since and uuid in g.devices and uuid not in g.slots for g in held_now))

    def lingering(self) -> List[Held]:
        """Grants whose client exited with a lease still held (by a child it passed it to)."""
        return [h for h in self.held.values() if h.exited]


def _files(pending: Pending) -> List[Tuple[str, int]]:
    """The files PENDING sent descriptors of: (uuid, slot), slot 0 its lease file."""
    return [(u, 0) for u in pending.devices] + [(u, k) for u, k in pending.slots.items()]
