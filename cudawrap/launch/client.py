"""The service's client: ask `cudawrap serve` for devices and take the locks it hands over.

Used by the launch (the shim, `cudawrap run`, the Python API) when the service's socket
answers: from_service asks the general way (with the Slurm job's GPUs where the run is in
one); the commands ask their questions (status, cancel) through question(). The service
decides, opens the lease files read-only (and a share's slot file) and passes the
descriptors (SCM_RIGHTS); the lock is taken here, on the descriptor received, shared or
exclusive as the grant says (wire.py), so that the kernel's lock table names this process
and the lease lives exactly as long as this process and the children it hands the
descriptors to (kill -9 frees the device at once).

On the launch path: the C module ``_socket`` only (``socket`` builds its enums at import,
~5 ms), no ``json``, no ``re``; waiting is one blocking read of the socket, no CPU.
"""
from __future__ import annotations

import _socket
import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import locations as loc
from .. import say, wire
from ..errors import CudawrapError
from ..lease.files import Lease

# The variables a run's settings are read from (policy.effective), passed on as asks.
ASK_PREFIX = "CUDAWRAP_"
FILTER_ASKS = ("model", "min_memory_mib", "min_free_memory_mib", "max_utilization")


class Granted:
    """What the service granted: the lease (its locks held here) and the variables the run
    gets with it (a share's: MPS's, its memory's; the same as a run deciding for itself)."""

    __slots__ = ("lease", "extra", "defaults")

    def __init__(self, lease: Lease, extra: Dict[bytes, bytes], defaults: Optional[Dict[bytes, bytes]]) -> None:
        self.lease = lease
        self.extra = extra
        self.defaults = defaults


class ServiceGone(Exception):
    """The service closed the connection before answering (restarted, or stopped)."""


class ServiceError(CudawrapError):
    """What the service refused, with the exit status it named."""

    def __init__(self, message: str, hint: Optional[str], exit_code: int) -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code


def socket_path(root: str) -> str:
    return loc.under(root, loc.SERVICE_SOCKET)


def connect(root: str) -> Optional[Any]:
    """A connection to the service of the install at ROOT, or None when none answers."""
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    except OSError:
        return None
    try:
        sock.connect(socket_path(root))
    except OSError:  # no socket (no service), or refused (a service that died)
        sock.close()
        return None
    return sock


class Connection:
    """Messages (and the descriptors that came with them) on one connection."""

    def __init__(self, sock: Any, limit: int = wire.MAX_MESSAGE) -> None:
        self.sock = sock
        self.reader = wire.Reader(limit)
        self.pending: List[Tuple[str, Dict[str, str]]] = []
        self.fds: List[int] = []

    def send(self, verb: str, fields: Dict[str, str]) -> None:
        try:
            self.sock.sendall(wire.encode(verb, fields))
        except OSError:
            raise ServiceGone() from None

    def receive(self) -> Tuple[str, Dict[str, str]]:
        while not self.pending:
            try:
                data, ancillary, flags, _addr = self.sock.recvmsg(
                    wire.MAX_MESSAGE, _socket.CMSG_SPACE(wire.MAX_FDS * wire.FD_BYTES))
            except InterruptedError:
                continue
            except OSError:
                raise ServiceGone() from None
            self.fds += wire.received_fds(ancillary)
            if not data:
                raise ServiceGone()
            try:
                self.pending += self.reader.feed(data)
            except wire.WireError:
                raise ServiceGone() from None
        return self.pending.pop(0)

    def take_fds(self, n: int) -> Optional[List[int]]:
        """The next N descriptors received; None (all closed) if fewer came."""
        if len(self.fds) < n:
            self.drop_fds()
            return None
        taken, self.fds = self.fds[:n], self.fds[n:]
        return taken

    def drop_fds(self) -> None:
        for fd in self.fds:
            _close(fd)
        self.fds = []

    def close(self) -> None:
        self.drop_fds()
        self.sock.close()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def request_fields(value: Dict[str, Any], environ: Any, count: int) -> Dict[str, str]:
    """What a run asks of the service: the count, its wait, its narrowing and asks.

    Everything here can only narrow what the service's own reading of the policy gives
    (the service decides the program, its settings and limits from the kernel's word)."""
    fields = {"count": str(count), "wait": "inf" if value["wait"] == float("inf") else repr(float(value["wait"]))}
    if value.get("share"):
        fields["share"] = "1"
    for name, key in (("CUDA_VISIBLE_DEVICES", "visible"), ("CUDA_DEVICE_ORDER", "order")):
        raw = environ.get(name)
        if raw is not None:
            fields[key] = raw.replace("\0", "")
    from ..policy.effective import UNFILTERED

    for key in FILTER_ASKS:
        raw = value.get(key, UNFILTERED[key])
        if raw != UNFILTERED[key] and isinstance(raw, (int, str)) and not isinstance(raw, bool):
            fields[key] = str(raw)
    return fields


