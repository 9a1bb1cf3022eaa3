"""One line for everyone: the service's waiters and the file queue's, decided together.

Each decision is acquire.Acquirer.decide (the machine as the lock table and NVML show it,
then schedule.decide) over the service's own waiters and the live entries of the queue
directory (runs that decided for themselves: started before the service, or in a Slurm
job). What a queue entry claims is a user's word, so the service believes of it only what
cannot keep devices from others: a count above what that user could ever hold there is
left out (it could never be served, and would only have devices kept idle for it), and its
devices are kept for it no sooner than the admin's reserve_after. An entry offered devices
that does not take them is passed over for turns.STALL_S (sched/turns.py says when), as is
a client of the service's own (pass_over: service/stalls.py says when).
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .. import locations as loc
from ..sched.acquirer import Acquirer
from ..sched.machine import ViewOptions, free_mib_of
from ..devices.model import Inventory
from ..errors import CudawrapError, NoDeviceError, NvmlUnavailable
from ..lease.files import LeaseFiles
from ..lease.known import lease_file_inventory
from ..sched.request import Request
from ..sched.schedule import GRANTED, Decision, Verdict, Waiter
from ..sched.queue import Scan, WaitQueue
from ..sched.successor import State, after, released
from ..sched.turns import STALL_S, Offers
from .knownlocks import known_locks, probed

# A lease found free is tried again after this long even if the watch reported nothing.
FREE_KEPT_S = 1.0
# Lines longer than this are not carried on to a release (_carried): the rule's order over
# the line costs ~1 ms per 1000 waiting (warm; 2-4 cold) at each release, on top of the
# full decision that follows it, and with 1000 waiting while 50 runs turned over the
# service's CPU rose from 3.1-3.9 % of a core to 4.8 % in one run (target < 5 %).
CARRY_MAX_WAITERS = 256


def _inventory(root: str) -> "tuple[Inventory, Optional[Callable]]":
    """The machine from NVML (kept open), else from the lease files root made; and how a
    device is read again (a freed one, at its hand-over): from the snapshot the service's
    monitor child writes every half second, less the processes that have exited since, as
    a waiting run reads it (devices/snapshot.py); from NVML while that is not fresh. NVML's
    own reading (~0.5 ms on an H200) would be on every hand-over's path."""
    from ..devices import nvml
    from ..devices.snapshot import SnapshotRefresh

    try:
        return nvml.inventory(direct=False), SnapshotRefresh(root, sticky=False)
    except NvmlUnavailable:
        inventory = lease_file_inventory(loc.under(root, loc.LEASE_DIR))
        if inventory is None:
            raise
        return inventory, None


