"""The launch path: find the real program, lease devices, exec it unchanged but for CUDA_VISIBLE_DEVICES.

Imported by the shim on every launch of every wrapped program, so it imports only what
it needs, lazily, and never plumbum, pathlib, typing or dataclasses.
"""
from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, List, NoReturn, Optional, Sequence

from . import audit
from . import locations as loc
from .errors import (CannotExecute, CudawrapError, NoDeviceError, NvmlUnavailable, ProgramNotFound,
                     UsageError)
from .leases import LEASE_ENV, Lease, LeaseFiles, inherited_lease

CVD = "CUDA_VISIBLE_DEVICES"
CVD_B = CVD.encode()


def say(prog: str, message: str) -> None:
    """One line on stderr; written in one call so parallel launches never interleave."""
    os.write(2, f"{prog}: {message}\n".encode("utf-8", "replace"))


def original_environ() -> Dict[bytes, bytes]:
    """The caller's environment exactly as it was passed to us, byte for byte.

    Python adds LC_CTYPE when it coerces a C locale, and os.environ cannot tell us what
    it changed; the kernel's copy in /proc/self/environ is the untouched original.
    """
    try:
        with open("/proc/self/environ", "rb") as f:
            data = f.read()
    except OSError:
        return dict(os.environb)
    env: Dict[bytes, bytes] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key not in env:  # the first of duplicates wins, as with getenv()
            env[key] = value
    return env


def find_link(invoked: str, shim: str) -> str:
    """The wrapped name through which the shim was reached.

    That is the last link in INVOKED's symlink chain with a CUDAWRAP_<name> beside it, so
    the real program is found even when a user ran it through another symlink elsewhere
    (/usr/local/bin/recon -> /opt/app/bin/recon -> shim) or the shim is itself reached
    through links. Without any such sibling, the last link names the missing program.
    """
    chain = []
    path = invoked
    for _ in range(40):  # the kernel's own limit on symlink chains
        if not os.path.islink(path):
            break
        chain.append(path)
        target = os.readlink(path)
        path = target if target.startswith("/") else os.path.join(os.path.dirname(path), target)
    if not chain:
        try:
            if os.path.samefile(invoked, shim):
                raise UsageError(
                    "this is cudawrap's shim; run a wrapped program by its own name",
                    hint="wrap a program with `create-cudawrap PATH`, or use `cudawrap run -- CMD`")
        except OSError:
            pass
        return invoked
    for link in reversed(chain):
        directory, name = os.path.split(link)
        if os.path.lexists(os.path.join(directory, loc.REAL_PREFIX + name)):
            return link
    return chain[-1]


def real_program(link: str, shim: str) -> str:
    """CUDAWRAP_<name> beside LINK; refuses anything that would lead back to the shim."""
    directory, name = os.path.split(link)
    real = os.path.join(directory, loc.REAL_PREFIX + name)
    try:
        st = os.stat(real)
    except OSError:
        raise ProgramNotFound(f"the real program {real} is missing",
                              hint="ask an admin to run `cudawrap doctor`") from None
    try:
        shim_st = os.stat(shim)
        if (st.st_dev, st.st_ino) == (shim_st.st_dev, shim_st.st_ino):
            raise ProgramNotFound(f"{real} leads back to the shim itself",
                                  hint="ask an admin to run `cudawrap doctor --repair`")
    except FileNotFoundError:
        pass
    return real


class Grant:
    """What a run got: a lease (possibly inherited) or nothing, and what to tell it."""

    def __init__(self, lease: Optional[Lease], visible: Optional[str]) -> None:
        self.lease = lease
        self.visible = visible  # value for CUDA_VISIBLE_DEVICES; None = leave it as it is

    def apply(self, env: Dict[bytes, bytes]) -> Dict[bytes, bytes]:
        if self.visible is not None:
            env[CVD_B] = self.visible.encode()
        if self.lease is not None:
            env[LEASE_ENV.encode()] = self.lease.marker().encode()
        return env


