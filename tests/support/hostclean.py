"""The suite leaves the host clean: no cgroup of a test's, no /dev/nvidia* node of a test's.

The session runs in a cgroup of its own (``cudawrap-tests-PID``, in the v1 devices and freezer
hierarchies and in v2), made at its start by the process that starts the tests: under
pytest-xdist the controller, before it starts its workers, so that they and every process a
test starts are inside it. A run cgroup goes below the cgroup of the process it confines (or
the nearest ancestor its user cannot write: the session's is root's), and a test's own cgroups
go below the test's process: each one a test made, or a service a test started, is below the
session's. So the check needs no word from a worker and no guess of whose a cgroup is: at the
session's very end (``pytest_sessionfinish`` in the controller, after every worker has torn
down its fixtures), any cgroup left below the session's is a test's, left behind, and fails
the run; then its processes are killed and it is removed, and the session's with it. Other
sessions on the same host (another checkout's tests) are in cgroups of their own.

/dev/nvidia*: tests make nodes in /dev only where no NVIDIA driver is loaded (issue 52): there,
a node that was not there at the start is a test's. Wherever there is a driver, its own
nodes (nvidia-modprobe makes some on first use) may come: only a change of those that were
there at the start (mode, owner, ACL: "leased" not put back) counts.
"""
from __future__ import annotations

import errno
import glob
import os
from typing import Dict, List, Optional, Tuple

from cudawrap.base import cgroup
from cudawrap.base.nodemodes import snapshot

from .confine import empty, tree

_HIERARCHIES = ("devices", "freezer", "unified")
_NODES = ("/dev/nvidia*", "/dev/nvidia-caps/*")


class HostCheck:
    def __init__(self) -> None:
        self.name = f"cudawrap-tests-{os.getpid()}"
        self.places: List[Tuple[str, str, str]] = []  # (hierarchy, its mount, where this process was)
        self.nodes: Dict[str, Optional[dict]] = {}
        self.notes: List[str] = []
        self.left: List[str] = []  # what the end found

    # -- the start --------------------------------------------------------------------------
    def start(self) -> None:
        self.nodes = _nodes()
        if os.geteuid() != 0:
            return  # no cgroup can be made: and no test that makes one runs
        try:
            found = cgroup.mounts()
            here = cgroup.current(os.getpid())
        except OSError:
            return
        mounts = set()
        for hier in _HIERARCHIES:
            if hier not in found or hier not in here or found[hier] in mounts:
                continue
            mounts.add(found[hier])  # co-mounted controllers: one hierarchy
            _stale(os.path.join(found[hier], here[hier].lstrip("/")))
            session = os.path.join(found[hier], here[hier].lstrip("/"), self.name)
            try:
                os.mkdir(session, 0o755)
                _write(os.path.join(session, "cgroup.procs"), os.getpid())
            except OSError as exc:
                self.notes.append(f"no session cgroup in {found[hier]}: {exc} (its cgroups are not checked)")
                _rmdir(session)
                continue
            self.places.append((hier, found[hier], here[hier]))

    # -- the end ----------------------------------------------------------------------------
    def finish(self) -> None:
        """LEFT: what was left, a line each; everything of it removed but the nodes."""
        cgroups: Dict[str, List[str]] = {}  # below the session's -> the hierarchies it is in
        for hier, mount, was in self.places:
            session = os.path.join(mount, was.lstrip("/"), self.name)
            for path in tree(session)[:-1]:  # below it, deepest first
                rel = os.path.relpath(path, session)
                pids = cgroup._pids(path)
                cgroups.setdefault(rel, []).append(hier + (f" (processes {_commands(pids)})" if pids else ""))
                empty(path)
                if not _rmdir(path):
                    self.notes.append(f"{path} could not be removed")
            back = os.path.join(mount, was.lstrip("/"), "cgroup.procs")
            for pid in cgroup._pids(session):  # this process, and what is left of the workers
                try:
                    _write(back, pid)
                except OSError:
                    pass  # exited meanwhile
            if not _rmdir(session):
                self.notes.append(f"{session} could not be removed")
        left = [f"cgroup {rel} left by a test, in {', '.join(hiers)}" for rel, hiers in sorted(cgroups.items())]
        now = _nodes()
        driver = os.path.exists("/proc/driver/nvidia")
        for path, was in sorted(self.nodes.items()):
            if now.get(path, was) != was:
                left.append(f"{path} is not as it was at the start: {was} -> {now.get(path)}")
        if not driver:
            left += [f"{path} made by a test and left" for path in sorted(set(now) - set(self.nodes))]
        self.left = left


def _stale(where: str) -> None:
    """The empty cgroups of earlier sessions in WHERE that were killed before their end."""
    for name in os.listdir(where):
        pid = name[len("cudawrap-tests-"):]
        if name.startswith("cudawrap-tests-") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            for path in tree(os.path.join(where, name)):
                _rmdir(path)  # not if a process is in it: then it is not stale


def _nodes() -> Dict[str, Optional[dict]]:
    out: Dict[str, Optional[dict]] = {}
    for pattern in _NODES:
        for path in glob.glob(pattern):
            try:
                out[path] = snapshot(path)
            except OSError:
                pass
    return out


def _write(path: str, pid: int) -> None:
    with open(path, "w") as f:
        f.write(str(pid))


def _commands(pids: List[int]) -> str:
    out = []
    for pid in pids[:5]:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            out.append(f"{pid} ({command[:60]})")
        except OSError:
            out.append(str(pid))
    return ", ".join(out) + (" ..." if len(pids) > 5 else "")


def _rmdir(path: str) -> bool:
    try:
        os.rmdir(path)
    except OSError as exc:
        return exc.errno == errno.ENOENT
    return True
