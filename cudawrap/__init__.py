"""cudawrap: every run of a CUDA program gets its own free GPU or MIG instance.

This file is the shim's entry point (main) as well as the package's: importing any part of
cudawrap runs it first, so the shim's fast path lives here and costs a launch no module of its
own (~0.1 ms each). Where `cudawrap serve` answers, a launch is a handful of system calls:
connect, say the variables that may narrow the run's settings (which program runs, the service
reads from /proc: the kernel's word, not ours), receive the lease files' descriptors, lock
them, exec. The service reads the policy, decides and records; nothing here reads a file of
cudawrap's. Every other case goes the general way (cudawrap.launch), which decides the same
with the whole of cudawrap: no service (or one gone while we waited: the ticket keeps our
place), a lease inherited from a wrapped parent, a Slurm job, a real program that is a symbolic
link (it might lead back to a shim), CUDAWRAP_DEBUG, and every error there is to explain.

It imports the C modules posix, _socket and fcntl and cudawrap's leaves (wire, locations)
only: not os (posixpath, stat, _collections_abc: ~0.8 ms). Without a service (no socket), it
costs a launch three stat calls and imports nothing more.
"""
# No `from __future__ import annotations` here (nor in locations.py): at run time it imports
# the module __future__, ~0.1 ms of every launch. Annotations naming typing's names are strings.
import posix
import sys

TYPE_CHECKING = False  # the shim imports this package; `import typing` costs ~10 ms
if TYPE_CHECKING:
    from typing import Any, Dict, List, NoReturn, Optional, Tuple

__version__ = "0.1.0"

__all__ = ["__version__", "acquire"]


def acquire(count: int = 1, wait: "Any" = None, **kwargs: "Any") -> "List[str]":
    """Lease COUNT free devices for the life of this process and set CUDA_VISIBLE_DEVICES.

    Call it before anything initialises CUDA. Returns the leased UUIDs. See
    :func:`cudawrap.api.acquire` for the full signature.
    """
    from .api import acquire as _acquire

    return _acquire(count=count, wait=wait, **kwargs)


# ---- the shim's entry point, and its fast path through the service --------------------------