def _error(fields: Dict[str, str]) -> ServiceError:
    return ServiceError(fields.get("text") or "the cudawrap service refused the request",
                        fields.get("hint") or None, wire.exit_status(fields, os.EX_SOFTWARE))


def ask(root: str, fields: Dict[str, str], on_wait: Callable[[str], None]) -> Optional[Granted]:
    """Devices from the service for one run: what it Granted (the locks held here), or None
    when no service answers (the caller decides without it). ServiceError for a refusal."""
    return _attempt(root, fields, on_wait)[0]


def _attempt(root: str, fields: Dict[str, str], on_wait: Callable[[str], None]) -> Tuple[Optional[Granted], bool]:
    """ask()'s answer, and whether a service answered at all."""
    sock = connect(root)
    if sock is None:
        return None, False
    conn = Connection(sock)
    try:
        return _exchange(conn, fields, on_wait), True
    except ServiceGone:
        return None, True  # it went away before granting: the daemonless path decides
    finally:
        conn.close()


# Between tries to reach a service that is not answering (a restart takes ~0.5 s).
RETRY_GAP_S = 0.2
NOT_RUNNING = "the cudawrap service is not running"


def start_command(root: str) -> str:
    """How the service of the install at ROOT is started on this machine: by its systemd unit
    where install.sh enabled one (a system install where systemd runs, as install.sh decides),
    else `cudawrap serve --daemon` (with the root, for a --prefix install)."""
    system = root.rstrip("/") == ""
    if system and os.path.isdir("/run/systemd/system"):
        return "systemctl start cudawrap"
    if system:
        return "cudawrap serve --daemon"
    import shlex

    return f"CUDAWRAP_ROOT={shlex.quote(root)} cudawrap serve --daemon"


def start_it(root: str) -> str:
    """The hint of a run or status that found no service where it needs one."""
    return f"ask the administrator to start it ({start_command(root)})"


def ask_retrying(root: str, fields: Dict[str, str], on_wait: Callable[[str], None],
                    retry_s: float) -> Granted:
    """ask() where the run cannot decide for itself (the service is the install's arbiter): a service that
    does not answer, or goes away before granting (a restart), is tried again for RETRY_S;
    ServiceUnavailable (69) after that. A run that was waiting asks again with the ticket
    the service gave it (in FIELDS), which a restarted service honours with its place."""
    import time

    from ..errors import ServiceUnavailable

    deadline = time.monotonic() + retry_s
    told = False
    while True:
        began = time.monotonic()
        granted, answered = _attempt(root, fields, on_wait)
        if granted is not None:
            return granted
        if answered and time.monotonic() - began > 1.0:
            # It went away while we waited: the retry time counts from now (one that drops
            # every request at once is not running, and counts as that).
            deadline = time.monotonic() + retry_s
        elif time.monotonic() >= deadline:
            raise ServiceUnavailable(NOT_RUNNING, hint=start_it(root))
        if not told:
            on_wait(f"{NOT_RUNNING} (or restarting): trying again for up to {retry_s:g} s")
            told = True
        time.sleep(RETRY_GAP_S)


