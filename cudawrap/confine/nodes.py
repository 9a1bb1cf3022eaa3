"""[confine] nodes = "leased": no lease, no GPU (docs/admin/confinement.md).

Under "leased" the service makes each GPU node (/dev/nvidiaN, major 195 minors 0-253) and each
MIG instance's access capability (/dev/nvidia-caps/nvidia-capN, GI and CI access) root:root
0660 with a POSIX ACL entry for each user who holds a lease on that device through it now,
and for the accounts of [confine] allow_users (base/nodemodes.py does the files). nvidiactl,
nvidia-uvm, nvidia-modeset and the MIG config and monitor capabilities stay as the driver
made them: they let nobody use a GPU. Entries follow the grants (the loop's ``lessees``
calls, from service/grants.py): added before a grant is sent, removed when that user's last lease on
the device ends. Nodes that appear later (a driver loaded, MIG instances made, the setuid
nvidia-modprobe resetting a mode) are closed again by a thread watching the node directory
(inotify); it shares one lock with the loop's calls, never blocking on anything else.

What each node was before is kept in STATE (root's, in the state directory) before it is
first changed: "open" at the next start, `cudawrap sync` in an install that does not close
the nodes, and uninstall put each back exactly (``put_back``). A service killed with SIGKILL
leaves the nodes closed (no user opens a GPU while it is down); its next start closes any new
node and sets each ACL to the leases held then (``reconcile``).

Preconditions, or the service does not start: the driver must make its nodes 0660 root:root
(or leave them alone), else any user resets them through the setuid nvidia-modprobe, a race no
watch can close; and the node directory's filesystem must have ACLs. With no driver loaded
there are no parameters to read: it proceeds (doctor warns).
"""
from __future__ import annotations

import errno
import logging
import os
import pwd
import re
import select
import stat
import threading
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from ..base import nodemodes
from ..base.devrule import GPU_MAJOR, GPU_MINORS
from ..base.proc import exiting
from ..base.inotify import IN_CREATE, IN_ISDIR, IN_MOVED_TO, IN_Q_OVERFLOW, open_watch
from ..devices import drivernodes
from ..devices.nvml import node_ids
from ..errors import SetupError

log = logging.getLogger(__name__)

STATE_NAME = "nodes.saved"
PARAMS = "driver/nvidia/params"
IN_ATTRIB = 0x4
CAPS_DIR = "nvidia-caps"
_GPU_NODE = re.compile(r"nvidia(\d+)")
_CAP_NODE = re.compile(r"nvidia-cap(\d+)")
MODPROBE_LINE = "options nvidia NVreg_DeviceFileMode=0660 NVreg_DeviceFileUID=0 NVreg_DeviceFileGID=0"


def driver_params(proc: str) -> Optional[Dict[str, str]]:
    """PROC/driver/nvidia/params, NAME -> value; None where no driver is loaded."""
    try:
        with open(os.path.join(proc, PARAMS)) as f:
            return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in f) if _}
    except OSError:
        return None


def params_problem(params: Mapping[str, str]) -> Optional[str]:
    """Why the driver's node parameters let any user reopen closed nodes; None where they do not:
    nodes made 0660 root:root (DeviceFileMode is decimal there: 0660 reads 432), or not touched."""
    if params.get("ModifyDeviceFiles") == "0":
        return None
    try:
        mode, uid, gid = (int(params.get(k, "-1")) for k in ("DeviceFileMode", "DeviceFileUID", "DeviceFileGID"))
    except ValueError:
        mode, uid, gid = -1, -1, -1
    if mode == nodemodes.CLOSED_MODE and uid == 0 and gid == 0:
        return None
    shown = ", ".join(f"{k}={params[k]}" for k in ("DeviceFileMode", "DeviceFileUID", "DeviceFileGID",
                                                      "ModifyDeviceFiles") if k in params)
    return (f"the NVIDIA driver makes its nodes with {shown or 'no node parameters'}: any user can reset them "
            f"through the setuid nvidia-modprobe")