def _narrow_inherited(lease: Lease, preset: Optional[str]) -> str:
    """Within an inherited lease, keep what the caller narrowed CUDA_VISIBLE_DEVICES to."""
    if preset:
        kept = [t.strip() for t in preset.split(",") if t.strip() in lease.fds]
        if kept:
            return ",".join(kept)
    return ",".join(lease.uuids)


def obtain(root: str, prog: str, settings: Dict[str, Any], environ: Any,
           count: Optional[int] = None) -> Grant:
    """Lease devices for one run under SETTINGS (key -> (value, source))."""
    value = {k: v for k, (v, _src) in settings.items()}
    count = value["gpus"] if count is None else count
    lease_dir = loc.under(root, loc.LEASE_DIR)
    preset = environ.get(CVD)

    marker = environ.get(LEASE_ENV)
    if marker:
        inherited = inherited_lease(lease_dir, marker)
        if inherited is not None:
            return Grant(inherited, _narrow_inherited(inherited, preset))

    from . import nvml
    from .snapshot import SnapshotRefresh, read_fresh

    inventory = read_fresh(root)  # kept by `cudawrap monitor`; spares us pynvml
    refresh = SnapshotRefresh(root) if inventory is not None else nvml.refresh
    if inventory is None:
        try:
            inventory = nvml.inventory()
        except NvmlUnavailable as exc:
            if value["no_driver"] == "fail":
                raise
            say(prog, f"warning: {exc}; running without a device lease")
            audit.log("no-driver", "warning", program=prog, pid=os.getpid(), reason=str(exc))
            return Grant(None, None)
    checked_at = time.monotonic()

    from .selection import allowed, parse_visible, read_allow_file

    candidates = list(inventory.devices)
    allow = list(value["allow"])
    if value["allow_file"]:
        allow += read_allow_file(value["allow_file"])
    candidates = allowed(candidates, allow)
    if preset is not None:
        if not preset.strip():
            return Grant(None, None)  # the caller asked for no device at all
        visible = parse_visible(preset, inventory)
        candidates = [d for d in candidates if d in visible]
    why = " (narrowed by CUDA_VISIBLE_DEVICES)" if preset is not None else (
        " (narrowed by the allow-list)" if allow else "")
    from .drains import drained, is_drained, undrained

    drains = drained(root)  # an admin's `cudawrap drain`: no new lease there
    usable = undrained(candidates, drains)
    if len(usable) < count <= len(candidates):
        names = ", ".join(d.uuid for d in candidates if d not in usable)
        raise NoDeviceError(f"{count} device{'s' if count > 1 else ''} asked for, but {names} "
                            f"{'is' if len(candidates) - len(usable) == 1 else 'are'} drained by an admin "
                            f"and only {len(usable)} can be used now{why}",
                            hint="`cudawrap status` says why and since when; try again after `cudawrap resume`")
    candidates = usable

    if count > 1 and not inventory.multi_mig and any(d.is_mig for d in candidates):
        if value["multi_mig"] == "refuse":
            raise NoDeviceError(
                f"{count} devices asked for, but with driver {inventory.driver_version} a process "
                f"can use only one MIG instance",
                hint="ask for one device, or an admin may set multi_mig = \"whole-gpus\"")
        candidates = [d for d in candidates if not d.is_mig]
    if len(candidates) < count:
        raise NoDeviceError(
            f"{count} device{'s' if count > 1 else ''} asked for, but only "
            f"{len(candidates)} can be used here{why}",
            hint="`cudawrap status` lists the devices")

    from .acquire import Acquirer, describe_wait
    from .waitqueue import WaitQueue

    leases = LeaseFiles(lease_dir)
    # A device without a lease file (appeared since the last sync) can never be leased:
    # leave it out rather than wait for it forever.
    unsynced = [d for d in candidates if leases.fd(d.uuid) is None]
    if len(candidates) - len(unsynced) < count:
        from .errors import SetupError
        from .leases import SYNC_HINT

        raise SetupError(f"{len(unsynced)} of the usable devices have no lease file in {lease_dir}",
                         hint=SYNC_HINT)
    candidates = [d for d in candidates if d not in unsynced]
    queue = WaitQueue(loc.under(root, loc.QUEUE_DIR), loc.under(root, loc.QUEUE_LOCK))

    def drain_aware(device: Any) -> Any:  # a waiter's fresh look also sees drains made while it waited
        return None if is_drained(root, device) else refresh(device)

    acquirer = Acquirer(
        leases, queue, candidates, inventory.devices, count,
        placement=value["placement"], foreign=value["foreign"],
        busy_memory_mib=value["busy_memory_mib"], refresh=drain_aware, checked_at=checked_at)
    wait_s = value["wait"]
    info = f"uid={os.getuid()}\npid={os.getpid()}\ncount={count}\nprogram={prog}\n".encode()
    waited = {"yes": False}

    def on_wait(ahead: int) -> None:
        waited["yes"] = True
        say(prog, describe_wait(len(candidates), ahead))
        audit.log("wait", program=prog, pid=os.getpid(), ahead=ahead, count=count)

    start = time.monotonic()
    try:
        lease = acquirer.acquire(wait_s, info, on_wait)
    except NoDeviceError as exc:
        audit.log("timeout", "warning", program=prog, pid=os.getpid(), reason=str(exc))
        raise
    waited_s = time.monotonic() - start
    audit.log("grant", program=prog, pid=os.getpid(), devices=",".join(lease.uuids),
              wait=f"{waited_s:.3f}s")
    if waited["yes"]:
        say(prog, f"got {','.join(lease.uuids)} after {waited_s:.1f} s")
    return Grant(lease, ",".join(lease.uuids))


