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
    from typing import Any, Dict, List, NoReturn, Optional, Sequence, Tuple

    from .policy.effective import Settings

from .base import audit
from . import locations as loc
from .errors import (CannotExecute, CudawrapError, NoDeviceError, NvmlUnavailable, ProgramNotFound,
                     UsageError)
from .lease.files import LEASE_ENV, PROGRAM_ENV, Lease, LeaseFiles, inherited_lease

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


def _is_shim(path: str, root: str) -> bool:
    """Whether PATH resolves to a shim of the install at ROOT (the prototype or a program's own)."""
    target = os.path.realpath(path)
    return (target == os.path.realpath(loc.under(root, loc.SHIM))
            or os.path.dirname(target) == os.path.realpath(loc.under(root, loc.SHIM_DIR)))


def real_program(link: str, shim: str, root: str = "") -> str:
    """CUDAWRAP_<name> beside LINK; refuses anything that would lead back to a shim: SHIM
    (the file running now) or, given the install ROOT, any shim of that install."""
    directory, name = os.path.split(link)
    real = os.path.join(directory, loc.REAL_PREFIX + name)
    try:
        st = os.stat(real)
    except OSError:
        raise ProgramNotFound(f"the real program {real} is missing",
                              hint="ask an admin to run `cudawrap doctor`") from None
    looped = False  # a hard link of the shim would not show in its path
    try:
        shim_st = os.stat(shim)
        looped = (st.st_dev, st.st_ino) == (shim_st.st_dev, shim_st.st_ino)
    except OSError:
        pass
    if looped or (root and _is_shim(real, root)):
        raise ProgramNotFound(f"{real} leads back to the shim itself",
                              hint="ask an admin to run `cudawrap doctor --repair`")
    return real


class Grant:
    """What a run got: a lease (possibly inherited) or nothing, and what to tell it."""

    def __init__(self, lease: Optional[Lease], visible: Optional[str],
                 extra: Optional[Dict[bytes, bytes]] = None) -> None:
        self.lease = lease
        self.visible = visible  # value for CUDA_VISIBLE_DEVICES; None = leave it as it is
        self.extra = extra or {}  # more variables: an MPS client's
        self.defaults: Dict[bytes, bytes] = {}  # variables set only where the caller has none
        self.drop: Tuple[bytes, ...] = ()  # variables to remove
        self.program: Optional[str] = None  # the wrapped name, for a run a shim started

    def apply(self, env: Dict[bytes, bytes]) -> Dict[bytes, bytes]:
        for name in self.drop:
            env.pop(name, None)
        env.update(self.extra)
        for name, value in self.defaults.items():
            env.setdefault(name, value)
        if self.visible is not None:
            env[CVD_B] = self.visible.encode()
        if self.lease is not None:
            env[LEASE_ENV.encode()] = self.lease.marker().encode()
            if self.program:
                env[PROGRAM_ENV.encode()] = self.program.encode()
            else:  # `cudawrap run` inside a wrapped program: its command is not that program
                env.pop(PROGRAM_ENV.encode(), None)
        return env


def _narrow_inherited(lease: Lease, preset: Optional[str]) -> Optional[Lease]:
    """The part of an inherited LEASE that the caller's CUDA_VISIBLE_DEVICES names.

    The child lives in its parent's devices: an index counts in the parent's list (the
    order the parent was given them), a UUID (or a unique GPU- prefix) must be one of them,
    and, as in CUDA, the first entry that is neither, or repeats one, ends the list. Unset
    keeps the whole lease; None when nothing of the lease is named (set but empty: no device).
    """
    if preset is None:
        return lease
    from .sched.selection import _by_prefix

    uuids = lease.uuids
    kept: List[str] = []
    for token in preset.split(","):
        token = token.strip()
        if token.isascii() and token.isdigit():
            uuid = uuids[int(token)] if len(token) <= 9 and int(token) < len(uuids) else None
        elif token.startswith("GPU-") and len(token) > len("GPU-"):
            uuid = _by_prefix(token, uuids)
        else:
            uuid = token if token in lease.fds else None
        if uuid is None or uuid in kept:
            break
        kept.append(uuid)
    return lease.part(kept) if kept else None


