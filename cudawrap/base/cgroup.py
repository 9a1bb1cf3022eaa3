"""A run's own cgroup: make it, confine it to a device rule, move a process in, kill, remove.

Follows Documentation/admin-guide/cgroup-v2.rst and cgroup-v1/{cgroups,devices,freezer-subsystem}.rst.
Two mechanisms with one surface (``V2``, ``V1``), chosen by ``choose``:
- v2: one directory in the unified hierarchy, its device filter a BPF program (bpfdev), its
  processes ended by ``cgroup.kill`` (5.14), or frozen (``cgroup.freeze``, 5.2) and killed.
- v1: a directory of the same name in the devices and the freezer hierarchies, its filter
  the devices controller's lists (devcgroup_v1), its processes frozen and killed.

A run's cgroup is made below the cgroup its process is in now (``current``), so that every
refusal an ancestor makes still applies (v1 copies it, v2 runs it with BPF_F_ALLOW_MULTI) and
the run stays under whatever resource controls hold there. Writing a pid into cgroup.procs
moves the whole process, and every child it makes afterwards starts there: fork, setsid,
double-fork and exec do not leave a cgroup; only a write into another cgroup.procs does, which
needs write access to both cgroups (root's, here).
"""
from __future__ import annotations

import errno
import os
import re
import signal
import time
import threading
from collections import Counter, OrderedDict
from typing import Dict, List, Optional, Tuple

from . import bpfdev, devcgroup_v1
from .devcgroup_v1 import write
from .devrule import Rule

MOUNTINFO = "/proc/self/mountinfo"
_FROZEN_WAIT_S = 2.0
BPF_KERNEL = (4, 15)  # BPF_PROG_TYPE_CGROUP_DEVICE
KILL_KERNEL = (5, 14)  # cgroup.kill


class CgroupError(OSError):
    """A cgroup could not be made, confined, entered, emptied or removed; says which and why."""


def mounts(mountinfo: str = MOUNTINFO) -> Dict[str, str]:
    """Where each hierarchy is mounted: "unified" for cgroup2, else each v1 controller's name
    ("devices", "freezer", ...). The first mount of each wins (bind mounts repeat them)."""
    found: Dict[str, str] = {}
    with open(mountinfo) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(fields) < 5 or len(rest) < 3:
                continue
            point = fields[4].replace("\\040", " ")
            if rest[0] == "cgroup2":
                found.setdefault("unified", point)
            elif rest[0] == "cgroup":
                for opt in rest[2].split(","):
                    if opt not in ("rw", "ro"):  # the super options name the controllers, and rw/ro
                        found.setdefault(opt, point)
    return found


def favors_dynmods(mountinfo: str = MOUNTINFO) -> bool:
    """Whether a cgroup hierarchy is mounted with favordynmods (6.0+): then a move into a
    cgroup does not wait for an RCU grace period (the option holds for every hierarchy)."""
    with open(mountinfo) as f:
        return any(" - cgroup" in line and "favordynmods" in line.partition(" - ")[2].split()[-1].split(",")
                   for line in f)