def exec_program(path: str, argv: Sequence[str], env: Dict[bytes, bytes], grant: Grant) -> NoReturn:
    """Become the real program: same pid, so signals and exit codes pass through."""
    import _signal  # `signal` would pull in enum; the C module is enough here

    # Python ignores SIGPIPE and SIGXFSZ, and ignored signals survive exec: without this
    # `wrapped | head` would see EPIPE errors instead of dying quietly as it should.
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(_signal, name):
            _signal.signal(getattr(_signal, name), _signal.SIG_DFL)
    if grant.lease is not None:
        grant.lease.keep_across_exec()
    try:
        os.execve(path, list(argv), env)
    except FileNotFoundError:
        raise ProgramNotFound(f"{path}: not found") from None
    except PermissionError:
        raise CannotExecute(f"{path}: permission denied") from None
    except OSError as exc:
        raise CannotExecute(f"{path}: cannot execute: {exc.strerror}") from None


def run_shim(root: str, argv: List[str]) -> NoReturn:
    from .policy import effective

    if not argv or not argv[0]:
        raise UsageError("started without a program name")
    invoked = argv[0]
    shim = loc.under(root, loc.SHIM)
    link = find_link(invoked, shim)
    prog = os.path.basename(link)
    real = real_program(link, shim)
    settings = effective(root, os.path.abspath(link))
    grant = obtain(root, prog, settings, os.environ)
    if os.environ.get("CUDAWRAP_VERBOSE"):
        say(prog, f"{CVD}={grant.visible if grant.visible is not None else '(unchanged)'} -> {real}")
    if not os.path.lexists(real):
        real = _unwrapped_meanwhile(link, shim) or real
    exec_program(real, [invoked] + argv[1:], grant.apply(original_environ()), grant)


def _unwrapped_meanwhile(link: str, shim: str) -> Optional[str]:
    """LINK itself if an unwrap put the real program back there while we were starting or waiting."""
    try:
        if os.path.exists(link) and not os.path.samefile(link, shim):
            return link
    except OSError:
        pass
    return None


def main(root: str) -> NoReturn:
    """The shim's entry point: errors become one line and the documented exit code."""
    argv = sys.argv
    prog = os.path.basename(argv[0]) if argv and argv[0] else "cudawrap"
    try:
        run_shim(root, argv)
    except CudawrapError as exc:
        say(prog, exc.message)
        if exc.hint:
            say(prog, f"hint: {exc.hint}")
        if os.environ.get("CUDAWRAP_DEBUG"):
            import traceback

            traceback.print_exc()
        if not isinstance(exc, NoDeviceError):
            audit.log("error", "error", program=prog, pid=os.getpid(), reason=exc.message)
        os._exit(exc.exit_code)
    except KeyboardInterrupt:
        os._exit(130)