def obtain(root: str, prog: str, settings: Settings, environ: Any,
           count: Optional[int] = None, layout: bool = True) -> Grant:
    """Lease devices for one run under SETTINGS.

    LAYOUT: whether sync's device layout may stand in for an enumeration (no monitor)."""
    value = settings.values()
    count = value["gpus"] if count is None else count
    lease_dir = loc.under(root, loc.LEASE_DIR)
    preset = environ.get(CVD)
    grant = _inherited_grant(lease_dir, environ.get(LEASE_ENV), preset)
    if grant is not None:
        return grant
    job = None
    if environ.get("SLURM_JOB_ID"):  # within_job's own test: outside Slurm, slurm is not imported
        from .devices.slurm import within_job

        job = within_job(environ)
    grant = _grant_without_lease(prog, job, preset)
    if grant is not None:
        return grant

    from .policy.effective import check_count

    check_count(settings, count)
    from .lease.sharing import of_run

    sharing, share = of_run(value, count)
    # Under [service] enforce a user cannot open the lease files: the service alone grants,
    # shares too (root still may decide for itself, so a stopped service never locks the
    # admin out). Without it, shared runs decide for themselves.
    enforced = bool(value.get("enforce")) and os.geteuid() != 0
    if enforced or (job is None and not share and os.path.exists(loc.under(root, loc.SERVICE_SOCKET))):
        served = _from_service(root, prog, value, environ, count, job, enforced)
        if served is not None:
            return served

    return _Run(root, prog, settings, environ, count, sharing, share).take(job, preset, layout)


def _inherited_grant(lease_dir: str, marker: Optional[str], preset: Optional[str]) -> Optional[Grant]:
    """A child's grant within the lease its parent passed on (MARKER); None when there is
    none, or the child names devices outside it (leased anew, like any run's)."""
    if not marker:
        return None
    inherited = inherited_lease(lease_dir, marker)
    if inherited is None:
        return None
    if preset is not None and not preset.strip():
        return Grant(None, None)  # the caller asked for no device at all
    narrowed = _narrow_inherited(inherited, preset)
    return Grant(narrowed, ",".join(narrowed.uuids)) if narrowed is not None else None


def _grant_without_lease(prog: str, job: Any, preset: Optional[str]) -> Optional[Grant]:
    """The grant of a run that takes no lease (a Slurm job's shard, or no GPU; no device
    asked for); None for a run that does."""
    if job is not None and job.shares:
        return Grant(None, None)  # a --gres=shard job: Slurm shares this GPU; a lease would serialise
    if job is not None and job.has_no_gpu:
        say(prog, f"Slurm job {job.job_id} has no GPU: running without a device (submit with --gres=gpu:N)")
        return Grant(None, "")
    if preset is not None and not preset.strip():
        return Grant(None, None)  # the caller asked for no device at all
    return None


def _device_source(root: str, prog: str, value: Dict[str, Any], lease_dir: str, layout: bool) -> Any:
    """Where this launch reads the machine from (devices/source.py); None when NVML is
    unusable, no_driver allows that and there are no lease files: no lease at all."""
    from .devices.source import GenericSource, choose

    try:
        return choose(root, layout)
    except NvmlUnavailable as exc:
        if value["no_driver"] == "fail":
            raise
        from .lease.files import lease_file_inventory

        # The lease files root made still name the devices (NVML may be broken only for
        # us, a driver upgraded under a loaded module): one lease each, by UUID, rather
        # than every run on device 0.
        inventory = lease_file_inventory(lease_dir)
        audit.log("no-driver", "warning", program=prog, pid=os.getpid(), reason=str(exc))
        if inventory is None:
            say(prog, f"warning: {exc}; running without a device lease")
            return None
        say(prog, f"warning: {exc}; leasing by the lease files alone (processes on the devices unseen)")
        return GenericSource(inventory)


