"""`cudawrap serve`: the socket, its connections, and the decisions they wait for.

One thread, one poll loop: a connection costs a descriptor and a few hundred bytes, a waiting
client nothing (it blocks on its socket). A decision is made when something it depends on
changed (a request, a grant taken or void, a client gone, a lease file closed, the queue
directory changed) and at least every TICK_S while anyone waits (NVML has no events), never
more often than MIN_GAP_S; asking Slurm for a client's job's GPUs (it may block) runs on worker
threads (slurmjob.Lookups). Whatever a client sends, the worst it gets is one error line and
a closed connection; a user may keep at most max_connections connections open, and one that
does not send its request within HELLO_S is closed.
"""
from __future__ import annotations

import logging
import os
import selectors
import signal
import socket
import time
from typing import Dict, List, Optional, Tuple

from .. import locations as loc
from .. import wire
from .cancel import CANCELLED_EXIT
from ..errors import CudawrapError, SetupError
from ..sched.schedule import GRANTED, Verdict, Waiter
from ..users import user_name
from . import asks, peer, slurmjob
from .grants import Grants, Held
from .line import Line
from .slurmjob import JobCgroup, JobGpus

log = logging.getLogger(__name__)

TICK_S = 1.0
MIN_GAP_S = 0.002
HELLO_S = 5.0
ANSWER_S = 2.0
IDLE_SYNC_S = 0.05  # the ledger is made durable once nothing happened for this long
MAX_CONNECTIONS_PER_UID = 1000  # as many runs as one user may have in the queue directory
BACKLOG = 1024


class _Stop(Exception):
    """SIGTERM, SIGINT or SIGHUP: close the socket and leave."""


class Client:
    """One connection: who it is, what it asks, where it stands."""

    def __init__(self, sock: socket.socket, who: peer.Peer) -> None:
        self.sock = sock
        self.peer = who
        self.reader = wire.Reader()
        self.hello_by = time.monotonic() + HELLO_S
        self.ask: Optional[asks.Ask] = None
        self.resolving: Optional[Tuple[JobCgroup, Dict[str, str]]] = None  # its Slurm job's GPUs being asked
        self.arrival = ("", 0.0)
        self.waiter: Optional[Waiter] = None
        self.wait_until = float("inf")
        self.told = ""

    @property
    def fresh(self) -> bool:
        """Connected, and has asked nothing yet."""
        return self.ask is None and self.resolving is None

    def send(self, verb: str, fields: Dict[str, str]) -> bool:
        try:
            return self.sock.send(wire.encode(verb, fields)) > 0
        except OSError:  # full (a client that never reads) or gone: either way, done with it
            return False

    def answer(self, fields: Dict[str, str]) -> None:
        """Send an answer (it may be far larger than a socket buffer: status with 500
        waiters) whole, giving a client that does not read ANSWER_S at most."""
        try:
            data = wire.encode(wire.ANSWER, fields)
        except ValueError as exc:
            data = wire.encode(wire.ERROR, {"text": str(exc), "code": str(os.EX_SOFTWARE)})
        try:
            self.sock.settimeout(ANSWER_S)
            self.sock.sendall(data)
        except OSError:
            pass


