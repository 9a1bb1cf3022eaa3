"""The machine counted from one lock table, for a decision (MachineView.machine): which
devices are free, how many each user holds, which are busy, who shares which.

Apart from machine.py because a launch nobody waits before never counts the machine: it
tries the locks of the devices it prefers (Acquirer._uncontended), and the shim pays for
each line it loads. A decision loads this as it loads schedule.py. The functions read and
update the view they are given (what it has seen of holders, owners and foreign work).
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Set, Tuple

    from .terms import Shares

    # `view: MachineView` names machine.py's class, which imports this module: never imported
    # here, not even for type checking (the layers contract allows no circle).

    Table = Dict[Tuple[int, int], List[Tuple[int, bool]]]

from ..lease.sharing import MPS

# In a lock table: a lease found held whose holder nobody needs named (pid -2): the service
# deciding for one run alone, without limits or sharing (service/waitline.py, _probed). Counted for no
# user, and never looked for among every process as a gone taker is (owners: heirs).
UNNAMED_HOLDER = (-2, True)


def uid_of(pid: int) -> int:
    """PID's real uid (whose lease it is, a setuid program exec'd on it included); -1 if gone."""
    from ..base.proc import real_uid  # only once a lease is seen held

    uid = real_uid(pid)
    return -1 if uid is None else uid


def tally(view: MachineView, table: Table, idents: Dict[str, Optional[Tuple[int, int]]],
          work: Optional[Dict[str, int]] = None) -> Tuple[List[str], Dict[int, float], Set[str], Shares]:
    """(free devices in the machine's order, devices held per uid, busy devices, shares) of
    VIEW's devices by TABLE; IDENTS: each device's lease file (LeaseFiles.idents). WORK (where
    given) gets the work cudawrap did not start on each device whose lease is free
    (MachineView.work), and view.aside those of them the view's rule keeps off: for waiters
    judged by a rule of their own."""
    now = view.clock()
    free: List[str] = []
    held: Dict[int, float] = {}
    busy: Set[str] = set()
    used: Dict[str, List[int]] = {}
    closed: Set[str] = set()  # shared, but to take no new shares
    view.foreign_busy = set()
    view.aside = []
    view.whole = {}
    named = owners(view, {ident: table[ident] for ident in idents.values() if ident in table})
    for uuid, ident in idents.items():
        if ident is None:
            continue  # no lease file: cannot be leased (not synced yet)
        locks = table.get(ident)
        if locks is not None and view.slots[uuid] < 2 and not any(exclusive for _pid, exclusive in locks):
            # A device of one slot is only ever held exclusively: shared locks on its
            # lease are probes (Acquirer.vacant, microseconds each). Read as shares,
            # a watcher's probe caught by /proc/locks counted a device for its user,
            # and the next turn went to another (test_fairness, on a loaded machine).
            locks = None
        apart = slots_apart(view, uuid, locks, table)
        if locks is not None or apart:
            _count_held(view, uuid, locks, apart, named.get(ident, []), held, busy, used, closed)
        elif uuid in view.lost or uuid in view.unavailable:
            continue
        elif uuid in view.mine and view.eligible(uuid, now):
            free.append(uuid)
        elif uuid not in view.mine and not view.occupied(view.current[uuid]):
            # Another run's device: judged by what we know, never re-read from NVML
            # (the launch reads only its own candidates). A wrong guess here costs
            # fairness at most; whoever takes it checks it for itself.
            free.append(uuid)
        else:
            busy.add(uuid)
            if uuid in view.mine:
                view.foreign_busy.add(uuid)
                if work is not None and uuid not in view.stale:
                    view.aside.append(uuid)
    for uuid in free + view.aside if work is not None else ():
        seen = view.work(view.current[uuid]) if uuid in view.mine else None
        if seen is not None:
            work[uuid] = seen
    slots = {u: 0 if u in closed else n for u, n in view.slots.items()}
    from .terms import Shares

    return free, held, busy, Shares(slots, used, view.sharing.mode == MPS, view.sharing.counts_as)


def _count_held(view: MachineView, uuid: str, locks: Optional[List[Tuple[int, bool]]], apart: List[int],
                uids: List[int], held: Dict[int, float], busy: Set[str], used: Dict[str, List[int]],
                closed: Set[str]) -> None:
    """Count UUID, whose lease is locked (LOCKS, taken by UIDS) or a slot of it locked apart
    (by the pids APART), into HELD (per uid), BUSY, USED (its sharers' uids) and CLOSED."""
    busy.add(uuid)
    view.stale.add(uuid)
    if len(view.holders) > 4096:
        view.holders.clear()  # a long wait through many jobs: only recent ones matter
    view.holders.update(pid for pid, _ex in locks or ())
    cost = view.sharing.cost(view.slots[uuid])
    if locks is not None and any(exclusive for _pid, exclusive in locks):
        uid = uids[0]
        held[uid] = held.get(uid, 0) + 1
        view.whole[uuid] = uid
        for uid in map(uid_of, apart):
            held[uid] = held.get(uid, 0) + cost
        return
    # Shared: each shared lock on the lease file is one share (see sharing.py),
    # and so is each slot locked apart from the lease.
    used[uuid] = list(uids) + [uid_of(pid) for pid in apart]
    if view.strangers(uuid, set(used[uuid])):
        closed.add(uuid)  # its sharers' next clients would wait behind another user's
    for uid in used[uuid]:
        held[uid] = held.get(uid, 0) + cost
    if uuid in view.lost or uuid in view.unavailable:
        closed.add(uuid)


def owners(view: MachineView, held: Table) -> Dict[Tuple[int, int], List[int]]:
    """Lease file -> the real uid of each lock's holder on it (-1 where none is known), of
    the leases HELD (TABLE's lines for them).

    The kernel records the pid that took a lock. Where that process has exited, the lock
    lives on in a descriptor it passed on (acquire(), fork, exit): the holder is then
    looked for among the processes this run may inspect (its own user's, every one for
    root), so that a user's own runs count such a lease against their limit. What was
    found, as every holder's uid, is remembered (view.owners) while the kernel shows the
    same takers on that lease: a decision reads /proc only for leases taken since the last one.
    """
    keys = {ident: (ident, tuple(pid for pid, _ex in locks)) for ident, locks in held.items()}
    unnamed = UNNAMED_HOLDER[0]
    new = {ident: [-1 if pid == unnamed else uid_of(pid) for pid, _ex in held[ident]]
           for ident, key in keys.items() if key not in view.owners}
    gone = {ident: [None if uid < 0 and pid != unnamed else pid for (pid, _ex), uid in zip(held[ident], uids)]
            for ident, uids in new.items()}
    gone = {ident: pids for ident, pids in gone.items() if None in pids}
    if gone:
        from ..lease.holders import heirs  # only with a taker gone: not on a launch's usual path

        for ident, pids in heirs(gone).items():
            new[ident] = [-1 if p is None or p == unnamed else uid_of(p) for p in pids]
    if len(view.owners) + len(new) > 4096:
        view.owners.clear()  # a long wait through many jobs: only the current leases matter
    view.owners.update((keys[ident], uids) for ident, uids in new.items())
    out = {ident: view.owners[key] for ident, key in keys.items()}
    for ident, taken in view.books.items():
        if ident in out:
            booked = set(taken.values())
            out[ident] = [taken.get(pid, next(iter(booked)) if uid < 0 and ex and len(booked) == 1 else uid)
                          for (pid, ex), uid in zip(held[ident], out[ident])]
    return out


def slots_apart(view: MachineView, uuid: str, locks: Optional[List[Tuple[int, bool]]], table: Table) -> List[int]:
    """The takers of UUID's slot files locked by no process that locked its lease file too
    (LOCKS, its lines in TABLE).

    A share takes both locks in one process (LeaseFiles.try_share), so its two lines in
    the lock table name the same pid. A slot locked alone keeps a sharer out as surely as
    a share does, but the lease file does not show it: without this, every shared run
    would be given the device, fail to lock a slot and, after its wait, give up, while
    the device looked free to all. A process that is closing its files is left out: at
    its exit the kernel may drop its lease lock a moment before its slot's."""
    if view.slots[uuid] < 2:
        return []
    sharers = {pid for pid, _ex in locks or ()}
    apart = [pid for ident in view.leases.slot_idents(uuid, view.slots[uuid])
             for pid, _ex in table.get(ident, ()) if pid not in sharers]
    if not apart:
        return apart
    from ..base.proc import closing

    return [pid for pid in apart if not closing(pid)]
