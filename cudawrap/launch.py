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

    from .devices.model import Device

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


def _unchanged(device: Device) -> Device:
    """Re-reading a device nothing is known of (no NVML): it stays as it was."""
    return device


def _candidates(inventory: Any, value: Dict[str, Any], allow: List[str], preset: Optional[str],
                count: int, order: Optional[str] = None) -> List[Any]:
    """The devices of INVENTORY this run may be given; NoDeviceError if fewer than COUNT.

    Narrowed by the allow-list, CUDA_VISIBLE_DEVICES (read in ORDER, as CUDA will) and the
    filters that can never change (model, memory in all); free memory and utilisation
    change as jobs end, and the scheduler judges them at every decision.
    """
    from .policy.effective import filtered

    candidates = list(inventory.devices)
    if allow:
        from .sched.selection import allowed

        candidates = allowed(candidates, allow)
    if preset is not None:
        from .devices import nvml
        from .sched.selection import parse_visible

        visible = parse_visible(preset, inventory, order, nvml.mig_by_ids)
        candidates = [d for d in candidates if d in visible]
    why = " (narrowed by CUDA_VISIBLE_DEVICES)" if preset is not None else (
        " (narrowed by the allow-list)" if allow else "")
    if filtered(value) and candidates:
        from .sched.filters import Request, explain, split

        request = Request.from_settings(value, count)
        kept, _why_not = split(request, candidates, inventory)
        if len(kept) < count:
            raise NoDeviceError(explain(request, candidates, inventory),
                                hint="`cudawrap status` lists the devices; `cudawrap config` the filters")
        candidates = kept
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
    return candidates


def _read_nvml(root: str) -> Tuple[Any, bool]:
    """(inventory, whether its devices' usage is unread) for a launch without the monitor.

    The layout `cudawrap sync` saw, if it still matches the machine: its devices are read
    from NVML one by one, as the launch is about to take them (the acquirer re-reads a
    "stale" device before judging it), so a launch on 56 MIG instances reads one or two of
    them, not all. The whole machine, enumerated, if there is no layout or it is out of date.
    """
    from .devices import invcache, nvml

    layout = invcache.read(root)
    if layout is not None and nvml.matches(layout):
        return layout, True
    return nvml.inventory(direct=True), False  # ctypes, not pynvml: see nvmldirect


def _drains(root: str) -> Dict[str, Any]:
    """The admin's drains (uuid -> Drain); drains.py is imported only when there are some."""
    if not os.path.exists(loc.under(root, loc.DRAINS)):
        return {}
    from .sched.drains import drained

    return drained(root)