class LeasedNodes:
    def __init__(self, dev: str, proc: str, state: str, allowed: Iterable[int],
                 say: Callable[[str], None] = log.warning) -> None:
        self.dev = dev
        self.proc = proc
        self.state = state
        self.allowed = frozenset(allowed)
        self.say = say
        self.lock = threading.Lock()
        self.saved = nodemodes.load(state)  # a crash's record: the nodes as they were before it
        self.ids: Dict[str, drivernodes.NodeIds] = {}  # uuid -> its node numbers
        self.users: Dict[Tuple[int, int], Set[int]] = {}  # (major, minor) -> who holds it now
        self.applied: Dict[str, Tuple[int, ...]] = {}  # node path -> the uids its ACL names
        self.found: Optional[Dict[str, Tuple[int, int]]] = None  # nodes(), as last listed
        self.extra: Dict[int, Tuple[int, List[str]]] = {}  # a restart's holders no grant follows: pid -> (uid, uuids)
        self.stop_r, self.stop_w = os.pipe2(os.O_CLOEXEC)
        self.thread: Optional[threading.Thread] = None

    # -- the nodes --------------------------------------------------------------------------
    def nodes(self) -> Dict[str, Tuple[int, int]]:
        """path -> (major, minor) of each node closed: the GPU nodes and MIG access capabilities."""
        out: Dict[str, Tuple[int, int]] = {}
        for name in _names(self.dev):
            path = os.path.join(self.dev, name)
            rdev = _rdev(path) if _GPU_NODE.fullmatch(name) else None
            if rdev is not None and os.major(rdev) == GPU_MAJOR and GPU_MINORS[0] <= os.minor(rdev) <= GPU_MINORS[1]:
                out[path] = (GPU_MAJOR, os.minor(rdev))
        caps = drivernodes.char_major(drivernodes.CAPS_NAME, self.proc)
        if caps is not None:
            access = {m for name, m in drivernodes.mig_minors(self.proc).items() if name.endswith("/access")}
            where = os.path.join(self.dev, CAPS_DIR)
            for name in _names(where):
                path = os.path.join(where, name)
                rdev = _rdev(path) if _CAP_NODE.fullmatch(name) else None
                if rdev is not None and os.major(rdev) == caps and os.minor(rdev) in access:
                    out[path] = (caps, os.minor(rdev))
        return out

    def _numbers(self, uuid: str) -> List[Tuple[int, int]]:
        """The (major, minor) of UUID's own nodes: its GPU's and, for a MIG instance, its access capabilities."""
        ids = self.ids.get(uuid)
        if ids is None:
            found = node_ids(uuid)
            if found is None:
                return []  # gone: nothing of it to open
            ids = self.ids[uuid] = found
        out = [(GPU_MAJOR, ids[0])]
        names = drivernodes.own_caps(ids)
        if names:
            caps, table = drivernodes.char_major(drivernodes.CAPS_NAME, self.proc), drivernodes.mig_minors(self.proc)
            if caps is not None:
                out += [(caps, table[n]) for n in names if n in table]
        return out

    def _close_all(self, check: bool) -> None:
        """Every node closed to all but its users (under the lock). CHECK: each node read again
        (a watch's event, the start), not only those whose users changed since the last call."""
        if check or self.found is None:  # listed again only when the watch saw a change
            self.found = self.nodes()
        found = self.found
        fresh = [p for p in found if p not in self.saved]
        if fresh:  # recorded before the first change, synced: a crash right after finds it
            for path in fresh:
                was = nodemodes.snapshot(path)
                if was is not None:
                    self.saved[path] = was
            nodemodes.save(self.state, self.saved)
        for path, number in found.items():
            uids = tuple(sorted(self.users.get(number, set()) | self.allowed))
            if check or self.applied.get(path) != uids:
                if nodemodes.close(path, uids):
                    self.applied[path] = uids

    # -- what the loop calls ----------------------------------------------------------------
    def start(self) -> None:
        """Close every node now (SetupError where the filesystem has no ACLs), then watch for new ones."""
        try:
            nodemodes.read_acl(self.dev)
            with self.lock:
                self._close_all(check=True)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
                raise SetupError(f"[confine] nodes = \"leased\", but {self.dev} has no POSIX ACLs (its filesystem "
                                 f"does not support them): GPU nodes cannot be opened to lessees alone",
                                 hint="set [confine] nodes = \"open\"") from None
            raise SetupError(f"[confine] nodes = \"leased\": the GPU nodes in {self.dev} could not be closed: "
                             f"{exc.strerror or exc}", hint="`cudawrap doctor` checks the host") from None
        self.thread = threading.Thread(target=self._watch, daemon=True, name="cudawrap-nodes")
        self.thread.start()

    def lessees(self, holding: Mapping[str, Iterable[int]]) -> bool:
        """The nodes opened to who holds each device now (HOLDING: uuid -> uids, the grants'
        and any about to be sent); False where a node could not be set (its grant must not go)."""
        users: Dict[Tuple[int, int], Set[int]] = {}
        extra = {}
        for pid, (uid, uuids) in self.extra.items():
            if not exiting(pid):  # a zombie's /proc entry stands until it is reaped: gone all the same
                extra[pid] = (uid, uuids)
        self.extra = extra
        pairs = [(u, uid) for u, uids in holding.items() for uid in uids]
        pairs += [(u, uid) for uid, uuids in extra.values() for u in uuids]
        for uuid, uid in pairs:
            for number in self._numbers(uuid):
                users.setdefault(number, set()).add(uid)
        with self.lock:
            self.users = users
            try:
                self._close_all(check=False)
            except OSError as exc:
                self.say(f"the GPU nodes in {self.dev} could not be set to their lessees: {exc.strerror or exc}")
                self.applied.clear()  # each node written whole next time
                return False
        return True

    def reconcile(self, holding: Mapping[str, Iterable[int]], unfollowed: Mapping[int, Tuple[int, List[str]]]) -> None:
        """After a restart: the ACLs set to the leases held then (HOLDING, from the grants
        adopted); UNFOLLOWED (pid -> (uid, uuids): locks no adopted grant follows, granted just
        before a crash) keep theirs while their process lives."""
        self.extra = dict(unfollowed)
        self.lessees(holding)

    def close(self) -> None:
        """The service stops: the watch ends; the nodes stay closed (no lease, no GPU, while
        no service grants any), unless the config now says "open" (``put_back`` by the caller)."""
        os.write(self.stop_w, b"x")
        if self.thread is not None:
            self.thread.join(timeout=5)
        os.close(self.stop_r)
        os.close(self.stop_w)

    # -- the watch --------------------------------------------------------------------------
    def _watch(self) -> None:
        watch = open_watch()
        if watch is None:
            self.say(f"no inotify watch on {self.dev}: nodes made later stay as the driver makes them")
            return
        mask = IN_CREATE | IN_MOVED_TO | IN_ATTRIB
        watch.add(self.dev, mask)
        caps = os.path.join(self.dev, CAPS_DIR)
        watch.add(caps, mask)
        try:
            while True:
                ready, _, _ = select.select([watch.fileno(), self.stop_r], [], [])
                if self.stop_r in ready:
                    return
                events = watch.events()
                if any(name == CAPS_DIR and m & IN_ISDIR for _wd, m, name in events):
                    watch.add(caps, mask)  # made after we started: its nodes are made next
                if any(m & IN_Q_OVERFLOW or _ours(name) for _wd, m, name in events):
                    try:
                        with self.lock:
                            self._close_all(check=True)
                    except OSError as exc:
                        self.say(f"a new GPU node in {self.dev} could not be closed: {exc.strerror or exc}")
        finally:
            watch.close()


