"""[confine] runs = true: each run the service grants is in a cgroup of its own, which lets it
open its own GPUs' and MIG instances' nodes and no other GPU's (README "Confinement").

A run's cgroup, from its request to its end (the service's loop calls; base/cgroup.py does):
- at its request (``enter``), before any decision: the client process is moved into a
  cgroup refusing every GPU, on a worker thread while the decision is made. The cgroup was
  made and confined ahead (a spare, one per place runs go, made as the last run there got its
  grant): on v1 a rule is 254 writes, ~2 ms, and a run waiting for them would wait past its
  decision. The move itself can wait for an RCU grace period (cgroup_threadgroup_rwsem):
  ~10 ms measured for a move alone on a 6.18 VM, ~0.05 ms for moves in a row; a cgroup
  mount with favordynmods (6.0+) spares it, and doctor says so;
- before its grant is sent (``allow``): the rule widened to the devices it will then hold;
- a grant voided or not taken, or ended (``allow`` again, with what is left): narrowed before
  anything else happens; once the process holds nothing, its cgroup is removed as soon as no
  process is left in it (retried at each later end: what is left are the run's leftovers).

Where the cgroup is made: below the client's own cgroup, so that every refusal above it
still holds (v1 copies its parent's list, v2 runs its ancestors' programs) and the run stays
under the resource controls of the slice or scope it was in: a systemd session scope is not
delegated, and systemd leaves a child it did not make alone while the scope lives (the
cgroup goes with the run, before the scope ends). Never where the client's user can write
(a delegated user@UID.service, a `systemd-run --user` scope): the user could move the run
out again; there, below the nearest ancestor the user cannot write. A nested run with a
lease of its own goes beside its parent run's cgroup, not inside it (inside, its parent's
rule would refuse its own GPUs). Inside a Slurm job nothing is done: Slurm's cgroup is
Slurm's (ConstrainDevices), and doctor says whether it confines.
"""
from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, Iterable, Mapping, Optional, Set, Tuple

from ..base import cgroup
from ..base.devrule import Rule
from ..devices import drivernodes
from ..devices.nvml import node_ids
from ..errors import SetupError
from ..base.proc import start_time

log = logging.getLogger(__name__)

RUN_PREFIX = "cudawrap-run-"
ORPHAN_POLL_S = 0.5


def install_tag(root: str) -> str:
    """A short name for the install at ROOT, in its run cgroups' names: each install's
    service adopts its own install's run cgroups at its start, never another install's on
    the same host (which it would narrow to nothing, its spares removed)."""
    return hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:8]