class Service:
    def __init__(self, root: str, max_per_uid: int = MAX_CONNECTIONS_PER_UID, private_status: bool = False) -> None:
        self.root = root
        self.max_per_uid = max_per_uid
        self.private_status = private_status
        self.state_wd = self.share_wd = -2
        self.line = Line(root)
        from pathlib import Path

        from ..paths import Layout

        from ..install.runtime import enforced

        layout = Layout(Path(root))
        self.grants = Grants(self.line.leases, layout, enforced(layout), _say)  # say: MPS's ACLs
        self.clients: Dict[int, Client] = {}  # socket fd -> client
        self.selector = selectors.DefaultSelector()
        self.dirty = False
        self.last_decision = 0.0
        self.listener = self._listen()
        self.watch = self._watch()
        self.jobs = slurmjob.Lookups()  # Slurm is asked off the loop: it may block
        self.selector.register(self.jobs.fileno(), selectors.EVENT_READ, "slurm")
        self._adopt()

    # -- setting up -------------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        path = loc.under(self.root, loc.SERVICE_SOCKET)
        if not os.path.isdir(os.path.dirname(path)):
            from ..lease.files import SYNC_HINT

            raise SetupError(f"the runtime directory {os.path.dirname(path)} is missing", hint=SYNC_HINT)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
            raise SetupError(f"a service already answers on {path}",
                             hint="stop it first (systemctl stop cudawrap, or kill the pid in its pid file)")
        except OSError:
            pass  # nobody answers: a socket left by a service that died is replaced
        finally:
            probe.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f"{path}.{os.getpid()}.new"
        sock.bind(tmp)
        os.chmod(tmp, 0o666)  # every user connects; who they are comes from the kernel
        os.rename(tmp, path)
        sock.listen(BACKLOG)
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, "listen")
        self.path = path
        return sock

    def _watch(self) -> Optional[object]:
        from ..base import inotify

        watch = inotify.open_watch()
        if watch is None:
            return None  # decisions every TICK_S only
        watch.add(self.line.leases.dir, inotify.IN_CLOSE_WRITE | inotify.IN_CLOSE_NOWRITE
                  | inotify.IN_CREATE | inotify.IN_DELETE | inotify.IN_MOVED_TO)
        watch.add(self.line.queue.dir, inotify.IN_CREATE | inotify.IN_DELETE | inotify.IN_MOVED_TO)
        # A share's end is its slot file's close (its lease file's other sharers hold on).
        self.share_wd = watch.add(loc.under(self.root, loc.SHARE_DIR),
                                  inotify.IN_CLOSE_WRITE | inotify.IN_CLOSE_NOWRITE)
        # The admin's drains (state directory): a drain or resume is decided on at once.
        self.state_wd = watch.add(os.path.dirname(loc.under(self.root, loc.DRAINS)),
                                  inotify.IN_CLOSE_WRITE | inotify.IN_MOVED_TO | inotify.IN_DELETE)
        self.selector.register(watch.fileno(), selectors.EVENT_READ, "watch")
        return watch

    def _adopt(self) -> None:
        """Follow again the grants a service before us made that have not ended (a restart):
        their ends are recorded when they happen, not at some later look."""
        from . import ledger
        from . import accounts

        for record in accounts.still_open(self.grants.layout):
            pid = record["pid"]
            try:
                pidfd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                pidfd = -1
            alive = ledger.proc(pid)
            held = Held(record["uid"], pid, pidfd if pidfd >= 0 else os.open("/dev/null", os.O_RDONLY),
                        list(record["devices"]), record.get("program", ""), record["start"], lease_id=record["id"])
            if record.get("shared"):
                held.slots = self.grants.slots_held(pid, held.devices, self.line.acquirer.slots)
            self.grants.follow(held)
            if pidfd >= 0 and alive is not None and alive.ticks == record["ticks"]:
                self.selector.register(held.pidfd, selectors.EVENT_READ, held)
            else:  # its client is gone: ended now, or when the child holding it lets go
                held.exited = True
                self.grants.check(held)
        self.grants.restore_mps_access()

    def close(self) -> None:
        for client in list(self.clients.values()):
            self._drop(client)
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.listener.close()

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._stop)
        try:
            while True:
                self.step(self._timeout())
        except _Stop:
            pass
        finally:
            self.close()

    def _stop(self, signum: int, frame: object) -> None:
        raise _Stop()  # from inside the poll: it would otherwise sleep out its timeout first

    def _timeout(self) -> float:
        now = time.monotonic()
        times = [c.hello_by for c in self.clients.values() if c.fresh]
        times += [p.deadline for p in self.grants.pending.values()]
        if self._waiting():
            times.append(now + TICK_S)
            times += [c.wait_until for c in self._waiting()]
            if self.dirty:
                times.append(self.last_decision + MIN_GAP_S)
        return max(0.0, min(times) - now) if times else TICK_S * 30

    def step(self, timeout: float) -> None:
        from . import accounts

        ready = self.selector.select(min(timeout, IDLE_SYNC_S) if accounts.pending() else timeout)
        if not ready and accounts.pending():
            accounts.flush()  # idle: now the ledger's fsync costs nobody's launch
        for key, _mask in ready:
            if key.data == "listen":
                self._accept()
            elif key.data == "watch":
                self._events()
            elif key.data == "slurm":
                self._resolved()
            elif isinstance(key.data, Held):
                self._exited(key.data)
            else:
                self._readable(key.data)
        now = time.monotonic()
        for client in [c for c in self.clients.values() if c.fresh and c.hello_by <= now]:
            self._drop(client)  # connected and never asked: its slot goes to others
        for key in self.grants.expired(now):
            self.grants.void(key)
            self.dirty = True
        if self._waiting() and (self.dirty or now - self.last_decision >= TICK_S
                                or any(c.wait_until <= now for c in self._waiting())):
            if now - self.last_decision >= MIN_GAP_S:
                self._decide()

    def _waiting(self) -> List[Client]:
        return [c for c in self.clients.values() if c.waiter is not None]

    # -- connections ------------------------------------------------------------------------
    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the backlog waits
                log.warning("accept: %s", exc)
                return
            sock.setblocking(False)
            who = peer.identify(sock)
            if who is None:
                sock.close()
                continue
            mine = sum(1 for c in self.clients.values() if c.peer.uid == who.uid)
            client = Client(sock, who)
            if who.uid != 0 and mine >= self.max_per_uid:
                client.send(wire.ERROR, {"code": str(os.EX_TEMPFAIL),
                                         "text": f"you have {mine} connections to the cudawrap service open, "
                                                 f"the most one user may have",
                                         "hint": "wait for some of your runs to start"})
                sock.close()
                who.close()
                continue
            self.clients[sock.fileno()] = client
            self.selector.register(sock, selectors.EVENT_READ, client)

    def _drop(self, client: Client) -> None:
        if self.clients.pop(client.sock.fileno(), None) is None:
            return
        self.selector.unregister(client.sock)
        if client.waiter is not None:
            if client.waiter.key in self.grants.pending:
                self.grants.void(client.waiter.key)
            self.dirty = True
        client.sock.close()
        client.peer.close()

    def _fail(self, client: Client, code: int, text: str, hint: str = "") -> None:
        client.send(wire.ERROR, {"code": str(code), "text": text, **({"hint": hint} if hint else {})})
        self._drop(client)

    def _readable(self, client: Client) -> None:
        try:
            data = client.sock.recv(wire.MAX_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(client)
            return
        try:
            messages = client.reader.feed(data)
        except wire.WireError as exc:
            self._fail(client, os.EX_PROTOCOL, f"the cudawrap service: {exc}")
            return
        for verb, fields in messages:
            if client.sock.fileno() not in self.clients:
                return
            self._handle(client, verb, fields)

    def _handle(self, client: Client, verb: str, fields: Dict[str, str]) -> None:
        if verb == wire.REQUEST and client.fresh:
            self._request(client, fields)
        elif verb in (wire.STATUS, wire.CANCEL) and client.fresh:
            self._question(client, verb, fields)
        elif verb == wire.HELD and client.waiter is not None:
            self._held(client)
        elif verb == wire.LOST and client.waiter is not None:
            self.grants.void(client.waiter.key)
            self.dirty = True
        else:
            self._fail(client, os.EX_PROTOCOL, f"the cudawrap service: a {verb} message out of turn")

    def _request(self, client: Client, fields: Dict[str, str]) -> None:
        client.arrival = asks.arrival_key(client.peer.pid)  # its place in line: when it asked
        try:
            job = slurmjob.job_of(client.peer.pid)
        except CudawrapError as exc:
            self._fail(client, exc.exit_code, exc.message, exc.hint or "")
            return
        if not client.peer.alive():
            self._drop(client)  # its pid may be another's now: what /proc said is not the client's
            return
        known = self.jobs.get(job) if job is not None else None
        if job is not None and known is None:
            client.resolving = (job, fields)  # Slurm answers on a worker; others are served meanwhile
            return
        self._ask(client, fields, known)

    def _resolved(self) -> None:
        """Slurm answered for some jobs: their waiting requests go on, or fail with its error."""
        for job_id, outcome in self.jobs.ready():
            _say(str(outcome))  # "Slurm job 12: GPUs 0,1 here", or why Slurm could not say
            for client in [c for c in self.clients.values()
                           if c.resolving is not None and c.resolving[0].job_id == job_id]:
                assert client.resolving is not None
                fields, client.resolving = client.resolving[1], None
                if isinstance(outcome, CudawrapError):
                    self._fail(client, outcome.exit_code, outcome.message, outcome.hint or "")
                else:
                    self._ask(client, fields, outcome)

    def _ask(self, client: Client, fields: Dict[str, str], job: Optional[JobGpus]) -> None:
        """Read CLIENT's request (JOB: its Slurm job's GPUs, Slurm's word) and put it in line."""
        if self.line.changed():
            self.line.load()
        try:
            link = peer.program(client.peer.pid, self.root)
            ask = asks.read(self.root, self.line.inventory, fields, link, client.peer.uid, self.line.present, job)
        except CudawrapError as exc:
            self._fail(client, exc.exit_code, exc.message, exc.hint or "")
            return
        key, arrival = client.arrival
        client.ask = ask
        client.waiter = ask.waiter(key, client.peer.uid, client.peer.pid, arrival)
        client.wait_until = time.monotonic() + ask.wait
        self.dirty = True
        self._decide()  # a newcomer is answered at once, free devices or not

    def _held(self, client: Client) -> None:
        assert client.waiter is not None and client.ask is not None
        pending = self.grants.confirm(client.waiter.key)
        if pending is None:
            self._fail(client, os.EX_PROTOCOL, "the cudawrap service: the grant's locks are not held")
            self.dirty = True
            return
        if client.peer.pidfd >= 0:
            held = Held(client.peer.uid, client.peer.pid, os.dup(client.peer.pidfd), pending.devices,
                        client.ask.program, time.time(), lease_id=pending.lease_id, slots=pending.slots)
            self.grants.follow(held)
            self.selector.register(held.pidfd, selectors.EVENT_READ, held)
        client.send(wire.DONE, {})
        _say(f"granted {'a share of ' if pending.slots else ''}{','.join(pending.devices)} to uid "
             f"{client.peer.uid} pid {client.peer.pid} ({client.waiter.program})")
        client.waiter = None  # served: no longer waiting
        self._drop(client)

    def _question(self, client: Client, verb: str, fields: Dict[str, str]) -> None:
        from . import questions

        asker = client.peer.uid
        try:
            if verb == wire.CANCEL:
                waiting = {c.peer.pid: c for c in self._waiting()}
                chosen = questions.cancellable(fields.get("pids", ""), waiting, asker)
                by = user_name(asker)
                for victim in chosen:
                    _say(f"pid {victim.peer.pid} cancelled by {by}")
                    self._fail(victim, CANCELLED_EXIT, f"cancelled by {by}")
                reply = {"cancelled": ",".join(str(c.peer.pid) for c in chosen)}
            else:
                mine = [c.waiter for c in self._waiting() if c.waiter is not None]
                verdicts = self.line.decide(mine, self.grants.claimed())
                self.dirty = True  # what it found may grant someone: the loop decides next
                waiting = questions.line(self.line.entries, mine, verdicts, self.line.programs(), asker,
                                         self.private_status)
                reply = questions.answer(waiting, questions.holders(list(self.grants.held.values()), asker,
                                                                   self.private_status))
                reply["service_pids"] = ",".join(f"{c.peer.pid}:{c.peer.uid}" for c in self._waiting())
                if fields.get("whole") == "1":
                    reply["status"] = questions.whole(self.root, waiting, asker, self.private_status,
                                                      list(self.grants.held.values()))
        except CudawrapError as exc:
            self._fail(client, exc.exit_code, exc.message, exc.hint or "")
            return
        client.answer(reply)
        self._drop(client)

    # -- the machine ------------------------------------------------------------------------
    def _events(self) -> None:
        from ..base import inotify

        assert self.watch is not None
        events = self.watch.events()  # type: ignore[attr-defined]
        drains = os.path.basename(loc.DRAINS)
        events = [e for e in events if e[0] != self.state_wd or e[2] == drains]  # not the ledger's writes
        closed = {name.rpartition(".")[0] if wd == self.share_wd else name  # a slot file: UUID.K
                  for wd, mask, name in events if mask & (inotify.IN_CLOSE_WRITE | inotify.IN_CLOSE_NOWRITE)}
        for held in self.grants.lingering():
            if closed & set(held.devices):
                self.grants.check(held)
        if events:
            self.dirty = True

    def _exited(self, held: Held) -> None:
        self.selector.unregister(held.pidfd)
        held.exited = True
        self.grants.check(held)
        self.dirty = True

    def _decide(self) -> None:
        self.last_decision = time.monotonic()
        self.dirty = False
        waiting = [c for c in self._waiting() if c.waiter is not None and c.waiter.key not in self.grants.pending]
        if not waiting:
            return
        verdicts = self.line.decide([c.waiter for c in waiting if c.waiter is not None], self.grants.claimed(),
                                    self.grants.holders())
        now = time.monotonic()
        for client in waiting:
            assert client.waiter is not None and client.ask is not None
            verdict = verdicts.get(client.waiter.key)
            if verdict is None:
                continue
            if verdict.kind == GRANTED:
                if not self._offer(client, list(verdict.devices)):
                    self._drop(client)
                continue
            if client.ask.wait <= 0 or now >= client.wait_until:
                self._timed_out(client, verdict)
            elif verdict.kind != client.told:
                client.told = verdict.kind
                if not client.send(wire.WAIT, {"text": f"waiting for a device: {verdict.text} (pid {client.peer.pid})"}):
                    self._drop(client)

    def _offer(self, client: Client, devices: List[str]) -> bool:
        """Send CLIENT the grant of DEVICES: of a share of each that has slots, for a shared
        run (as a run deciding for itself takes them: Acquirer._take). False if the client is
        gone; a share that cannot be had now (its slots taken past the line since, or under MPS
        another user's work found there) stays waiting."""
        assert client.waiter is not None and client.ask is not None
        ask, slots = client.ask, self.line.acquirer.slots
        shared = [u for u in devices if ask.share and slots.get(u, 1) > 1]
        if not self.line.joinable(shared, client.peer.uid):
            self.dirty = True  # NVML was read again: the next decision sees who is there
            return True
        chosen = self.grants.free_slots(shared, slots)
        if chosen is None:  # taken since the decision, or not made yet (sync makes slot files)
            if ask.wait <= 0 or time.monotonic() >= client.wait_until:
                self._fail(client, os.EX_TEMPFAIL, f"no free device: no slot of {','.join(shared)} is free now",
                           "try again later, or set CUDAWRAP_WAIT=SECONDS")
            return True
        sharing = self.line.acquirer.sharing
        return self.grants.offer(client.sock, client.waiter.key, client.peer.pid, client.peer.uid, devices,
                                 ask.program, client.waiter.arrival, chosen,
                                 ask.variables(self.root, shared, self.line.acquirer.current, slots),
                                 sum(sharing.cost(slots.get(u, 1)) for u in devices))

    def _timed_out(self, client: Client, verdict: Verdict) -> None:
        assert client.ask is not None
        if client.ask.wait <= 0:
            self._fail(client, os.EX_TEMPFAIL, f"no free device: {verdict.text}; waiting is off (wait = 0)",
                       "set CUDAWRAP_WAIT=SECONDS to wait")
        else:
            self._fail(client, os.EX_TEMPFAIL, f"no device within {client.ask.wait:g} s: {verdict.text}",
                       "try again later, or set CUDAWRAP_WAIT=SECONDS")


def _say(line: str) -> None:
    """A line for the journal (or the --daemon log): the service's own account of what it did."""
    print(f"cudawrap serve: {line}", flush=True)


def raise_file_limit() -> None:
    """Room for thousands of clients and their pidfds."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(root: str) -> None:
    from pathlib import Path

    from ..policy.config import load_config

    raise_file_limit()
    config = load_config(Path(root) / loc.CONFIG_FILE)  # a broken config: one line, 78, before listening
    from ..install.runtime import prepare_runtime
    from ..paths import Layout

    # [service] enforce: the lease, slot and queue directories become root's before the
    # first grant (and users' again when it is turned off); `cudawrap sync` does the same.
    prepare_runtime(Layout(Path(root)), bool(config["enforce"]))
    lock = _hold_service_lock(root)
    monitor = start_monitor(Layout(Path(root)), lock)  # before NVML is opened here: a fork must not share it
    try:
        service = Service(root, config["max_connections_per_uid"], config["private_status"])
        _say(f"listening on {service.path}")
        service.run()
    finally:
        stop_monitor(monitor)
        os.close(lock)


def _hold_service_lock(root: str) -> int:
    """The service's lock (root's alone), held for its life: see ledger.service_running."""
    import fcntl

    path = loc.under(root, loc.SERVICE_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SetupError(f"a service already holds {path}",
                         hint="stop it first (systemctl stop cudawrap, or kill the pid in its pid file)") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def start_monitor(layout: object, lock: int) -> int:
    """The monitor's loop (ops/monitor.py: the snapshot, the ledger's look at foreign work,
    health, memory, metrics) in a child of the service: it shares nothing with the grant
    path (no lock, no interpreter), dies with the service (PR_SET_PDEATHSIG: also when the
    service is killed with -9), and waits its turn while a cudawrap-monitor unit runs one.
    It lets go of the service's LOCK: that says the service lives, not its monitor."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        os.close(lock)
        _die_with(os.getppid())
        from .monitor import run

        run(layout)  # type: ignore[arg-type]
    except BaseException:  # noqa: BLE001 - whatever ends it, never return into the parent's code
        logging.getLogger(__name__).exception("the monitor's loop ended")
        code = 1
    os._exit(code)


def _die_with(parent: int) -> None:
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os._exit(0)


def stop_monitor(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