def _ours(name: str) -> bool:
    return bool(_GPU_NODE.fullmatch(name) or _CAP_NODE.fullmatch(name) or name == CAPS_DIR)


def _names(where: str) -> List[str]:
    try:
        return sorted(os.listdir(where))
    except OSError:
        return []


def _rdev(path: str) -> Optional[int]:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_rdev if stat.S_ISCHR(st.st_mode) else None


def state_file(state_dir: str) -> str:
    return os.path.join(state_dir, STATE_NAME)


def put_back(state_dir: str, say: Callable[[str], None] = log.warning) -> None:
    """Every node closed before put back as it was ("open", an install without the service,
    uninstall); a record that cannot be read is said, and left for another try."""
    try:
        count = nodemodes.put_back(state_file(state_dir))
    except (OSError, ValueError) as exc:
        say(f"the GPU nodes could not be put back as they were: {exc}")
        return
    if count:
        say(f"{count} GPU node(s) put back as they were before [confine] nodes = \"leased\"")


def _uid(name: str, say: Callable[[str], None]) -> Optional[int]:
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        say(f"[confine] allow_users: no account {name!r} here: skipped")
        return None


def for_install(config: Mapping[str, object], state_dir: str,
                say: Callable[[str], None] = log.warning) -> Optional[LeasedNodes]:
    """The service's closed nodes under CONFIG's [confine] nodes, started; None with "open"
    (nodes a service before closed are put back first). Its preconditions unmet: SetupError."""
    if config["nodes"] != "leased":
        put_back(state_dir, say)
        return None
    proc, dev = str(config["proc"]), str(config["dev"])
    params = driver_params(proc)
    problem = params_problem(params) if params is not None else None
    if problem is not None:
        raise SetupError(f"[confine] nodes = \"leased\", but {problem}",
                         hint=f"add the line `{MODPROBE_LINE}` to /etc/modprobe.d/nvidia.conf and reload "
                              f"the nvidia module (or reboot); or set [confine] nodes = \"open\"")
    try:
        st = os.stat(dev)
    except OSError as exc:
        raise SetupError(f"[confine] nodes = \"leased\", but {dev} cannot be read: {exc.strerror}") from None
    if st.st_uid != 0 or st.st_mode & 0o022:
        raise SetupError(f"[confine] nodes = \"leased\", but {dev} is not root's alone: its nodes could be "
                         f"swapped", hint=f"chown root {dev} && chmod go-w {dev}")
    allowed = [uid for uid in (_uid(n, say) for n in config["allow_users"]) if uid is not None]  # type: ignore[attr-defined]
    nodes = LeasedNodes(dev, proc, state_file(state_dir), allowed, say)
    nodes.start()
    return nodes