class RunCgroups:
    def __init__(self, mech: "cgroup.V1 | cgroup.V2", proc: str, tag: str,
                 say: Callable[[str], None] = log.warning) -> None:
        self.mech = mech
        self.proc = proc
        self.prefix = f"{RUN_PREFIX}{tag}-"  # this install's run cgroups (install_tag)
        self.say = say
        self.ids: Dict[str, drivernodes.NodeIds] = {}  # uuid -> its node numbers (fixed while it exists)
        self.runs: Dict[int, str] = {}  # client pid -> its cgroup
        self.rules: Dict[int, Rule] = {}  # client pid -> the rule applied there last
        self.entering: Dict[int, "Future[str]"] = {}
        self.spares: Dict[str, str] = {}  # where runs go -> a cgroup made and confined ahead (the worker's alone)
        self.bases: Dict[int, str] = {}  # client pid -> where its run cgroup went
        self.made = 0
        self.failed: Set[int] = set()  # entered, not confined: refused its grants
        self.ended: Set[int] = set()  # holding nothing, cgroup not yet empty
        self.orphans_gone: "queue.SimpleQueue[Tuple[int, str]]" = queue.SimpleQueue()  # (pid, cgroup) the emptier removed
        self.emptying: Dict[str, int] = {}  # a cgroup the emptier removes once empty -> its pid (its lock's)
        self.emptying_lock = threading.Lock()
        self.emptier: Optional[threading.Thread] = None
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="cudawrap-confine")

    # -- the run's cgroup -------------------------------------------------------------------
    def enter(self, pid: int, uid: int) -> None:
        """Move PID into a cgroup of its own refusing every GPU, on the worker (see the module)."""
        self.sweep()  # a pid that was an orphan's is a new process's now
        if pid in self.ended:  # so is one whose run ended, its cgroup waiting for its leftovers
            self._await_empty({pid: self.runs.pop(pid)})
            self.ended.discard(pid)
            self.rules.pop(pid, None)
        if pid not in self.runs and pid not in self.entering:
            self.entering[pid] = self.worker.submit(self._enter, pid, uid)

    def _enter(self, pid: int, uid: int) -> str:
        base = self._base(pid, uid)
        path = self.spares.pop(base, None) or self._make(base)
        try:
            self.mech.move(path, pid)
        except OSError:
            self.mech.remove(path)  # nobody in it
            raise
        self.bases[pid] = base
        return path

    def _make(self, base: str) -> str:
        """A new run cgroup below BASE refusing every GPU. Named by the install, the service's
        pid and a count, not the run's: a restart finds a run's cgroup from its pid's /proc entry."""
        while True:  # never one that exists: a service before this one may have had this pid
            self.made += 1
            name = f"{self.prefix}{os.getpid()}-{self.made}"
            if not os.path.lexists(os.path.join(self.mech.roots[0], base.lstrip("/"), name)):
                break
        path = self.mech.make(base, name)
        try:
            self.mech.confine(path, self.rule(()))
        except OSError:
            self.mech.remove(path)
            raise
        return path

    def _spare(self, base: str) -> None:
        if base not in self.spares:
            try:
                self.spares[base] = self._make(base)
            except OSError as exc:
                self.say(f"no cgroup could be made ahead below {base}: {exc.strerror or exc}")

    def _base(self, pid: int, uid: int) -> str:
        """Where PID's run cgroup goes: its own cgroup, or the nearest ancestor neither a run's
        nor writable by UID."""
        here = self.mech.parent_of(pid)
        while here != "/" and (os.path.basename(here).startswith(RUN_PREFIX) or self._writable(here, uid)):
            here = os.path.dirname(here)
        return here

    def _writable(self, path: str, uid: int) -> bool:
        if uid == 0:
            return False  # root's own run: root may move it anywhere anyway
        for root in self.mech.roots:
            where = os.path.join(root, path.lstrip("/"))
            for name in (where, os.path.join(where, "cgroup.procs")):
                try:
                    if os.stat(name).st_uid == uid:
                        return True
                except OSError:
                    pass
        return False

    def _settled(self, pid: int) -> Optional[str]:
        entering = self.entering.pop(pid, None)
        if entering is not None:
            try:
                self.runs[pid] = entering.result()
                self.rules[pid] = self.rule(())
                self.failed.discard(pid)
            except OSError as exc:
                self.failed.add(pid)
                self.say(f"pid {pid} could not be confined: {exc.strerror or exc}")
        return self.runs.get(pid)

    # -- its rule ---------------------------------------------------------------------------
    def rule(self, devices: Iterable[str]) -> Rule:
        owned = []
        for uuid in devices:
            ids = self.ids.get(uuid)
            if ids is None:
                found = node_ids(uuid)
                if found is None:
                    continue  # gone: nothing of it to open
                ids = self.ids[uuid] = found
            owned.append(ids)
        return drivernodes.rule(owned, self.proc)

    def allow(self, pid: int, devices: Iterable[str]) -> bool:
        """PID's cgroup opens exactly DEVICES' nodes (all it holds, or is about to be sent).
        False where it could not be done (its grant must not be sent); with nothing left to
        hold, its cgroup goes once empty."""
        devices = list(devices)
        if pid not in self.entering and pid not in self.runs and pid not in self.failed:
            return True  # never entered: a Slurm job's (Slurm's cgroup), or one from before runs = true
        path = self._settled(pid)
        if path is None:
            return not devices
        rule = self.rule(devices)
        if rule != self.rules.get(pid):
            try:
                self.mech.confine(path, rule, self.rules.get(pid))
            except OSError as exc:
                self.say(f"the cgroup of pid {pid} could not be set to {','.join(devices) or 'no GPU'}: "
                         f"{exc.strerror or exc}")
                self.rules.pop(pid, None)  # written in part: written whole next time
                return False
            self.rules[pid] = rule
        if devices and pid in self.bases:
            # The next run there gets a cgroup made ahead: made now, as this one's grant goes
            # out, not at its entry, where the worker's writes competed with its decision.
            self.worker.submit(self._spare, self.bases.pop(pid))
        if devices:
            self.ended.discard(pid)
        else:
            self.ended.add(pid)
        self.sweep()
        return True

    def sweep(self) -> None:
        """Remove the cgroups of runs that hold nothing and have no process left."""
        while not self.orphans_gone.empty():
            pid, path = self.orphans_gone.get()
            if self.runs.get(pid) == path:  # not a new process's of that number since
                del self.runs[pid]
                self.rules.pop(pid, None)
                self.ended.discard(pid)
        for pid in list(self.ended):
            path = self.runs.get(pid)
            try:
                gone = path is None or self.mech.remove(path)
            except OSError as exc:
                self.say(f"the cgroup {path} could not be removed: {exc.strerror or exc}")
                gone = True  # not tried again and again
            if gone:
                self.ended.discard(pid)
                self.runs.pop(pid, None)
                self.rules.pop(pid, None)
        # Still a process in them (most often the run itself, exiting: its lease's close comes
        # before its exit): removed once empty off the loop, or an idle service keeps them.
        left = {pid: self.runs[pid] for pid in self.ended if pid in self.runs}
        if left:
            self._await_empty(left)

    def close(self) -> None:
        """The service stops: its spares go, and so does each cgroup the emptier waited on that
        is empty by now (its next poll would have come too late: the emptier dies with the
        service); a run's cgroup with a process in it stays with its run."""
        self.worker.shutdown(wait=True)
        with self.emptying_lock:
            waited = list(self.emptying)
        for path in list(self.spares.values()) + waited:
            try:
                self.mech.remove(path)
            except OSError:
                pass  # the next start's reconcile removes it
        self.spares.clear()

    # -- a restart --------------------------------------------------------------------------
    def reconcile(self, held: Mapping[int, Iterable[str]], followed: Iterable[int] = ()) -> None:
        """After a restart: each run cgroup is set to what the processes in it hold (HELD: pid
        -> devices, from the lock table and the grants adopted); one whose processes hold
        nothing (a run that ended while no service watched, a spare) is narrowed to nothing
        and removed once empty. A holder no adopted grant follows (FOLLOWED: their clients'
        pids; one granted just before a crash, before the ledger's state had it) keeps its
        devices, and its cgroup goes once empty, at a later sweep. Another install's run
        cgroups (another service's, on the same host) are not this one's to touch."""
        followed = set(followed)
        unfollowed: Dict[int, str] = {}  # found holding, followed by no grant: goes once empty
        root = self.mech.roots[0]
        found = ["/" + os.path.relpath(os.path.join(where, name), root) for where, dirs, _files in os.walk(root)
                 for name in dirs if name.startswith(self.prefix)]
        for n, path in enumerate(found):
            inside = set(self.mech.pids(path))
            holders = [pid for pid in held if pid in inside]
            owner = holders[0] if holders else -1 - n  # negative: nobody in it holds a device
            self.runs[owner] = path
            self.allow(owner, sorted({u for pid in holders for u in held[pid]}))
            # Nobody in it holds a device (a spare the last service made ahead, a run that
            # ended meanwhile), or its holders no grant follows: it goes once empty. No exit
            # or close of theirs reaches the loop, so nothing else would remove it.
            if not holders or owner not in followed:
                unfollowed[owner] = path
        if unfollowed:
            self._await_empty(unfollowed)

    def _await_empty(self, left: Mapping[int, str]) -> None:
        """Remove each cgroup of LEFT (pid -> path) once no process is in it: a restart's whose
        holders no grant follows (no exit or close of theirs reaches the loop), and runs ended
        with a process still in their cgroup (nothing may come to the loop after it). A cgroup
        with a process cannot be removed, so its pid, gone, can get no grant meanwhile."""
        with self.emptying_lock:
            self.emptying.update({path: pid for pid, path in left.items()})
            if self.emptier is None:
                self.emptier = threading.Thread(target=self._empty, daemon=True, name="cudawrap-confine-orphans")
                self.emptier.start()

    def _empty(self) -> None:
        """The emptier: a poll each ORPHAN_POLL_S while it has cgroups to remove, touching nothing
        of the loop's but the queue it reports to (sweep reads it)."""
        while True:
            time.sleep(ORPHAN_POLL_S)
            with self.emptying_lock:
                left = dict(self.emptying)
            for path, pid in left.items():
                try:
                    gone = self.mech.remove(path)
                except OSError:
                    gone = True
                if gone:
                    with self.emptying_lock:
                        del self.emptying[path]
                    self.orphans_gone.put((pid, path))
            with self.emptying_lock:
                if not self.emptying:
                    self.emptier = None
                    return