def obtain(root: str, prog: str, settings: Dict[str, Any], environ: Any,
           count: Optional[int] = None, layout: bool = True) -> Grant:
    """Lease devices for one run under SETTINGS (key -> (value, source)).

    LAYOUT: whether sync's device layout may stand in for an enumeration (no monitor)."""
    value = {k: v for k, (v, _src) in settings.items()}
    count = value["gpus"] if count is None else count
    lease_dir = loc.under(root, loc.LEASE_DIR)
    preset = environ.get(CVD)

    marker = environ.get(LEASE_ENV)
    if marker:
        inherited = inherited_lease(lease_dir, marker)
        if inherited is not None:
            if preset is not None and not preset.strip():
                return Grant(None, None)  # the caller asked for no device at all
            narrowed = _narrow_inherited(inherited, preset)
            if narrowed is not None:
                return Grant(narrowed, ",".join(narrowed.uuids))
            # Devices outside the parent's lease: leased anew, like any run's.

    job = None
    if environ.get("SLURM_JOB_ID"):  # within_job's own test: outside Slurm, slurm is not imported
        from .devices.slurm import within_job

        job = within_job(environ)
    if job is not None and job.shares:
        return Grant(None, None)  # a --gres=shard job: Slurm shares this GPU; a lease would serialise
    if job is not None and job.has_no_gpu:
        say(prog, f"Slurm job {job.job_id} has no GPU: running without a device (submit with --gres=gpu:N)")
        return Grant(None, "")
    if preset is not None and not preset.strip():
        return Grant(None, None)  # the caller asked for no device at all

    from .policy.effective import check_count, queue_bounds

    check_count(settings, count)
    from .lease.sharing import MPS, Sharing, framework_env

    sharing = Sharing(value.get("sharing"))
    share = bool(value.get("share")) and sharing.anywhere
    if share and sharing.mode == MPS and count > 1:
        raise NoDeviceError(f"{count} devices asked for as a shared run, but an MPS client uses one device",
                            hint="ask for one device (CUDAWRAP_GPUS=1), or run without sharing")

    if job is None and not share and os.path.exists(loc.under(root, loc.SERVICE_SOCKET)):
        leased = _from_service(root, prog, value, environ, count)
        if leased is not None:
            return _whole_devices(root, leased, environ)

    from .policy.effective import UNFILTERED
    from .devices.snapshot import SnapshotRefresh, read_fresh

    allow = list(value["allow"])
    if value["allow_file"]:
        from .sched.selection import read_allow_file

        allow += read_allow_file(value["allow_file"])
    order = environ.get("CUDA_DEVICE_ORDER")
    # What the filters (filters.py, imported only when one is set) need of the devices' usage.
    min_free_mib = value.get("min_free_memory_mib", UNFILTERED["min_free_memory_mib"])
    max_util = value.get("max_utilization", UNFILTERED["max_utilization"])

    inventory = read_fresh(root)  # kept by `cudawrap monitor`; spares us NVML
    unread = False
    try:
        if inventory is not None:
            refresh = SnapshotRefresh(root)
        else:
            from .devices import nvml

            refresh = nvml.refresh
            if layout and job is None and min_free_mib <= 0:
                inventory, unread = _read_nvml(root)
            else:
                # Slurm's indices need the GPUs, a free-memory floor every device's memory
                # (and a retry without the layout, every device NVML has now)
                inventory = nvml.inventory(direct=True)
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
            return Grant(None, None)
        say(prog, f"warning: {exc}; leasing by the lease files alone (processes on the devices unseen)")
        refresh = _unchanged
    checked_at = time.monotonic()
    if job is not None:
        from .sched.selection import PCI_ORDER

        slurm_visible = job.visible({g.index for g in inventory.gpus})
        if slurm_visible is not None:
            preset, order = slurm_visible, PCI_ORDER  # Slurm's indices: its numbering, not CUDA's
            if not preset.strip():
                return Grant(None, None)
    try:
        candidates = _candidates(inventory, value, allow, preset, count, order)
    except CudawrapError:
        if not unread:
            raise
        # Perhaps the layout's fault (MIG reconfigured since the last sync): NVML decides.
        from .devices import nvml

        inventory, unread = nvml.inventory(direct=True), False
        candidates = _candidates(inventory, value, allow, preset, count, order)
    drains = _drains(root)
    usable = candidates
    if drains:  # an admin's `cudawrap drain`: no new lease there
        from .sched.drains import undrained

        usable = undrained(candidates, drains)
    if len(usable) < count:
        names = ", ".join(d.uuid for d in candidates if d not in usable)
        raise NoDeviceError(f"{count} device{'s' if count > 1 else ''} asked for, but {names} "
                            f"{'is' if len(candidates) - len(usable) == 1 else 'are'} drained by an admin "
                            f"and only {len(usable)} can be used now",
                            hint="`cudawrap status` says why and since when; try again after `cudawrap resume`")
    candidates = usable

    def drained_now() -> Any:  # re-read at every decision: a drain made while runs wait
        drains = _drains(root)
        if not drains:
            return ()
        from .sched.drains import covering

        return {d.uuid for d in inventory.devices if covering(drains, d.uuid, d.parent_uuid)}
    if max_util < 100 and not any(d.utilization is not None for d in inventory.devices):
        from .devices import nvml

        try:  # the snapshot and the lean inventory skip utilisation: read it for this filter
            inventory, unread = nvml.inventory(utilization=True), False
        except NvmlUnavailable:
            pass

    from .sched.acquirer import Acquirer, Cancelled, describe_wait
    from .sched.queue import WaitQueue

    limits = value.get("limits") or {}
    if not (limits.get("users") or limits.get("groups") or limits.get("default", (0, ""))[0]):
        limits = {}  # no [limits] configured: limits.py is not imported
    my_limit = 0
    if limits:
        from .policy.limits import limit_for

        my_limit = limit_for(os.geteuid(), limits)
    if my_limit and count > my_limit:
        raise NoDeviceError(f"{count} devices asked for, but your limit is {my_limit} at once",
                            hint="ask for fewer devices, or ask an admin (`cudawrap config` shows the limits)")
    leases = LeaseFiles(lease_dir, loc.under(root, loc.SHARE_DIR))
    # A device without a lease file (appeared since the last sync) can never be leased:
    # leave it out rather than wait for it forever. One listing: the files are opened only
    # as their devices are tried.
    present = leases.names()
    unsynced = [d for d in candidates if d.uuid not in present]
    if len(candidates) - len(unsynced) < count:
        from .errors import SetupError
        from .lease.files import SYNC_HINT

        raise SetupError(f"{len(unsynced)} of the usable devices have no lease file in {lease_dir}",
                         hint=SYNC_HINT)
    candidates = [d for d in candidates if d not in unsynced]
    queue = WaitQueue(loc.under(root, loc.QUEUE_DIR))
    acquirer = Acquirer(
        leases, queue, candidates, inventory.devices, count,
        placement=value["placement"], foreign=value["foreign"],
        busy_memory_mib=value["busy_memory_mib"], refresh=refresh, checked_at=checked_at,
        reserve_after=value.get("reserve_after", 300.0),
        limit_of=(lambda uid: limit_for(uid, limits)) if limits else None,
        min_free_mib=min_free_mib, max_util=max_util,
        drained=drained_now, share=share, sharing=sharing,
        unread=[d.uuid for d in candidates] if unread else (), root=root,
        snapshot=loc.under(root, loc.USAGE_SNAPSHOT) if isinstance(refresh, SnapshotRefresh) else None,
        admin=lambda: queue_bounds(root))
    wait_s = value["wait"]
    info = f"uid={os.getuid()}\npid={os.getpid()}\ncount={count}\nprogram={prog}\n".encode()
    waited = {"yes": False}

    def on_wait(text: str) -> None:
        waited["yes"] = True
        say(prog, describe_wait(text))
        audit.log("wait", program=prog, pid=os.getpid(), reason=text, count=count)

    start = time.monotonic()
    try:
        lease = acquirer.acquire(wait_s, info, on_wait)
    except NoDeviceError as exc:
        if unread and acquirer.lost_on_arrival and not isinstance(exc, Cancelled):
            # A device of the layout is gone (a MIG instance destroyed since the last sync):
            # the layout is out of date, so decide again from NVML's enumeration, which
            # also says when the devices there now need `cudawrap sync`.
            leases.close()
            return obtain(root, prog, settings, environ, count, layout=False)
        audit.log("timeout", "warning", program=prog, pid=os.getpid(), reason=str(exc))
        raise
    waited_s = time.monotonic() - start
    audit.log("grant", program=prog, pid=os.getpid(), devices=",".join(lease.uuids),
              **({"shared": ",".join(lease.shared)} if lease.shared else {}),
              wait=f"{waited_s:.3f}s")
    if waited["yes"]:
        say(prog, f"got {','.join(lease.uuids)} after {waited_s:.1f} s")
    extra: Dict[bytes, bytes] = {}
    fractions = []
    for uuid in lease.shared:
        device = acquirer.current[uuid]
        total = device.memory_total_mib or None
        limit = sharing.limit_mib(uuid, device.parent_uuid, acquirer.slots[uuid], total,
                                  settings.get("memory_limit_mib", (None,))[0])
        if limit and total:
            fractions.append(min(limit / total, 1.0))
        if sharing.mode == MPS:
            extra = sharing.mps_env(root, uuid, acquirer.slots[uuid], total, limit)
    grant = _whole_devices(root, lease, environ, extra)
    if fractions:
        grant.defaults = framework_env(min(fractions))
    return grant


