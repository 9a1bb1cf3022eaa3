"""[confine] runs = true: each run the service grants is in a cgroup of its own, which lets it
open its own GPUs' and MIG instances' nodes and no other GPU's (docs/admin/confinement.md).

A run's cgroup, from its request to its end (the service's loop calls; base/cgroup.py does):
- at its request (``enter``), before any decision: the client process is moved into a
  cgroup refusing every GPU: at once, or on a worker thread while the decision is made where
  this kernel's moves can wait for an RCU grace period (mover.py). The cgroup was made and
  confined ahead (a spare, one per place runs go, made on the worker as the last run there
  got its grant): on v1 a rule is 254 writes, ~2 ms, past a run's decision;
- before its grant is sent (``allow``): the rule widened to the devices it will then hold;
- a grant voided or not taken, or ended (``allow`` again, with what is left): narrowed before
  anything else happens.

Which cgroups of this install exist is decided in one place (``_tidy``): those of the runs
that hold devices or wait for their decision, and the spares; any other goes now if no
process is in it, else as soon as the last one is gone. "Gone" is the kernel's word, not a
poll: a cgroup cannot be removed while a process is in it (EBUSY), so a pidfd of each process
in it is watched (``fileno``, in the service's loop), and when one exits the removal is tried
again (``emptied``). It is applied at the service's start (``reconcile``: every run cgroup of
this install on the host, after a restart), at each run's end, and at its stop (``close``:
every one with no process in it is removed before it returns; one with a process stays with
its run, and the next start's reconcile sees to it).

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

import errno
import hashlib
import itertools
import logging
import os
import select
from concurrent.futures import Future
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from ..base import cgroup
from ..base.devrule import Rule
from ..devices import drivernodes
from ..devices.nvml import node_ids
from ..errors import SetupError
from .mover import Mover

log = logging.getLogger(__name__)

RUN_PREFIX = "cudawrap-run-"
WATCHED_MAX = 64  # pidfds watched at once per cgroup: any one's exit tries the removal again


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
        self.runs: Dict[int, str] = {}  # client pid -> its cgroup, until that goes
        self.wanted: Set[int] = set()  # pids of RUNS (or entering) that hold devices or wait for their decision
        self.rules: Dict[str, Rule] = {}  # cgroup -> the rule applied there last
        self.entering: Dict[int, "Future[Tuple[str, str, Rule]]"] = {}
        self.failed: Set[int] = set()  # entered, not confined: refused its grants
        # Written where the moves are made (the worker, or the loop: mover.py), each step whole:
        self.spares: Dict[str, Tuple[str, Rule]] = {}  # where runs go -> a cgroup made and confined ahead, its rule
        self.driver: Optional[drivernodes.Published] = None  # read by the worker, at each cgroup made
        self.bases: Dict[int, str] = {}  # client pid -> where its run cgroup went
        self.origins: Dict[int, str] = {}  # client pid -> the cgroup it was in before its own
        self.opened: Set[int] = set()  # pids of RUNS whose cgroup opened a device once (a grant went out)
        self.made = itertools.count(1)  # (next() is one step: the loop and the worker both make cgroups)
        # A cgroup no longer wanted with processes in it -> {pid: pidfd} of those watched.
        self.leaving: Dict[str, Dict[int, int]] = {}
        self.watched: Dict[int, str] = {}  # pidfd -> its cgroup in LEAVING
        self.exits = select.epoll()
        self.mover = Mover()  # the run's move: at once, or on its worker (mover.py)
        self.worker = self.mover.worker  # spares are made there

    # -- the run's cgroup -------------------------------------------------------------------
    def enter(self, pid: int, uid: int) -> None:
        """Move PID into a cgroup of its own refusing every GPU, on the worker (see the module)."""
        if pid in self.runs and pid not in self.wanted:
            # Its run ended, its cgroup waiting for its leftovers: a new process of that
            # number, or the same one asking again. Either way a cgroup of its own.
            del self.runs[pid]
            self.opened.discard(pid)
        if pid not in self.runs and pid not in self.entering:
            self.wanted.add(pid)
            self.entering[pid] = self.mover.submit(self._enter, pid, uid)

    def _enter(self, pid: int, uid: int) -> Tuple[str, str, Rule]:
        """(its cgroup, the one it was in, the rule its cgroup holds)."""
        here = self.mech.parent_of(pid)
        base = self._base(here, uid)
        path, held = self.spares.pop(base, None) or self._make(base)
        try:
            self.mover.move(lambda: self.mech.move(path, pid))
            # A process exiting is not moved, yet its write succeeds (the kernel skips it), and
            # v1 names its cgroup "/" meanwhile: had it not been found here, its run cgroup and
            # the next one's spare would have gone to the top of the hierarchy.
            if self.mech.parent_of(pid) != path:
                raise cgroup.CgroupError(errno.ESRCH, f"process {pid} is exiting: it was not moved into {path}")
        except OSError:
            self.mech.remove(path)  # nobody in it
            raise
        self.bases[pid] = base
        return path, here, held

    def _make(self, base: str) -> Tuple[str, Rule]:
        """A new run cgroup below BASE refusing every GPU. Named by the install, the service's
        pid and a count, not the run's: a restart finds a run's cgroup from its pid's /proc entry."""
        while True:  # never one that exists: a service before this one may have had this pid
            name = f"{self.prefix}{os.getpid()}-{next(self.made)}"
            if not os.path.lexists(os.path.join(self.mech.roots[0], base.lstrip("/"), name)):
                break
        path = self.mech.make(base, name)
        # What the driver publishes, read here, ahead: the rule of a grant uses it, not a read
        # of /proc (~0.1 ms) while the grant waits; it holds while the service runs (published).
        self.driver = drivernodes.published(self.proc)
        held = self.rule(())
        try:
            self.mech.confine(path, held)
        except OSError:
            self.mech.remove(path)
            raise
        return path, held

    def _spare(self, base: str) -> None:
        if base not in self.spares:
            try:
                self.spares[base] = self._make(base)
            except OSError as exc:
                self.say(f"no cgroup could be made ahead below {base}: {exc.strerror or exc}")

    def _base(self, here: str, uid: int) -> str:
        """Where a run cgroup goes for a process of UID in HERE: there, or the nearest ancestor
        neither a run's nor writable by UID."""
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
                path, was, held = entering.result()
            except OSError as exc:
                self.failed.add(pid)
                self.wanted.discard(pid)
                self.say(f"pid {pid} could not be confined: {exc.strerror or exc}")
            else:
                self.runs[pid] = path
                self.rules[path] = held
                self.origins[pid] = was
                self.failed.discard(pid)
                if was in self.leaving:
                    self._tidy([was])  # it left its last run's cgroup: maybe empty now
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
        return drivernodes.rule(owned, self.proc, self.driver)

    def _set(self, path: str, devices: List[str]) -> bool:
        """PATH's rule opens exactly DEVICES' nodes; False where that could not be done."""
        rule = self.rule(devices)
        if rule != self.rules.get(path):
            try:
                self.mech.confine(path, rule, self.rules.get(path))
            except OSError as exc:
                self.say(f"the cgroup {path} could not be set to {','.join(devices) or 'no GPU'}: "
                         f"{exc.strerror or exc}")
                self.rules.pop(path, None)  # written in part: written whole next time
                return False
            self.rules[path] = rule
        return True

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
        if not devices and not self.mech.pids(path):  # nobody in it (its run ended): it goes
            self.wanted.discard(pid)                  # unwritten, ~0.2 ms sooner to a next run
            self._tidy([path])
            return True
        if not self._set(path, devices):
            return False
        if devices:
            self.wanted.add(pid)
            self.opened.add(pid)
            self._unwatch(path)  # wanted again (a client granted after a void grant)
            base = self.bases.pop(pid, None)
            if base is not None:
                # The next run there gets a cgroup made ahead: made now, as this one's grant
                # goes out, not at its entry, where the worker's writes competed with its decision.
                self.worker.submit(self._spare, base)
        else:
            self.wanted.discard(pid)
            self._tidy([path])
        return True

    def forget(self, pid: int) -> None:
        """PID's connection is closed: a refusal of its entry ends with it (the pid may come
        back as another process, a Slurm job's client that never enters, which must not
        inherit it; the same process asking again enters anew)."""
        self.failed.discard(pid)

    # -- which cgroups exist ----------------------------------------------------------------
    def _tidy(self, paths: Iterable[str]) -> None:
        """The one place where this install's run cgroups go: each of PATHS that is neither
        a run's that holds devices or waits for its decision, nor a spare, is removed now if
        no process is in it, else once the last one has exited (its pidfd, ``emptied``)."""
        keep = {self.runs[pid] for pid in self.wanted if pid in self.runs}
        keep.update(path for path, _held in list(self.spares.values()))
        unwatched = {path for path, watching in self.leaving.items() if not watching}  # see _remove
        for path in (set(paths) | unwatched) - keep:
            self._remove(path)

    def _remove(self, path: str) -> None:
        watching = self.leaving.setdefault(path, {})
        for _ in range(100):  # each turn, a process seen in it exited before its pidfd was open
            try:
                if self.mech.remove(path):
                    self._gone(path)
                    return
            except OSError as exc:
                self.say(f"the cgroup {path} could not be removed: {exc.strerror or exc}")
                self._gone(path)  # not tried again and again
                return
            for pid in self.mech.pids(path):
                if pid in watching or len(watching) >= WATCHED_MAX:
                    continue
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue  # exited meanwhile
                except OSError as exc:  # out of descriptors: tried again at the next tidy, or the stop
                    self.say(f"the cgroup {path} cannot be watched until empty: {exc.strerror or exc}")
                    return
                watching[pid] = fd
                self.watched[fd] = path
                self.exits.register(fd, select.EPOLLIN)
            if watching:
                return
        self.say(f"the cgroup {path} cannot be watched until empty: its processes keep exiting and forking")

    def _gone(self, path: str) -> None:
        self._unwatch(path)
        self.rules.pop(path, None)
        for pid in [p for p, where in self.runs.items() if where == path]:
            del self.runs[pid]

    def _unwatch(self, path: str) -> None:
        for fd in self.leaving.pop(path, {}).values():
            self._forget(fd)

    def _forget(self, fd: int) -> None:
        del self.watched[fd]
        self.exits.unregister(fd)
        os.close(fd)

    def fileno(self) -> int:
        """Readable when a process in a cgroup waiting to go has exited: then ``emptied``."""
        return self.exits.fileno()

    def emptied(self) -> None:
        """Each cgroup one of whose processes exited is removed, if empty now, else waits on."""
        paths = set()
        for fd, _mask in self.exits.poll(0):
            path = self.watched[fd]
            watching = self.leaving[path]
            del watching[next(pid for pid, f in watching.items() if f == fd)]
            self._forget(fd)
            paths.add(path)
        self._tidy(paths)

    def _found(self) -> List[str]:
        """Every run cgroup of this install on the host (not another install's)."""
        root = self.mech.roots[0]
        return ["/" + os.path.relpath(os.path.join(where, name), root) for where, dirs, _files in os.walk(root)
                for name in dirs if name.startswith(self.prefix)]

    def close(self) -> None:
        """The service stops: every run cgroup of this install with no process in it is
        removed, now (spares, a run's whose last process just exited); one with a process
        stays with its run (it goes on confined), for the next start's reconcile."""
        self.worker.shutdown(wait=True, cancel_futures=True)  # no spare made once stopping
        self._let_out_waiters()
        for path in self._found():
            try:
                self.mech.remove(path)
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    self.say(f"the cgroup {path} could not be removed: {exc.strerror or exc}")
        for fd in list(self.watched):
            self._forget(fd)
        self.leaving.clear()
        self.spares.clear()
        self.exits.close()

    def _let_out_waiters(self) -> None:
        """At the stop, each client that never got a grant (its cgroup opens no GPU: it waits,
        or its connection was just dropped by the stop) goes back to the cgroup it came from:
        one that runs on without the service (root deciding for itself, or a run that waits for
        the next service and enters anew) must not be left unable to open the GPU it then
        takes. A run that was granted stays confined, whatever it holds now."""
        for pid, entering in list(self.entering.items()):
            if entering.cancelled():  # never moved: the stop came first
                del self.entering[pid]
            else:
                self._settled(pid)
        for pid, path in self.runs.items():
            origin = self.origins.get(pid)
            if origin is None or pid in self.opened or pid not in self.mech.pids(path):
                continue
            try:
                self.mech.move(origin, pid)
            except OSError:
                pass  # gone, or its old cgroup with it: nothing to give back

    # -- a restart --------------------------------------------------------------------------
    def reconcile(self, held: Mapping[int, Iterable[str]], followed: Iterable[int] = ()) -> None:
        """At the start: each run cgroup of this install is set to what the processes in it
        hold (HELD: pid -> devices, from the lock table and the grants adopted), and kept
        while they do if a grant followed from now on holds it (FOLLOWED: their clients'
        pids). Any other goes now if empty, else once its last process exits: one in which
        nobody holds a device (a spare the last service made ahead, a run that ended while no
        service watched) narrowed to nothing first; one whose holders no grant follows (one
        granted just before a crash, before the ledger's state had it) keeping its devices,
        as no exit or close of theirs reaches the loop. Another install's run cgroups
        (another service's, on the same host) are not this one's to touch."""
        followed = set(followed)
        found = self._found()
        for n, path in enumerate(found):
            inside = set(self.mech.pids(path))
            holders = [pid for pid in held if pid in inside]
            owner = holders[0] if holders else -1 - n  # negative: nobody in it holds a device
            self.runs[owner] = path
            if owner in followed:
                self.wanted.add(owner)
            self._set(path, sorted({u for pid in holders for u in held[pid]}))
        self._tidy(found)


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