def current(pid: int) -> Dict[str, str]:
    """The cgroup PID is in, per hierarchy: "unified" -> its v2 path, each v1 controller -> its path."""
    out: Dict[str, str] = {}
    for line in _read(f"/proc/{pid}/cgroup").splitlines():
        hier, controllers, path = line.split(":", 2)
        if hier == "0" and not controllers:
            out["unified"] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def _read(path: str) -> str:
    """The file at PATH, by descriptor: a run's entry reads two of these while its grant waits,
    and a text file object costs more than the read (~20 us)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return b"".join(iter(lambda: os.read(fd, 1 << 16), b"")).decode("utf-8", "surrogateescape")
    finally:
        os.close(fd)


def _pids(directory: str) -> List[int]:
    try:
        return [int(p) for p in _read(os.path.join(directory, "cgroup.procs")).split()]
    except FileNotFoundError:
        return []
    except OSError as exc:
        # A cgroup removed between the open and the read (its last process gone, the
        # service removing it once empty) reads ENODEV: it holds nobody, as one never made.
        if exc.errno == errno.ENODEV:
            return []
        raise


def _mkdir(path: str) -> None:
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        pass
    except OSError as e:
        raise CgroupError(e.errno, f"cannot make cgroup {path}: {e.strerror}") from None


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno == errno.EBUSY:
            return False
        raise CgroupError(e.errno, f"cannot remove cgroup {path}: {e.strerror}") from None
    return True


def _move(directory: str, pid: int) -> None:
    try:
        write(os.path.join(directory, "cgroup.procs"), str(pid))
    except OSError as e:
        if e.errno == errno.ESRCH:
            raise CgroupError(e.errno, f"process {pid} is gone: it was not moved into {directory}") from None
        raise CgroupError(e.errno, f"cannot move process {pid} into {directory}: {e.strerror}") from None


def _kill_frozen(directory: str, state: Tuple[str, str, str], seen: Tuple[str, str]) -> List[int]:
    """Freeze DIRECTORY (so nothing in it forks meanwhile), SIGKILL each process, thaw: what
    the v1 freezer allows, and v2 before cgroup.kill. STATE is (file, frozen, thawed) to write,
    SEEN (file, text) says the freeze is done. Returns the pids signalled."""
    state_file, frozen, thawed = state
    write(state_file, frozen)
    try:
        deadline = time.monotonic() + _FROZEN_WAIT_S
        while seen[1] not in _read(seen[0]):
            if time.monotonic() > deadline:
                break  # kill what is there; a task still forking is killed on the next call
            time.sleep(0.001)
        pids = _pids(directory)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids
    finally:
        write(state_file, thawed)


class V2:
    """A run's cgroup in the unified hierarchy at MOUNT. Paths are the hierarchy's own (as
    /proc/PID/cgroup writes them: "/" is its root), as in V1."""

    name = "v2"
    KEPT = 256  # loaded programs kept (a rule per set of devices granted; a fd each)

    def __init__(self, mount: str) -> None:
        self.mount = mount
        self.roots = (mount,)
        # Each rule's program, loaded once: a load runs the verifier (~0.2 ms of a grant's wait).
        # The service's loop and its worker both confine: a program in use is never closed.
        self.programs: "OrderedDict[Rule, bpfdev.Program]" = OrderedDict()
        self.using: "Counter[Rule]" = Counter()
        self.lock = threading.Lock()

    def _abs(self, path: str) -> str:
        return os.path.join(self.mount, path.lstrip("/"))

    def parent_of(self, pid: int) -> str:
        return current(pid)["unified"]

    def make(self, parent: str, name: str) -> str:
        path = os.path.join(parent, name)
        _mkdir(self._abs(path))
        return path

    def confine(self, path: str, rule: Rule, before: Optional[Rule] = None) -> None:
        """BEFORE: the rule this object last applied to PATH, if known: its program is replaced
        by descriptor (bpfdev.replace), else every program there is (bpfdev.confine)."""
        held = [r for r in (before, rule) if r is not None]
        try:
            old, new = self._take(before, load=False), self._take(rule, load=True)
            if old is not None and old != new:
                try:
                    bpfdev.replace(self._abs(path), new, old)
                    return
                except bpfdev.BpfError:
                    pass  # not as this object left it (EEXIST, ENOENT): confined whole
            bpfdev.confine(self.mount, self._abs(path), rule, new)
        except OSError as e:
            raise CgroupError(e.errno, str(e.strerror or e)) from None
        finally:
            self._done(held)

    def _take(self, rule: Optional[Rule], load: bool) -> Optional[bpfdev.Program]:
        """RULE's program, marked in use; loaded here if it is not kept and LOAD, else None."""
        if rule is None:
            return None
        with self.lock:
            self.using[rule] += 1
            program = self.programs.get(rule)
            if program is not None:
                self.programs.move_to_end(rule)
        if program is None and load:
            program = bpfdev.loaded(rule)  # outside the lock: the verifier takes its time
            with self.lock:
                kept = self.programs.setdefault(rule, program)
            if kept is not program:  # the other thread loaded it meanwhile
                os.close(program.fd)
                program = kept
        return program

    def _done(self, rules: List[Rule]) -> None:
        with self.lock:
            for rule in rules:
                self.using[rule] -= 1
                if not self.using[rule]:
                    del self.using[rule]
            if len(self.programs) > self.KEPT:  # a grant's own confine looks no further
                idle = [r for r in self.programs if r not in self.using]
                for rule in idle[:len(self.programs) - self.KEPT]:
                    os.close(self.programs.pop(rule).fd)  # oldest first; attached, it lives on in the kernel

    def move(self, path: str, pid: int) -> None:
        _move(self._abs(path), pid)

    def pids(self, path: str) -> List[int]:
        return _pids(self._abs(path))

    def kill(self, path: str) -> None:
        where = self._abs(path)
        kill_file = os.path.join(where, "cgroup.kill")
        if os.path.exists(kill_file):
            write(kill_file, "1")
        else:
            _kill_frozen(where, (os.path.join(where, "cgroup.freeze"), "1", "0"),
                         (os.path.join(where, "cgroup.events"), "frozen 1"))

    def remove(self, path: str) -> bool:
        """Remove PATH if no process is left in it; False if one is (EBUSY)."""
        return _rmdir(self._abs(path))