def _whole_devices(root: str, lease: Lease, environ: Any, extra: Optional[Dict[bytes, bytes]] = None) -> Grant:
    """The Grant of LEASE, with a shared run's MPS variables dropped for whole devices."""
    grant = Grant(lease, ",".join(lease.uuids), extra)
    mps_dir = loc.under(root, loc.MPS_DIR) + "/"
    if not lease.shared and environ.get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(mps_dir):
        # A whole device bypasses MPS: a client of a device's daemon (a shared run's
        # environment passed on) must not be sent to a daemon of a device it does not use.
        grant.drop = (b"CUDA_MPS_PIPE_DIRECTORY", b"CUDA_MPS_LOG_DIRECTORY",
                      b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    return grant


def _from_service(root: str, prog: str, value: Dict[str, Any], environ: Any, count: int) -> Optional[Lease]:
    """Devices granted by `cudawrap serve` (README "The cudawrap service"); None when it
    does not answer, and the run decides for itself as without it."""
    from . import client

    def on_wait(text: str) -> None:
        say(prog, text)

    lease = client.obtain(root, client.request_fields(value, environ, count), on_wait)
    if lease is not None:
        audit.log("grant", program=prog, pid=os.getpid(), devices=",".join(lease.uuids), via="service")
    return lease


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