class Line:
    """The machine and its waiters, as the service decides on them."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.leases = LeaseFiles(loc.under(root, loc.LEASE_DIR), loc.under(root, loc.SHARE_DIR))
        self.queue = WaitQueue(loc.under(root, loc.QUEUE_DIR))
        self.offered = Offers()  # queue entries offered devices, not yet taking them
        self.entries: List[Waiter] = []  # the queue entries of the last decision
        self.paths: Dict[str, str] = {}
        # uuid -> when its lease was last tried and found free, while the service's watch on
        # the lease files says nobody has opened, closed or replaced it since (when WATCHED).
        self.free_at: Dict[str, float] = {}
        self.watched = False
        # The last decision's look, carried on through its grants: a release decides on it
        # (hand_over) while the caller sees nothing else change (forget() otherwise).
        self.prepared: Optional[State] = None
        # uuid -> {pid that took its lock: uid} of the service's grants not seen let go (its
        # books: Grants.books), believed over the pid when a decision counts who holds what.
        self.books: Callable[[], Dict[str, Dict[int, int]]] = dict
        self.load()

    def load(self, machine: bool = True) -> None:
        """Read the machine (MACHINE: at start, and when the lease files change) and the policy
        afresh; the policy alone when its files change (decide), the devices' readings kept."""
        from ..policy import effective as policy
        from ..lease.sharing import Sharing

        if machine:
            self.inventory, self.refresh = _inventory(self.root)
            self.present = frozenset(self.leases.names())
        self.snapshot_seen: Optional[Tuple[int, int, int]] = None  # the snapshot the devices were last read from
        self.free_at.clear()
        self.prepared = None
        self.policy_seen = policy.files_signature(self.root)
        value = policy.effective(self.root, None, {}).values()
        self.reserve_after = float(value.get("reserve_after", 300.0))
        limits = value.get("limits") or {}
        self.limit_of = None
        if limits.get("users") or limits.get("groups") or limits.get("default", (0, ""))[0]:
            from ..policy.limits import limit_for

            self.limit_of = lambda uid: limit_for(uid, limits)
        devices = [d for d in self.inventory.devices if d.uuid in self.present]
        previous: Optional[Acquirer] = getattr(self, "acquirer", None)
        self.acquirer = Acquirer(
            self.leases, self.queue, devices, self.inventory.devices, Request(1, reserve_after=self.reserve_after),
            ViewOptions(foreign=value["foreign"], busy_memory_mib=value["busy_memory_mib"], refresh=self.refresh,
                        limit_of=self.limit_of, drained=self._drained, sharing=Sharing(value.get("sharing"))))
        if previous is not None:
            self.acquirer.holders = previous.holders  # who held leases (held_by) outlives a new look at the machine
            self.acquirer.skip_keys, self.acquirer.skip_users = previous.skip_keys, previous.skip_users  # and who is passed over
            if not machine:  # the same devices: what was read of them since stands
                a = self.acquirer
                a.current.update(previous.current)
                a.checked_at.update(previous.checked_at)
                a.stale, a.lost = previous.stale, previous.lost

    def _drained(self) -> "set[str]":
        if not os.path.exists(loc.under(self.root, loc.DRAINS)):
            return set()
        from ..sched.drains import covering, drained

        drains = drained(self.root)
        return {d.uuid for d in self.inventory.devices if covering(drains, d.uuid, d.parent_uuid)}

    def touched(self, names: Optional[Sequence[str]] = None) -> None:
        """The lease files NAMES (None: any) were opened, closed or replaced, or a grant of them
        sent or voided: their locks are tried again at the next decision."""
        if names is None:
            self.free_at.clear()
        else:
            for name in names:
                self.free_at.pop(name, None)

    def _free(self, uuid: str, now: float) -> bool:
        """Whether nobody holds UUID's lease (a device of one slot).

        A lease found free stays free until someone takes its lock, and nobody can without
        a descriptor on it: one opened since (the watch reports the open), or one that was
        open already and unlocked (a grant sent: touched() then; or root's run
        deciding for itself). A run granted such a lease finds it held when it
        takes it, says so (wire.LOST), and the lease is tried again: the flock stays the
        truth. A free lease is tried again at least every FREE_KEPT_S all the same, and one
        found held always (a holder may let go without a close the watch would report)."""
        if self.watched and now - self.free_at.get(uuid, -FREE_KEPT_S) < FREE_KEPT_S:
            return True
        if self.leases.free_now(uuid):
            self.free_at[uuid] = now
            return True
        self.free_at.pop(uuid, None)
        return False

    def changed(self) -> bool:
        """Whether the lease files are not those the machine was read with (a sync since)."""
        return frozenset(self.leases.names()) != self.present

    def _believable(self, w: Waiter) -> Optional[Waiter]:
        """A queue entry as far as it can be believed (module docstring), or None."""
        ceiling = len(self.present if w.candidates is None else w.candidates & self.present)
        limit = self.limit_of(w.uid) if self.limit_of is not None else 0
        if w.count > ceiling or (limit and w.count > limit):
            return None
        if w.reserve_after < self.reserve_after:
            w.request = w.request.replace(reserve_after=self.reserve_after)
        return w

    def decide(self, mine: Sequence[Waiter], claimed: Dict[str, List[Tuple[int, bool]]],
               granted: Optional[Dict[str, int]] = None, carry: bool = False) -> Decision:
        """Verdicts for MINE (the service's waiters) and the believable queue entries: every
        grant, the others' once the Decision is finished (the grants are sent first).

        CLAIMED: devices sent to a client whose lock may not show yet (uuid -> its pid and
        whether exclusive, or a share, for each): held, for this decision. GRANTED: the
        devices the service granted and sees held (uuid -> its client's pid). CARRY: the
        decision's grants are sent, and its look is kept for the next release (hand_over);
        a status's look leaves what is kept as it was."""
        if carry:
            self.prepared = None
        from ..policy.effective import files_signature

        if files_signature(self.root) != self.policy_seen:
            try:
                self.load(machine=False)  # the admin's edit holds for the next decision, as for the next launch
            except CudawrapError:
                pass  # a broken config: each request is refused with its error (requests.read); the last policy decides
        self._look()
        known: Optional[Scan] = None
        if self._alone(mine):
            scan = known = probed(self.leases, self.present, claimed, self._free)
        else:
            if granted is not None and self.queue.idle():
                known = known_locks(self.leases, self.present, self.acquirer.slots, granted, claimed, self._free)
            scan = known or self.queue.scan()
        now = time.monotonic()
        for skips in (self.acquirer.skip_keys, self.acquirer.skip_users):
            for gone in [k for k, until in skips.items() if until <= now]:
                del skips[gone]  # over: a release's hand-over is carried on again (_carried)
        entries = [w for w in (self._believable(w) for w in scan.waiters) if w is not None]
        table = dict(scan.table)
        for uuid, locks in claimed.items():
            ident = self.leases.ident(uuid)
            if ident is None:
                continue
            seen = table.get(ident)
            if seen is None:
                table[ident] = list(locks)
            else:  # a share already taken shows in the table: counted once
                table[ident] = seen + [lock for lock in locks if not lock[1] and lock not in seen]
        self.entries, self.paths = entries, scan.paths
        books = self.books()
        idents = self.leases.idents(books)
        self.acquirer.books = {idents[u]: taken for u, taken in books.items() if idents.get(u) is not None}
        verdicts, _free = self.acquirer.decide(Scan(entries + list(mine), table, scan.paths), None, True,
                                               grants_first=True)
        self._pass_over_idle(entries, verdicts, now)  # grants only: all there
        if carry and known is not None:
            self.prepared = self._carried(verdicts)
        return verdicts

    def _look(self) -> None:
        """The devices as the newest snapshot of the service's monitor lists them (processes,
        memory), where it was rewritten since the last decision: a process cudawrap did not
        start counts within one monitor period of NVML listing it, as for a run deciding for
        itself, without NVML on a served launch's path (a stat of the snapshot when nothing
        changed). Devices whose lease was held at a look since their last reading are left
        to be read again as they are let go (MachineView.eligible); without a fresh snapshot
        (the monitor stopped) the last readings stand."""
        a = self.acquirer
        if self.refresh is None:
            return  # no NVML: nothing lists processes
        try:
            st = os.stat(loc.under(self.root, loc.USAGE_SNAPSHOT))
        except OSError:
            return
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen == self.snapshot_seen:
            return
        self.snapshot_seen = seen  # (one found stale is read again once rewritten)
        from ..devices.snapshot import read_fresh

        fresh = read_fresh(self.root)
        if fresh is None:
            return
        now = time.monotonic()
        for device in fresh.devices:
            old = a.current.get(device.uuid)
            if old is None or device.uuid in a.stale or device.uuid in a.lost:
                continue
            if old.pids != device.pids and self.prepared is not None and device.uuid in self.prepared.free:
                self.forget()  # the look carried on counts it free: a release must not grant it unread
            a.current[device.uuid] = device
            a.checked_at[device.uuid] = now

    def unreachable(self, w: Waiter) -> Optional[NoDeviceError]:
        """Why the service's waiter W can never be served now (its devices drained or lost since
        it asked), as a run deciding for itself is told (MachineView.unreachable); None if it can."""
        return self.acquirer.unreachable(self.present if w.candidates is None else w.candidates & self.present,
                                         w.count)

    def _carried(self, verdicts: Decision) -> Optional[State]:
        """The decision's look once its grants are taken, where a release can carry it on:
        every holder known to the service (no lock table read), no device shared, nobody
        passed over for a while (that ends with the clock, not with an event), a line of
        at most CARRY_MAX_WAITERS."""
        a = self.acquirer
        if a.last is None or a.sharing.anywhere or a.skip_keys or a.skip_users:
            return None
        waiters, free, held, limits, busy, fit, shares, bounds, idents = a.last
        if len(waiters) > CARRY_MAX_WAITERS:
            return None  # a long line's hand-over waits for the full decision, as before
        if any(w.request.foreign not in (None, (a.foreign, a.busy_memory_mib)) for w in waiters):
            return None  # a run judged by its program's own foreign rule: a device let go is judged for it there
        state = State(waiters, free, held, limits, a.parents, busy, fit, shares, bounds, list(idents), a.whole)
        return after(state, {key: v.devices for key, v in verdicts.items() if v.kind == GRANTED})

    def held_by(self, pid: int) -> None:
        """PID took a lease the service granted: once it is exiting, its processes NVML still
        lists on the device are no work (MachineView.holders), named by a look or not (a lone
        waiter's look names no holder: knownlocks.probed). Else a release read at its lease's close,
        the run not yet gone, kept its device busy until a re-read a second later."""
        self.acquirer.holders.add(pid)

    def forget(self) -> None:
        """Something a release does not account for changed (a run came or left, a drain, a
        lease taken past the service): the next release waits for a full decision."""
        self.prepared = None

    def hand_over(self, devices: Sequence[str]) -> Optional[Dict[str, Tuple[str, ...]]]:
        """The grants once DEVICES, held whole and now found free, are let go: decided on the
        last look carried on (key -> devices), each device read again first as a decision
        reads a device let go (foreign work on it, or lost: not free). None where nothing is
        carried on, or a device is not plainly free now: a full decision is needed."""
        self._look()  # processes the monitor listed since on other devices: not the look carried (forget)
        state, self.prepared = self.prepared, None
        if state is None:
            return None
        a = self.acquirer
        now = time.monotonic()
        fit: Dict[str, Tuple[Optional[int], Optional[int]]] = {}
        for uuid in devices:
            if uuid not in a.mine or uuid in a.lost or uuid in a.unavailable or not a.eligible(uuid, now):
                return None
            device = a.current[uuid]
            fit[uuid] = (free_mib_of(device), device.utilization)
        state = released(state, devices, fit)
        if state is None:
            return None
        grants = state.decide(time.time())
        self.prepared = after(state, grants)
        return grants

    def joinable(self, uuids: Sequence[str], uid: int) -> bool:
        """Whether UID may join the sharers of those of UUIDS that had sharers at the last
        decision: under MPS, NVML read again shows no other user's work there, as a share
        deciding for itself checks before it stays (its device's data may be older)."""
        return all(self.acquirer.joinable(u, uid) for u in uuids if u in self.acquirer.joined)

    def programs(self, entries: Sequence[Waiter], paths: Dict[str, str]) -> Dict[str, str]:
        """Queue entry -> the program its file names (its owner's word, shown as such), for
        a decision's ENTRIES and their PATHS (kept: a status reads them off the loop)."""
        return {w.key: (self.queue.read_info(paths[w.key]) or {}).get("program", "?")
                for w in entries if w.key in paths}

    def _alone(self, mine: Sequence[Waiter]) -> bool:
        """Whether the one run asking now has nobody to take turns with: no other waiter of the
        service, nobody in the queue directory, no limits, no sharing (whose shared locks
        and owners only the lock table shows)."""
        return (len(mine) == 1 and self.limit_of is None and not self.acquirer.sharing.anywhere
                and self.queue.idle())

    def pass_over(self, key: str, uid: Optional[int], now: float) -> None:
        """The run KEY ignored its turn: it, and its user's (UID's, if given) other runs, are
        passed over for STALL_S, as runs deciding for themselves pass it over
        (Acquirer.watch_others)."""
        self.acquirer.skip_keys[key] = now + STALL_S
        if uid is not None:
            self.acquirer.skip_users[uid] = now + STALL_S
        self.prepared = None

    def passed_over(self, key: str, now: float) -> bool:
        return self.acquirer.skip_keys.get(key, 0) > now

    def _pass_over_idle(self, entries: List[Waiter], verdicts: Dict[str, Verdict], now: float) -> None:
        """Queue entries offered devices that they leave untaken lose their turn for a while."""
        granted = {w.key: w for w in entries if getattr(verdicts.get(w.key), "kind", None) == GRANTED}
        self.offered.keep(granted)
        for key, w in granted.items():
            if not self.offered.offer(key, w.pid, now, own=False) and self.offered.ignored(key, now):
                self.acquirer.skip_keys[key] = now + STALL_S
                self.offered.drop(key)
