"""Each grant from the descriptors sent to the lock taken, and on to its release.

The service opens a granted device's lease file read-only and sends the descriptor; the
client takes the lock on it. Until the client says so (HELD; a run granted whole devices
instead closes its connection as it execs), the devices count as claimed by it (held, in
every decision), for at most DEADLINE_S: then the service closes its copies and the grant
is void (a stopped or slow client holds nothing: an unlocked descriptor holds no device;
should it lock later, the lock table shows it, as any lock). Either word is checked, not
believed: the service still has the same open file descriptions, and /proc/self/fdinfo
lists the locks each of them holds, and of which kind.

A share (README "Sharing a GPU") is sent as two descriptors, as a run deciding for itself
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
it made the directories root's being worth no more (RENEWING lists those not yet replaced).

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
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .. import wire
from ..errors import NotConfined
from ..lease.files import LeaseFiles, lock_kind, lock_table
from ..lease.renew import replace
from ..paths import Layout
from ..base.proc import real_uid
from . import bookkeeping

DEADLINE_S = 2.0
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass
class Pending:
    key: str
    pid: int
    devices: List[str]
    fds: List[int]  # the service's copies of what was sent
    deadline: float
    lease_id: str = ""  # its ledger record
    exclusive: List[bool] = field(default_factory=list)  # the lock each of FDS must hold
    slots: Dict[str, int] = field(default_factory=dict)  # uuid -> the slot file sent, for a share
    released_by: int = 0  # the pid whose release it was handed over at, on the last look (0: a new look)
    uid: int = -1  # its client's

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def taken(self) -> bool:
        """Whether every lock is held through what was sent, each of its kind."""
        return all(lock_kind(fd) is kind for fd, kind in zip(self.fds, self.exclusive))


@dataclass
class Held:
    uid: int
    pid: int
    pidfd: int
    devices: List[str]
    program: str
    since: float  # time.time() of the grant
    lease_id: str = ""
    exited: bool = False
    ended: List[str] = field(default_factory=list)  # devices found released
    slots: Dict[str, int] = field(default_factory=dict)  # uuid -> its slot, for a share (0: let go already)
    how: str = "ended"  # what its end record says ("revoked by NAME": cudawrap revoke)
    let_go: List[str] = field(default_factory=list)  # devices found free while it ran: closed to its cgroup


class Grants:
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

    # -- replacing files whose descriptors are out there ----------------------------------
    def path_of(self, uuid: str, slot: int) -> str:
        return self.leases.path(uuid) if slot == 0 else self.leases.slot_path(uuid, slot)

    def renew(self, files: Iterable[Tuple[str, int]]) -> List[str]:
        """Replace each of FILES ((uuid, slot), slot 0: its lease file) that nobody holds
        now; the others wait in RENEWING for a later try (renew_free). The uuids whose lease
        file was replaced (tried again at the next decision)."""
        before = set(self.renewing)
        replaced: List[str] = []
        for uuid, slot in files:
            try:
                done = replace(self.path_of(uuid, slot))
            except OSError:
                done = False
            if done is False:
                self.renewing.add((uuid, slot))
                continue
            self.renewing.discard((uuid, slot))
            if slot == 0:
                self.voided.pop(uuid, None)
                self.leases.forget(uuid)  # our descriptor names the old file
                replaced.append(uuid)
        if self.renewing != before:
            self._note_renewing()
        return replaced

    def renew_free(self) -> List[str]:
        """renew() those of RENEWING found free, tried through the descriptors we keep open
        (an open of ours would wake our own watch, and every waiting run's)."""
        sent = {u for p in self.pending.values() for u in p.devices}  # its client's lock may be coming
        free = [(u, k) for u, k in sorted(self.renewing)
                if u not in sent and (self.leases.free_now(u) if k == 0 else self.leases.slot_free(u, k))]
        return self.renew(free) if free else []

    def _note_renewing(self) -> None:
        """For sync and doctor, the files of RENEWING held by no grant of ours (one name a
        line; no file when none): held through a descriptor opened before the service took
        the directories over, or one it granted before a restart."""
        ours = self.books()
        names = sorted(os.path.basename(self.path_of(u, k)) for u, k in self.renewing if u not in ours)
        try:
            if not names:
                self.renewing_file.unlink(missing_ok=True)
            else:
                tmp = self.renewing_file.with_name(self.renewing_file.name + ".tmp")
                tmp.write_text("".join(f"{n}\n" for n in names))
                tmp.replace(self.renewing_file)
        except OSError:
            pass  # only a report: the set itself is ours

    def every_file(self) -> List[Tuple[str, int]]:
        """(uuid, slot) of every lease file (slot 0) and slot file there is."""
        uuids = sorted(n for n in self.leases.names() if n.startswith(("GPU-", "MIG-")))
        return [(u, k) for u in uuids for k in [0] + _slot_numbers(self.leases.share_dir, u)]

    def revoke(self, uuid: str, by: str) -> Tuple[List[Held], List[str]]:
        """`cudawrap revoke`: UUID's lease and slot files replaced, held or not, so that no
        descriptor on them guards anything; the grants holding it end (their record says
        BY revoked it) once their clients have gone. (The grants, the keys of those sent and
        not taken, which the caller voids.)"""
        for slot in [0] + _slot_numbers(self.leases.share_dir, uuid):
            try:
                replace(self.path_of(uuid, slot), held_too=True)
            except OSError:
                pass
            self.renewing.discard((uuid, slot))
        self._note_renewing()
        self.voided.pop(uuid, None)
        self.leases.forget(uuid)
        holding = [h for h in self.held.values() if uuid in h.devices and uuid not in h.ended]
        for held in holding:
            held.how = f"revoked by {by}"
            if held.slots.get(uuid):
                held.slots[uuid] = 0  # its slot is let go: the share's file is a new one
            held.ended.append(uuid)
        return holding, [k for k, p in self.pending.items() if uuid in p.devices]

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

    def lingering(self) -> List[Held]:
        """Grants whose client exited with a lease still held (by a child it passed it to)."""
        return [h for h in self.held.values() if h.exited]


def _files(pending: Pending) -> List[Tuple[str, int]]:
    """The files PENDING sent descriptors of: (uuid, slot), slot 0 its lease file."""
    return [(u, 0) for u in pending.devices] + [(u, k) for u, k in pending.slots.items()]


def _slot_numbers(share_dir: Optional[str], uuid: str) -> List[int]:
    """The numbers of UUID's slot files in SHARE_DIR (sync makes them)."""
    try:
        names = os.listdir(share_dir) if share_dir else []
    except OSError:
        return []
    tails = [n[len(uuid) + 1:] for n in names if n.startswith(uuid + ".")]
    return sorted(int(t) for t in tails if t.isascii() and t.isdigit() and len(t) <= 6)