class _Run:
    """One run's lease being taken: its candidates on the machine its source reads, the
    acquirer and its wait, the grant."""

    def __init__(self, root: str, prog: str, settings: Settings, environ: Any, count: int,
                 sharing: Any, share: bool) -> None:
        self.root, self.prog, self.settings, self.environ = root, prog, settings, environ
        self.value = settings.values()
        self.count, self.sharing, self.share = count, sharing, share
        self.waited = False

    def take(self, job: Any, preset: Optional[str], layout: bool) -> Grant:
        """Read the machine, narrow it to this run's candidates, and lease them."""
        from .policy.effective import UNFILTERED
        from .sched.candidates import allow_list, usable, without_drained

        root, prog, value, count = self.root, self.prog, self.value, self.count
        lease_dir = loc.under(root, loc.LEASE_DIR)
        allow = allow_list(value)
        order = self.environ.get("CUDA_DEVICE_ORDER")
        # What the filters (filters.py, imported only when one is set) need of the devices' usage.
        min_free_mib = value.get("min_free_memory_mib", UNFILTERED["min_free_memory_mib"])
        max_util = value.get("max_utilization", UNFILTERED["max_utilization"])
        # Slurm's indices need the GPUs, a free-memory floor every device's memory (and a retry
        # without the layout, every device NVML has now): the layout only otherwise.
        source = _device_source(root, prog, value, lease_dir, layout and job is None and min_free_mib <= 0)
        if source is None:
            return Grant(None, None)
        inventory, unread = source.inventory(), source.unread
        checked_at = time.monotonic()
        if job is not None:
            from .sched.selection import PCI_ORDER

            slurm_visible = job.visible({g.index for g in inventory.gpus})
            if slurm_visible is not None:
                preset, order = slurm_visible, PCI_ORDER  # Slurm's indices: its numbering, not CUDA's
                if not preset.strip():
                    return Grant(None, None)
        try:
            candidates = usable(inventory, value, allow, preset, count, order)
        except CudawrapError:
            if not unread:
                raise
            # Perhaps the layout's fault (MIG reconfigured since the last sync): NVML decides.
            from .devices.source import NvmlSource

            inventory, unread = NvmlSource.read().inventory(), False
            candidates = usable(inventory, value, allow, preset, count, order)
        candidates = without_drained(root, candidates, count)
        if max_util < 100 and not any(d.utilization is not None for d in inventory.devices):
            from .devices import nvml

            try:  # the snapshot and the lean inventory skip utilisation: read it for this filter
                inventory, unread = nvml.inventory(utilization=True), False
            except NvmlUnavailable:
                pass
        return self.lease(source, inventory, unread, candidates, checked_at)

    def lease(self, source: Any, inventory: Any, unread: bool, candidates: List[Any], checked_at: float) -> Grant:
        """Wait for and take CANDIDATES' devices; the grant."""
        from .sched.candidates import limits_of, synced
        from .sched.run import acquire

        root, value, count = self.root, self.value, self.count
        limits = limits_of(value, count, os.geteuid())
        lease_dir = loc.under(root, loc.LEASE_DIR)
        leases = LeaseFiles(lease_dir, loc.under(root, loc.SHARE_DIR))
        candidates = synced(candidates, leases, lease_dir, count)
        acquirer = self._acquirer(leases, source, inventory, unread, candidates, checked_at, limits)
        info = f"uid={os.getuid()}\npid={os.getpid()}\ncount={count}\nprogram={self.prog}\n".encode()
        start = time.monotonic()
        try:
            lease = acquire(acquirer, value["wait"], info, self.on_wait)
        except NoDeviceError as exc:
            from .sched.decision import Cancelled

            if unread and acquirer.lost_on_arrival and not isinstance(exc, Cancelled):
                # A device of the layout is gone (a MIG instance destroyed since the last sync):
                # the layout is out of date, so decide again from NVML's enumeration, which
                # also says when the devices there now need `cudawrap sync`.
                leases.close()
                return obtain(root, self.prog, self.settings, self.environ, count, layout=False)
            audit.log("timeout", "warning", program=self.prog, pid=os.getpid(), reason=str(exc))
            raise
        waited_s = time.monotonic() - start
        audit.log("grant", program=self.prog, pid=os.getpid(), devices=",".join(lease.uuids),
                  **({"shared": ",".join(lease.shared)} if lease.shared else {}),
                  wait=f"{waited_s:.3f}s")
        if self.waited:
            say(self.prog, f"got {','.join(lease.uuids)} after {waited_s:.1f} s")
        return self.grant(lease, acquirer)

    def _acquirer(self, leases: LeaseFiles, source: Any, inventory: Any, unread: bool, candidates: List[Any],
                  checked_at: float, limits: Dict[str, Any]) -> Any:
        from .policy.effective import queue_bounds
        from .sched.acquirer import Acquirer
        from .sched.request import Request
        from .sched.candidates import drained_now
        from .sched.queue import WaitQueue

        root, value = self.root, self.value
        limit_of = None
        if limits:
            from .policy.limits import limit_for

            limit_of = lambda uid: limit_for(uid, limits)  # noqa: E731 - one call, bound here
        return Acquirer(
            leases, WaitQueue(loc.under(root, loc.QUEUE_DIR)), candidates, inventory.devices,
            Request.of(value, self.count, self.share), foreign=value["foreign"],
            busy_memory_mib=value["busy_memory_mib"], refresh=source.refresh, checked_at=checked_at,
            limit_of=limit_of, drained=drained_now(root, inventory), sharing=self.sharing,
            unread=[d.uuid for d in candidates] if unread else (), root=root,
            snapshot=source.snapshot, admin=lambda: queue_bounds(root))

    def on_wait(self, text: str) -> None:
        from .sched.acquirer import describe_wait

        self.waited = True
        say(self.prog, describe_wait(text))
        audit.log("wait", program=self.prog, pid=os.getpid(), reason=text, count=self.count)

    def grant(self, lease: Lease, acquirer: Any) -> Grant:
        """LEASE's grant: a shared run's memory limit, MPS variables and frameworks' defaults."""
        extra, defaults = self.sharing.run_env(self.root, lease.shared, acquirer.current, acquirer.slots,
                                               self.settings.memory_limit_mib)
        return _whole_devices(self.root, lease, self.environ, extra, defaults)