_ASK_PREFIX = b"CUDAWRAP_"
_GENERAL = (b"SLURM_JOB_ID", b"CUDAWRAP_DEBUG")  # set (or LEASE_ENV, inherited): the general way
_CVD = b"CUDA_VISIBLE_DEVICES"
# A shared run's MPS variables: a whole device bypasses MPS (here and in launch.whole_devices).
MPS_VARIABLES = (b"CUDA_MPS_PIPE_DIRECTORY", b"CUDA_MPS_LOG_DIRECTORY",
                  b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
_S_IFMT, _S_IFREG = 0o170000, 0o100000
# Set by the waiter (shims/cudawrap-wait.c) when it hands a run back to this shim: "T" and the
# ticket (the service went away: the general way asks again), or "E" and a refusal to report.
# Whatever a user sets here affects that user's own run only, as CUDAWRAP_DEBUG does: a ticket
# is the service's to honour (signed, bound to its uid, used once).
_RESUME = b"CUDAWRAP_RESUME"
_WAITER_LAYOUT = "cudawrap-wait/1"  # the waiter's argument list, as its first word (it refuses any other)
_EX_PROTOCOL, _EX_SOFTWARE = "76", 70  # os.EX_PROTOCOL and os.EX_SOFTWARE, without os


def main(root: str, link: "Optional[str]" = None) -> "NoReturn":
    """Run the program wrapped at LINK (baked into its own shim; None: the shared shim of
    older installs, which finds it from how it was invoked)."""
    sys.meta_path.insert(0, OwnModules)  # cudawrap's own modules found and loaded directly, either way
    ticket = ""
    if link is not None:
        try:
            resumed = posix.environ.get(_RESUME)
            if resumed is not None:  # back from the waiter (shims/cudawrap-wait.c)
                ticket = _resumed(link, resumed.decode("utf-8", "surrogateescape"))
            else:
                ticket = _served(root, link, sys.argv)  # returns only to go the general way
        except KeyboardInterrupt:
            posix._exit(130)
    # The general way loads ~24 of cudawrap's modules: collections of the cyclic garbage collector
    # while they load (~10 at the default threshold of 700 new objects) are put off. A launch execs
    # long before its garbage matters; a run that waits collects, 100 times less often.
    import gc

    gc.set_threshold(70000, 10, 10)
    from .launch import main as general

    general(root, link, ticket)


class OwnModules(sys.modules["_frozen_importlib_external"].SourceFileLoader):  # importlib's own, loaded at start
    """A meta path finder for cudawrap's own submodules, put first by the shim (the path finder's
    search costs each ~20 us: a directory listing per package, five suffixes joined and tried per
    name), and their loader. The spec is the path finder's (spec_from_file_location): a package
    directory's __init__.py first, then NAME.py; anything else (not cudawrap's, or not plain
    source) is left to the finders after it. It loads as SourceFileLoader does, but that a current
    pyc (as pip wrote it at install) is one open and read, checked by the same header fields with
    the stat that found its source (~20 us a module less); any other pyc is the loader's to read."""
    st = pyc = None  # that stat, once (a reload, or a loader made elsewhere, goes the loader's way)

    @staticmethod
    def find_spec(name: str, path: "Any" = None, target: "Any" = None) -> "Any":
        if not path or not name.startswith("cudawrap."):
            return None
        base = f"{path[0]}/{name[name.rfind('.') + 1:]}"
        for file, search in ((base + "/__init__.py", [base]), (base + ".py", None)):
            try:
                st = posix.stat(file)
            except OSError:
                continue
            if st.st_mode & _S_IFMT != _S_IFREG:
                return None
            loader = OwnModules(name, file)
            spec = sys.modules["_frozen_importlib_external"].spec_from_file_location(
                name, file, loader=loader, submodule_search_locations=search)
            loader.st, loader.pyc = st, spec.cached  # its pyc's path, worked out once (also __cached__)
            return spec
        return None

    def get_code(self, fullname: str) -> "Any":
        import _imp
        import marshal

        st, self.st, external = self.st, None, sys.modules["_frozen_importlib_external"]
        try:
            fd = posix.open(self.pyc or "", posix.O_RDONLY | posix.O_CLOEXEC)
            try:
                data = posix.read(fd, posix.fstat(fd).st_size)
            finally:
                posix.close(fd)
        except OSError:  # no pyc (or no bytecode cache at all: no path)
            data = b""
        if st is None or data[:16] != external.MAGIC_NUMBER + bytes(4) + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(
                4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little"):  # 0: a timestamp pyc
            return super().get_code(fullname)
        code = marshal.loads(memoryview(data)[16:])
        _imp._fix_co_filename(code, self.path)  # as the loader does: the source's path, wherever compiled
        return code


def say(prog: str, message: str) -> None:
    """One line on stderr; written in one call so parallel launches never interleave."""
    posix.write(2, f"{prog}: {message}\n".encode("utf-8", "replace"))


_ORIGINAL: "List[Dict[bytes, bytes]]" = []


def original_environ() -> "Dict[bytes, bytes]":
    """The caller's environment exactly as it was passed to us, byte for byte (a copy of its own).

    Python adds LC_CTYPE when it coerces a C locale, and os.environ cannot tell us what
    it changed; the kernel's copy in /proc/self/environ is the untouched original, and it
    never changes: read once, while the service decides (_converse).
    """
    if _ORIGINAL:
        return dict(_ORIGINAL[0])
    try:
        fd = posix.open("/proc/self/environ", posix.O_RDONLY | posix.O_CLOEXEC)
    except OSError:
        _ORIGINAL.append(dict(posix.environ))
        return dict(_ORIGINAL[0])
    try:
        data = b"".join(iter(lambda: posix.read(fd, 1 << 16), b""))
    finally:
        posix.close(fd)
    env: Dict[bytes, bytes] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key not in env:  # the first of duplicates wins, as with getenv()
            env[key] = value
    env.pop(_RESUME, None)  # for this shim only, never the program's
    _ORIGINAL.append(env)
    return dict(env)


def _served(root: str, link: str, argv: "List[str]") -> str:
    """Exec the real program with the devices the service grants; the ticket of a place in
    line ("" for none) when the general way must go on instead."""
    from . import locations as loc

    environ = posix.environ
    if not argv or not argv[0] or any(name in environ for name in (loc.LEASE_ENV.encode(),) + _GENERAL):
        return ""
    preset = environ.get(_CVD)
    if preset is not None and not preset.strip():
        return ""  # asks for no device at all
    cut = link.rfind("/") + 1
    real = link[:cut] + loc.REAL_PREFIX + link[cut:]
    try:
        st, shim = posix.lstat(real), posix.stat(argv[0])
    except OSError:
        return ""  # missing: the general way says so
    if st.st_mode & _S_IFMT != _S_IFREG or (st.st_dev, st.st_ino) == (shim.st_dev, shim.st_ino):
        return ""
    path = loc.under(root, loc.SERVICE_SOCKET)
    try:
        posix.stat(path)
    except OSError:
        return ""  # no service
    import _socket

    from . import wire

    # The request is ready before connecting: the service, woken by the connection, finds it there.
    fields = {"asks": wire.pairs({k: v for k, v in environ.items() if k.startswith(_ASK_PREFIX)})}
    for name, key in ((_CVD, "visible"), (b"CUDA_DEVICE_ORDER", "order")):
        if name in environ:
            fields[key] = environ[name].decode("utf-8", "surrogateescape")
    try:
        request = wire.encode(wire.RUN, fields)
    except ValueError:
        return ""  # too long to send: the general way reads the same variables itself
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return ""  # a dead service's socket
    granted = _converse(sock, request, link[cut:], (root, real, argv, shim.st_uid))
    if isinstance(granted, str):
        return granted
    _become(root, link, real, argv, *granted)


def _resumed(link: str, why: str) -> str:
    """What the waiter handed back (_RESUME): the ticket to go the general way with, or the
    service's refusal reported (no return)."""
    if why.startswith("E"):
        code, _, rest = why[1:].partition("\x1f")
        text, _, hint = rest.partition("\x1f")
        _refused(link[link.rfind("/") + 1:], {"code": code, "text": text, "hint": hint})
    return why[1:] if why.startswith("T") else ""


def waiter_usable(st: "Any", owner: int) -> bool:
    """Whether the shim execs the waiter whose stat is ST, the shim's own file being OWNER's:
    a plain executable file of that owner that nobody else may write (doctor says the same)."""
    return st.st_mode & _S_IFMT == _S_IFREG and st.st_uid == owner and not st.st_mode & 0o022 and bool(
        st.st_mode & 0o100)


def _wait_elsewhere(sock: "Any", prog: str, ticket: str, run: "Tuple[str, str, List[str], int]") -> None:
    """Go on waiting in the waiter (shims/cudawrap-wait.c) on this connection: the run's
    hand-over is then an exec from a small C process, not from this interpreter (whose
    teardown in exec is ~1 ms, paid here instead, where nobody waits on it). Returns only
    where there is no waiter of this install's owner's (not built: no C compiler at install)."""
    from . import locations as loc

    root, real, argv, owner = run
    if not sys.executable:
        return  # it could not hand the run back to a shim (_RESUME)
    waiter = loc.under(root, loc.WAITER)
    try:
        st = posix.stat(waiter)
    except OSError:
        return
    if not waiter_usable(st, owner):
        return  # not the install's own: wait here
    fd = sock.fileno()
    posix.set_inheritable(fd, True)
    args = [waiter, _WAITER_LAYOUT, str(fd), prog, real, loc.under(root, loc.MPS_DIR), ticket,
            sys.executable, argv[0], "--", argv[0]] + argv[1:]
    try:
        posix.execve(waiter, args, original_environ())
    except OSError:
        posix.set_inheritable(fd, False)


def _converse(sock: "Any", request: bytes, prog: str, run: "Tuple[str, str, List[str], int]") -> "Any":
    """The service's grant, locked: (uuid -> lease descriptor, uuid -> slot descriptor, the
    grant's fields); or the ticket to go the general way with, if the service went away.
    RUN (root, real program, argv, the shim's owner): to go on waiting in the waiter."""
    import _socket

    from . import wire

    reader, fds, ticket, granted, elsewhere = wire.Reader(), [], "", None, True
    try:
        sock.sendall(request)
        # Loaded while the service decides, not once the grant is here (a C extension: ~0.2 ms
        # of a hand-over when wire.lock_granted imported it first); the environment to exec with too.
        import fcntl  # noqa: F401
        original_environ()
        while True:
            data, ancillary, _flags, _addr = sock.recvmsg(
                wire.MAX_MESSAGE, _socket.CMSG_SPACE(wire.MAX_FDS * wire.FD_BYTES))
            fds += wire.received_fds(ancillary)
            if not data:
                if granted is not None:
                    return granted  # the locks are ours: the kernel's word stands without the service
                break
            replies = reader.feed(data)
            for verb, reply in replies:
                if granted is not None:
                    if verb == wire.DONE:
                        return granted
                elif verb == wire.WAIT:
                    ticket = reply.get("ticket", ticket)
                    if reply.get("text"):
                        say(prog, reply["text"])
                elif verb == wire.ERROR:
                    if reply.get("code") == _EX_PROTOCOL and not ticket:
                        return ""  # a service that does not know wire.RUN: the general way asks it
                    _refused(prog, reply)
                elif verb == wire.GRANT:
                    granted = _take(sock, prog, fds, reply)
                    if granted is not None and not granted[1]:
                        # Whole devices: nothing more to say. The connection closes before the
                        # exec, and the service checks the locks then, as it checks a HELD's.
                        return granted
            if (elsewhere and granted is None and replies and replies[-1][0] == wire.WAIT
                    and not fds and not reader.buffer):
                elsewhere = False  # tried once: if there is none, wait here
                _wait_elsewhere(sock, prog, ticket, run)
    except (OSError, ValueError):  # ValueError: a message too long to send, or a malformed reply
        if granted is not None:
            return granted  # the locks are ours: the kernel's word stands without the service
        # Gone before granting (a restart): the general way asks again, with the ticket.
    finally:
        for fd in fds:
            posix.close(fd)
        sock.close()
    return ticket


def _take(sock: "Any", prog: str, fds: "List[int]", reply: "Dict[str, str]") -> "Any":
    """A GRANT's descriptors FDS (emptied: they are the grant's now, or closed) locked:
    (leases, slots, REPLY), a share's HELD said; None, and LOST said, if one was taken past
    the service (by a run deciding for itself)."""
    from . import wire

    described = wire.described(reply)
    locked = wire.lock_granted(fds, described) if described is not None and len(described) == len(fds) else None
    if locked is None:
        for fd in fds:
            posix.close(fd)
        fds.clear()
        sock.sendall(wire.encode(wire.LOST, {"devices": reply.get("devices", "")}))
        return None
    fds.clear()
    if reply.get("text"):
        say(prog, reply["text"])  # what it got after waiting
    if locked[1]:
        # A share says HELD and waits for DONE: the service opens the device's MPS pipe
        # directory to this user then, before the program may connect to it.
        sock.sendall(wire.encode(wire.HELD, {"devices": reply.get("devices", "")}))
    return locked + (reply,)


def lease_marker(leases: "Dict[str, int]", slots: "Dict[str, int]") -> str:
    """LEASE_ENV's value for a lease (lease.known.inherited_lease reads it): "fd:uuid" for a
    whole device, "fd:uuid:slotfd" for a share."""
    return ",".join(f"{fd}:{uuid}:{slots[uuid]}" if uuid in slots else f"{fd}:{uuid}" for uuid, fd in leases.items())


def _refused(prog: str, reply: "Dict[str, str]") -> "NoReturn":
    """The service's refusal, as the general way prints an error: one line, a hint, its exit status."""
    from .launch import fail

    from . import wire

    fail(prog, reply.get("text") or "the cudawrap service refused the request", reply.get("hint") or None,
         wire.exit_status(reply, _EX_SOFTWARE))


def _become(root: str, link: str, real: str, argv: "List[str]", leases: "Dict[str, int]", slots: "Dict[str, int]",
             reply: "Dict[str, str]") -> "NoReturn":
    """Exec REAL with the lease's descriptors and its variables, as launch.Grant.apply sets them."""
    from . import locations as loc, wire

    prog = link[link.rfind("/") + 1:]
    env = original_environ()
    if not slots and env.get(b"CUDA_MPS_PIPE_DIRECTORY", b"").startswith(
            (loc.under(root, loc.MPS_DIR) + "/").encode()):
        for name in MPS_VARIABLES:
            env.pop(name, None)
    env.update(wire.unpairs(reply.get("env", "")))
    for name, value in wire.unpairs(reply.get("defaults", "")).items():
        env.setdefault(name, value)
    visible = ",".join(leases)
    env[_CVD] = visible.encode()
    env[loc.LEASE_ENV.encode()] = lease_marker(leases, slots).encode()
    env[loc.PROGRAM_ENV.encode()] = prog.encode()
    for fd in list(leases.values()) + list(slots.values()):
        posix.set_inheritable(fd, True)
    if posix.environ.get(b"CUDAWRAP_VERBOSE"):
        say(prog, f"CUDA_VISIBLE_DEVICES={visible} -> {real}")
    import _signal  # `signal` would pull in enum

    # Python ignores SIGPIPE and SIGXFSZ, and ignored signals survive exec (launch.exec_program).
    for signum in (_signal.SIGPIPE, _signal.SIGXFSZ):
        _signal.signal(signum, _signal.SIG_DFL)
    args = [argv[0]] + argv[1:]
    try:
        posix.execve(real, args, env)
    except OSError as exc:
        failed = exc
    from .launch import exec_failed

    exec_failed(root, link, real, args, env, failed)