class V1:
    """A run's cgroup in the v1 devices and freezer hierarchies (same relative path in each)."""

    name = "v1"

    def __init__(self, devices: str, freezer: str) -> None:
        self.devices = devices
        self.freezer = freezer
        self.roots = (devices, freezer)

    def parent_of(self, pid: int) -> str:
        """The run's parent as a path relative to each hierarchy: the devices one, which confines."""
        return current(pid)["devices"]

    def _both(self, path: str) -> Tuple[str, str]:
        rel = path.lstrip("/")
        return os.path.join(self.devices, rel), os.path.join(self.freezer, rel)

    def make(self, parent: str, name: str) -> str:
        path = os.path.join(parent, name)
        for d in self._both(path):
            _mkdir(d)
        return path

    def confine(self, path: str, rule: Rule, before: Optional[Rule] = None) -> None:
        """BEFORE: the rule last applied to PATH, if known: only what differs is written."""
        try:
            devcgroup_v1.apply(self._both(path)[0], rule, before)
        except OSError as e:
            raise CgroupError(e.errno, str(e.strerror or e)) from None

    def move(self, path: str, pid: int) -> None:
        devices, freezer = self._both(path)
        _move(devices, pid)  # the one that confines, first
        _move(freezer, pid)

    def pids(self, path: str) -> List[int]:
        return sorted(set(_pids(self._both(path)[0])) | set(_pids(self._both(path)[1])))

    def kill(self, path: str) -> None:
        freezer = self._both(path)[1]
        state = os.path.join(freezer, "freezer.state")
        _kill_frozen(freezer, (state, "FROZEN", "THAWED"), (state, "FROZEN"))

    def remove(self, path: str) -> bool:
        devices, freezer = self._both(path)
        return _rmdir(devices) & _rmdir(freezer)


def kernel(release: Optional[str] = None) -> Tuple[int, int]:
    """(major, minor) of the running kernel ("6.18.44-fc" -> (6, 18)); (0, 0) if unreadable."""
    found = re.match(r"(\d+)\.(\d+)", release or os.uname().release)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def usable(setting: str) -> "V1 | V2":
    """The mechanism SETTING names here, checked to work before any run relies on it; else a
    CgroupError saying what is missing (a mount, the kernel's version, the BPF program)."""
    mech = choose(setting)
    try:  # the service removes a run's cgroup when its last process exits: it waits on their pidfds
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        raise CgroupError(errno.ENOSYS, f"kernel {os.uname().release} has no pidfd_open (from 5.3), with which the "
                                        f"service sees a run's last process exit") from None
    if isinstance(mech, V2):
        if kernel() < BPF_KERNEL:
            raise CgroupError(errno.ENOSYS, f"kernel {os.uname().release} has no cgroup v2 device programs "
                                            f"(BPF_PROG_TYPE_CGROUP_DEVICE, from 4.15)")
        try:
            os.close(bpfdev.load(Rule((), frozenset())))
        except OSError as e:
            raise CgroupError(e.errno, f"cannot load a cgroup v2 device program: {e.strerror}") from None
        # Runs' cgroups go below their own processes', each checked as it is made; what sits
        # above this process (the hierarchy's top among them) is above most of them.
        here = os.path.join(mech.mount, current(os.getpid()).get("unified", "/").lstrip("/"))
        problem = bpfdev.ancestors_problem(mech.mount, os.path.join(here, "run"))
        if problem:
            raise CgroupError(errno.EPERM, problem)
    return mech


def confinable(setting: str = "auto") -> bool:
    """Whether runs can be confined here (``usable``), for an install choosing its defaults."""
    try:
        usable(setting)
    except OSError:
        return False
    return True


def choose(setting: str, found: Optional[Dict[str, str]] = None) -> "V1 | V2":
    """The mechanism for SETTING ("auto", "v1", "v2") on this host. auto: what the host's init
    uses: v1 wherever the v1 devices controller is mounted (a legacy or hybrid host, where
    systemd and container runtimes confine with it), else v2."""
    found = mounts() if found is None else found
    v1_ok = "devices" in found and "freezer" in found
    if setting == "v1" or (setting == "auto" and v1_ok):
        if not v1_ok:
            missing = " and ".join(c for c in ("devices", "freezer") if c not in found)
            raise CgroupError(errno.ENOENT, f"no cgroup v1 {missing} controller is mounted")
        return V1(found["devices"], found["freezer"])
    if "unified" not in found:
        raise CgroupError(errno.ENOENT, "no cgroup v2 hierarchy is mounted")
    return V2(found["unified"])
