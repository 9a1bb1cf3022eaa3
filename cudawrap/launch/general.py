"""The general launch: find the real program, lease devices, exec it unchanged but for CUDA_VISIBLE_DEVICES.

Every case: a lease inherited from a wrapped parent, a Slurm job, the service asked with
the settings read here, or no service and the run deciding for itself; and every error,
said in one line. The shim comes here when its fast path (launch/__init__.py) cannot serve
the run; `cudawrap run` and the API lease through obtain(). On the shim's path, so it
imports only what it needs, lazily, and never plumbum, pathlib, typing or dataclasses.
"""
from __future__ import annotations

import os
import sys
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, List, NoReturn, Optional

    from ..policy.effective import Settings

from ..base import audit
from .. import locations as loc
from ..base.program import CVD, Grant, exec_program, find_link, real_program, unwrapped_meanwhile, whole_devices
from ..errors import CudawrapError, NoDeviceError, NvmlUnavailable, UsageError
from ..lease.files import LEASE_ENV, Lease, LeaseFiles, inherited_lease
from . import original_environ, say  # the shim's fast path loaded them already


def _narrow_inherited(lease: Lease, preset: Optional[str]) -> Optional[Lease]:
    """The part of an inherited LEASE that the caller's CUDA_VISIBLE_DEVICES names.

    The child lives in its parent's devices: an index counts in the parent's list (the
    order the parent was given them), a UUID (or a unique GPU- prefix) must be one of them,
    and, as in CUDA, the first entry that is neither, or repeats one, ends the list. Unset
    keeps the whole lease; None when nothing of the lease is named (set but empty: no device).
    """
    if preset is None:
        return lease
    from ..sched.selection import _by_prefix

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
           count: Optional[int] = None, layout: bool = True, ticket: str = "") -> Grant:
    """Lease devices for one run under SETTINGS.

    LAYOUT: whether sync's device layout may stand in for an enumeration (no monitor).
    TICKET: the place in the service's line a wait before this one was given (wire.py)."""
    value = settings.values()
    count = value["gpus"] if count is None else count
    lease_dir = loc.under(root, loc.LEASE_DIR)
    preset = environ.get(CVD)
    grant = _inherited_grant(lease_dir, environ.get(LEASE_ENV), preset)
    if grant is not None:
        return grant
    job = None
    if environ.get("SLURM_JOB_ID"):  # within_job's own test: outside Slurm, slurm is not imported
        from ..devices.slurm import within_job

        job = within_job(environ)
    grant = _grant_without_lease(prog, job, preset)
    if grant is not None:
        return grant

    from ..policy.effective import check_count

    check_count(settings, count)
    from ..lease.sharing import of_run

    sharing, share = of_run(value, count)
    # Under [service] enforce a user cannot open the lease files: the service alone grants,
    # shares too (root still may decide for itself, so a stopped service never locks the
    # admin out). Without it, shared runs decide for themselves.
    enforced = bool(value.get("enforce")) and os.geteuid() != 0
    if enforced or (job is None and not share and os.path.exists(loc.under(root, loc.SERVICE_SOCKET))):
        served = _from_service(root, prog, value, environ, count, job, enforced, ticket)
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
    from ..devices.source import GenericSource, choose

    try:
        return choose(root, layout)
    except NvmlUnavailable as exc:
        if value["no_driver"] == "fail":
            raise
        from ..lease.files import lease_file_inventory

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
        from ..policy.effective import UNFILTERED
        from ..sched.candidates import allow_list, usable, without_drained

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
            from ..sched.selection import PCI_ORDER

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
            from ..devices.source import NvmlSource

            inventory, unread = NvmlSource.read().inventory(), False
            candidates = usable(inventory, value, allow, preset, count, order)
        candidates = without_drained(root, candidates, count)
        if max_util < 100 and not any(d.utilization is not None for d in inventory.devices):
            from ..devices import nvml

            try:  # the snapshot and the lean inventory skip utilisation: read it for this filter
                inventory, unread = nvml.inventory(utilization=True), False
            except NvmlUnavailable:
                pass
        return self.lease(source, inventory, unread, candidates, checked_at)

    def lease(self, source: Any, inventory: Any, unread: bool, candidates: List[Any], checked_at: float) -> Grant:
        """Wait for and take CANDIDATES' devices; the grant."""
        from ..sched.acquirer import Queued
        from ..sched.candidates import limits_of, synced

        root, value, count = self.root, self.value, self.count
        limits = limits_of(value, count, os.geteuid())
        lease_dir = loc.under(root, loc.LEASE_DIR)
        leases = LeaseFiles(lease_dir, loc.under(root, loc.SHARE_DIR))
        candidates = synced(candidates, leases, lease_dir, count)
        acquirer = self._acquirer(leases, source, inventory, unread, candidates, checked_at, limits)
        info = f"uid={os.getuid()}\npid={os.getpid()}\ncount={count}\nprogram={self.prog}\n".encode()
        start = time.monotonic()
        try:
            lease = acquirer.arrive(value["wait"], info)
            if isinstance(lease, Queued):  # its turn is not now: it waits (sched/run.py, loaded only then)
                from ..sched.run import wait_in_line

                lease = wait_in_line(acquirer, lease, self.on_wait)
        except NoDeviceError as exc:
            from ..sched.decision import Cancelled

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
        from ..policy.effective import queue_bounds
        from ..sched.acquirer import Acquirer
        from ..sched.request import Request
        from ..sched.candidates import drained_now
        from ..sched.queue import WaitQueue

        root, value = self.root, self.value
        limit_of = None
        if limits:
            from ..policy.limits import limit_for

            limit_of = lambda uid: limit_for(uid, limits)  # noqa: E731 - one call, bound here
        return Acquirer(
            leases, WaitQueue(loc.under(root, loc.QUEUE_DIR)), candidates, inventory.devices,
            Request.of(value, self.count, self.share), foreign=value["foreign"],
            busy_memory_mib=value["busy_memory_mib"], refresh=source.refresh, checked_at=checked_at,
            limit_of=limit_of, drained=drained_now(root, inventory), sharing=self.sharing,
            unread=[d.uuid for d in candidates] if unread else (), root=root,
            snapshot=source.snapshot, admin=lambda: queue_bounds(root))

    def on_wait(self, text: str) -> None:
        from ..sched.acquirer import describe_wait

        self.waited = True
        say(self.prog, describe_wait(text))
        audit.log("wait", program=self.prog, pid=os.getpid(), reason=text, count=self.count)

    def grant(self, lease: Lease, acquirer: Any) -> Grant:
        """LEASE's grant: a shared run's memory limit, MPS variables and frameworks' defaults."""
        extra, defaults = self.sharing.run_env(self.root, lease.shared, acquirer.current, acquirer.slots,
                                               self.settings.memory_limit_mib)
        return whole_devices(self.root, lease, self.environ, extra, defaults)