def _exchange(conn: Connection, fields: Dict[str, str], on_wait: Callable[[str], None]) -> Granted:
    conn.send(wire.REQUEST, fields)
    while True:
        verb, reply = conn.receive()
        if verb == wire.WAIT:
            ticket = reply.get("ticket")
            if ticket:
                # Echoed with the request should the service go away before granting
                # (ask_retrying): only the service can read it, and only this process use it.
                fields["ticket"] = ticket
            if reply.get("text"):
                on_wait(reply["text"])
        elif verb == wire.ERROR:
            raise _error(reply)
        elif verb == wire.GRANT:
            devices = reply.get("devices", "")
            described = wire.described(reply)
            fds = conn.take_fds(len(described)) if described is not None else None
            if fds is None:
                raise ServiceGone()
            locked = wire.lock_granted(fds, described)
            lease = Lease(*locked) if locked is not None else None
            if lease is None:  # taken past the service (a daemonless run): it decides again
                for fd in fds:
                    _close(fd)
                conn.send(wire.LOST, {"devices": devices})
                continue
            if reply.get("text"):
                on_wait(reply["text"])  # what it got after waiting
            defaults = wire.unpairs(reply["defaults"]) if "defaults" in reply else None
            granted = Granted(lease, wire.unpairs(reply.get("env", "")), defaults)
            try:
                conn.send(wire.HELD, {"devices": devices})
                # A whole device is held now: the service checks the lock itself. A share
                # waits for DONE: the service opens the device's MPS pipe
                # directory to this user then, before the program may connect to it.
                while lease.shared and conn.receive()[0] != wire.DONE:
                    pass
            except ServiceGone:
                pass  # the locks are ours: the kernel's word stands without the service
            return granted


def question(root: str, verb: str, fields: Dict[str, str]) -> Optional[Dict[str, str]]:
    """One question to the service (status, cancel) and its answer; None when no service
    answers. ServiceError for a refusal."""
    sock = connect(root)
    if sock is None:
        return None
    conn = Connection(sock, wire.MAX_ANSWER)
    try:
        conn.send(verb, fields)
        reply_verb, reply = conn.receive()
    except ServiceGone:
        return None
    finally:
        conn.close()
    if reply_verb == wire.ERROR:
        raise _error(reply)
    return reply


# ---- the general launch's way to the service ------------------------------------------------

def from_service(root: str, prog: str, value: Dict[str, Any], environ: Any, count: int, job: Any = None,
                  must: bool = False, ticket: str = "") -> Optional[Granted]:
    """Devices (or shares) granted by `cudawrap serve` (docs/admin/service.md), the
    locks held here (the launch makes them its Grant, as its own decision's); None
    when it does not answer, and the run decides for itself as without it. MUST: it cannot
    (the service is the install's arbiter): the service is tried again for connect_retry_s
    (a restart), then ServiceUnavailable."""

    def on_wait(text: str) -> None:
        say(prog, text)

    fields = request_fields(value, environ, count)
    if ticket:
        fields["ticket"] = ticket
    if job is not None:
        devices = _job_devices(job)
        if devices is not None:
            fields["visible"] = devices
    if not must:
        granted = ask(root, fields, on_wait)
    else:
        granted = ask_retrying(root, fields, on_wait, float(value.get("connect_retry_s", 10.0)))
    # The service writes the grant's audit line (and its ledger record) itself.
    return granted


def _job_devices(job: Any) -> Optional[str]:
    """The UUIDs of a Slurm job's GPUs, as the service is asked to narrow to them; None
    where Slurm's variables do not say (CUDA_VISIBLE_DEVICES narrows, as for any run).
    Slurm numbers GPUs in NVML's (PCI) order: NVML is read to name them."""
    from ..devices import nvml
    from ..devices.slurm import uuids_of

    inventory = nvml.inventory()
    visible = job.visible({g.index for g in inventory.gpus})
    if visible is None:
        return None
    wanted: List[int] = []
    for token in visible.split(","):
        if not token.strip().isdigit():
            break  # outside the job: the list ends there, as CUDA ends it
        wanted.append(int(token))
    # A device of no GPU in the job matches nothing: the service then refuses, one line.
    return ",".join(uuids_of(inventory.devices, wanted)) or "-"