def _whole_devices(root: str, lease: Lease, environ: Any, extra: Optional[Dict[bytes, bytes]] = None,
                   defaults: Optional[Dict[bytes, bytes]] = None) -> Grant:
    """The Grant of LEASE with a share's variables (EXTRA, and DEFAULTS where the caller has
    none; sharing.run_env), and a shared run's MPS variables dropped for whole devices."""
    grant = Grant(lease, ",".join(lease.uuids), extra)
    if defaults is not None:
        grant.defaults = defaults
    mps_dir = loc.under(root, loc.MPS_DIR) + "/"
    if not lease.shared and environ.get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(mps_dir):
        # A whole device bypasses MPS: a client of a device's daemon (a shared run's
        # environment passed on) must not be sent to a daemon of a device it does not use.
        grant.drop = (b"CUDA_MPS_PIPE_DIRECTORY", b"CUDA_MPS_LOG_DIRECTORY",
                      b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    return grant


def _from_service(root: str, prog: str, value: Dict[str, Any], environ: Any, count: int, job: Any = None,
                  enforced: bool = False) -> Optional[Grant]:
    """Devices (or shares) granted by `cudawrap serve` (README "The cudawrap service"); None
    when it does not answer, and the run decides for itself as without it. ENFORCED: it
    cannot; the service is tried again for connect_retry_s (a restart), then ServiceUnavailable."""
    from . import client

    def on_wait(text: str) -> None:
        say(prog, text)

    fields = client.request_fields(value, environ, count)
    if job is not None:
        devices = _job_devices(job)
        if devices is not None:
            fields["visible"] = devices
    if not enforced:
        granted = client.obtain(root, fields, on_wait)
    else:
        granted = client.obtain_retrying(root, fields, on_wait, float(value.get("connect_retry_s", 10.0)))
    if granted is None:
        return None
    lease = granted.lease
    audit.log("grant", program=prog, pid=os.getpid(), devices=",".join(lease.uuids),
              **({"shared": ",".join(lease.shared)} if lease.shared else {}), via="service")
    return _whole_devices(root, lease, environ, granted.extra, granted.defaults)


def _job_devices(job: Any) -> Optional[str]:
    """The UUIDs of a Slurm job's GPUs, as the service is asked to narrow to them; None
    where Slurm's variables do not say (CUDA_VISIBLE_DEVICES narrows, as for any run).
    Slurm numbers GPUs in NVML's (PCI) order: NVML is read to name them."""
    from .devices import nvml
    from .devices.slurm import uuids_of

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


def run_shim(root: str, argv: List[str], link: Optional[str] = None) -> NoReturn:
    """Run the program wrapped at LINK (baked into its own shim); without LINK (the shared
    shim that links made before per-program shims lead to), find it from how we were invoked."""
    from .policy.effective import effective

    if not argv or not argv[0]:
        raise UsageError("started without a program name")
    invoked = argv[0]
    if link is None:
        shim = loc.under(root, loc.SHIM)
        link = find_link(invoked, shim)
    else:
        shim = os.path.realpath(invoked)  # the script the kernel ran: this program's own shim
    prog = os.path.basename(link)
    real = real_program(link, shim, root)
    settings = effective(root, os.path.abspath(link))
    grant = obtain(root, prog, settings, os.environ)
    grant.program = prog
    if os.environ.get("CUDAWRAP_VERBOSE"):
        say(prog, f"{CVD}={grant.visible if grant.visible is not None else '(unchanged)'} -> {real}")
    if not os.path.lexists(real):
        real = _unwrapped_meanwhile(link, shim, root) or real
    exec_program(real, [invoked] + argv[1:], grant.apply(original_environ()), grant)


def _unwrapped_meanwhile(link: str, shim: str, root: str) -> Optional[str]:
    """LINK itself if an unwrap put the real program back there while we were starting or waiting."""
    try:
        st = os.stat(link)
    except OSError:
        return None
    try:
        shim_st = os.stat(shim)
        if (st.st_dev, st.st_ino) == (shim_st.st_dev, shim_st.st_ino):
            return None
    except OSError:
        pass  # the unwrap removed the program's own shim
    return None if _is_shim(link, root) else link


def main(root: str, link: Optional[str] = None) -> NoReturn:
    """The shim's entry point: errors become one line and the documented exit code."""
    argv = sys.argv
    prog = os.path.basename(link or (argv[0] if argv and argv[0] else "cudawrap"))
    try:
        run_shim(root, argv, link)
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