def _from_service(root: str, prog: str, value: Dict[str, Any], environ: Any, count: int, job: Any = None,
                  enforced: bool = False, ticket: str = "") -> Optional[Grant]:
    """Devices (or shares) granted by `cudawrap serve` (README "The cudawrap service"); None
    when it does not answer, and the run decides for itself as without it. ENFORCED: it
    cannot; the service is tried again for connect_retry_s (a restart), then ServiceUnavailable."""
    from .. import client

    def on_wait(text: str) -> None:
        say(prog, text)

    fields = client.request_fields(value, environ, count)
    if ticket:
        fields["ticket"] = ticket
    if job is not None:
        devices = _job_devices(job)
        if devices is not None:
            fields["visible"] = devices
    if not enforced:
        granted = client.ask(root, fields, on_wait)
    else:
        granted = client.ask_retrying(root, fields, on_wait, float(value.get("connect_retry_s", 10.0)))
    if granted is None:
        return None
    # The service writes the grant's audit line (and its ledger record) itself.
    return whole_devices(root, granted.lease, environ, granted.extra, granted.defaults)


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


def run_shim(root: str, argv: List[str], link: Optional[str] = None, ticket: str = "") -> NoReturn:
    """Run the program wrapped at LINK (baked into its own shim); without LINK (the shared
    shim that links made before per-program shims lead to), find it from how we were invoked."""
    from ..policy.effective import effective

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
    grant = obtain(root, prog, settings, os.environ, ticket=ticket)
    grant.program = prog
    if os.environ.get("CUDAWRAP_VERBOSE"):
        say(prog, f"{CVD}={grant.visible if grant.visible is not None else '(unchanged)'} -> {real}")
    if not os.path.lexists(real):
        real = unwrapped_meanwhile(link, shim, root) or real
    exec_program(real, [invoked] + argv[1:], grant.apply(original_environ()), grant)


def main(root: str, link: Optional[str] = None, ticket: str = "") -> NoReturn:
    """The shim's general way (launch/__init__.py: TICKET, a place in the service's line a
    wait there was given): errors become one line and the documented exit code."""
    argv = sys.argv
    _guarded(os.path.basename(link or (argv[0] if argv and argv[0] else "cudawrap")),
             lambda: run_shim(root, argv, link, ticket))


def fail(prog: str, message: str, hint: Optional[str], exit_code: int) -> NoReturn:
    """Report a refusal the service sent to the fast path as this way reports its own errors."""
    error = (NoDeviceError if exit_code == NoDeviceError.exit_code else CudawrapError)(message, hint)
    error.exit_code = exit_code
    _guarded(prog, lambda: _raise(error))


def _raise(error: CudawrapError) -> NoReturn:
    raise error


def exec_failed(root: str, link: str, real: str, argv: List[str], env: Dict[bytes, bytes],
                exc: OSError) -> NoReturn:
    """The fast path's exec of REAL failed with EXC: run the program where an unwrap put it
    back meanwhile, else say why, as exec_program says it (the lease's descriptors are
    inheritable already)."""
    def again() -> NoReturn:
        path = real
        if isinstance(exc, FileNotFoundError):
            path = unwrapped_meanwhile(link, os.path.realpath(argv[0]), root) or real
        exec_program(path, argv, env, Grant(None, None))

    _guarded(os.path.basename(link), again)


def _guarded(prog: str, run: Any) -> NoReturn:
    """RUN (which execs or raises); a CudawrapError becomes one line (and its hint) and its exit status."""
    try:
        run()
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
    os._exit(os.EX_SOFTWARE)  # RUN returned: it must not