def kill_run_of(pid: int, ticks: int) -> bool:
    """End every process of the run cgroup PID is in (a run's leftovers: its lease has ended),
    through the cgroup (cgroup.kill, or the freezer and a kill of each): its children and
    daemons too, none of them guessed by pid. False where PID (started at TICKS) is in no run
    cgroup of cudawrap's, or is another process now."""
    try:
        found = cgroup.mounts()
        where = cgroup.current(pid)
    except OSError:
        return False
    if start_time(pid) != ticks:
        return False  # the pid was reused
    mechanisms = []
    if "devices" in found and "freezer" in found:
        mechanisms.append(("devices", cgroup.V1(found["devices"], found["freezer"])))
    if "unified" in found:
        mechanisms.append(("unified", cgroup.V2(found["unified"])))
    for name, mech in mechanisms:
        path = where.get(name, "")
        if os.path.basename(path).startswith(RUN_PREFIX):
            try:
                mech.kill(path)
            except OSError as exc:
                log.warning("the leftovers in %s could not be ended through it: %s", path, exc)
                return False
            return True
    return False


def for_install(config: Mapping[str, object], root: str, say: Callable[[str], None]) -> Optional[RunCgroups]:
    """The service's run cgroups under CONFIG's [confine] (the install at ROOT's); None with
    runs = false. A host that cannot confine refuses the service's start, in one line."""
    if not config["runs"]:
        return None
    try:
        mech = cgroup.usable(str(config["cgroup"]))
    except OSError as exc:
        raise SetupError(f"[confine] runs = true, but runs cannot be confined here: {exc.strerror or exc}",
                         hint="`cudawrap doctor` says what is missing; or set [confine] runs = false") from None
    return RunCgroups(mech, str(config["proc"]), install_tag(root), say)
