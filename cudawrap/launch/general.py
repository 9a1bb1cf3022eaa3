"""The general launch: find the real program, lease devices, exec it unchanged but for CUDA_VISIBLE_DEVICES.

Every case: a lease inherited from a wrapped parent, a Slurm job, the service asked with
the settings read here (those two in inherited.py and client.py), or no service and the run deciding for
itself; and every error, said in one line (failures.py, loaded only then). The wrapped program itself is
here too: the real program beside the name it was reached by (links.py finds that name for the shared
shim), and becoming it (exec, same pid) with what it was granted (Grant). The shim comes here when its
fast path (cudawrap/__init__.py) cannot serve the run; `cudawrap run` and the API lease through
obtain(). On the shim's path, so it imports only what it needs, lazily, and never plumbum, pathlib,
typing or dataclasses.
"""

import posix
import sys
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, List, NoReturn, Optional, Sequence

    from ..policy.effective import Settings

from ..base import audit, posixos
from ..base.posixos import basename, exists, lexists, link_dir
from .. import locations as loc
from ..errors import CudawrapError, NoDeviceError, NvmlUnavailable, ProgramNotFound, UsageError
from ..lease.files import LEASE_ENV, Lease, LeaseFiles
from .. import original_environ, say  # the shim's fast path (the package) has them loaded already
from . import CVD, Grant, whole_devices  # the door defines them before it imports this module


# ---- the wrapped program: the real one beside the name it was reached by, becoming it ----

def is_shim(path: str, root: str) -> bool:
    """Whether PATH resolves to a shim of the install at ROOT (the prototype or a program's own).

    By identity, links followed: the prototype (or a hard link of it), or a file in the shims'
    directory (the directory PATH's last link leads to, if it is one); resolving whole paths
    costs ~0.05 ms more."""
    ids = [_ident(p) for p in (path, link_dir(path), loc.under(root, loc.SHIM), loc.under(root, loc.SHIM_DIR))]
    return ids[0] is not None and (ids[0] == ids[2] or ids[1] is not None and ids[1] == ids[3])


def _ident(path: str) -> "Optional[tuple]":
    try:
        st = posix.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def real_program(link: str, shim: str, root: str = "") -> str:
    """CUDAWRAP_<name> beside LINK; refuses anything that would lead back to a shim: SHIM
    (the file running now) or, given the install ROOT, any shim of that install."""
    cut = link.rfind("/") + 1
    real = link[:cut] + loc.REAL_PREFIX + link[cut:]
    found = _ident(real)
    if found is None:
        raise ProgramNotFound(f"the real program {real} is missing",
                              hint="ask an admin to run `cudawrap doctor`")
    if found == _ident(shim) or (root and is_shim(real, root)):  # a hard link of the shim too
        raise ProgramNotFound(f"{real} leads back to the shim itself",
                              hint="ask an admin to run `cudawrap doctor --repair`")
    return real


def exec_program(path: str, argv: "Sequence[str]", env: "Dict[bytes, bytes]", grant: "Any") -> "NoReturn":
    """Become the real program: same pid, so signals and exit codes pass through; GRANT's
    lease goes along."""
    import _signal  # `signal` would pull in enum; the C module is enough here

    # Python ignores SIGPIPE and SIGXFSZ, and ignored signals survive exec: without this
    # `wrapped | head` would see EPIPE errors instead of dying quietly as it should.
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(_signal, name):
            _signal.signal(getattr(_signal, name), _signal.SIG_DFL)
    if grant.lease is not None:
        grant.lease.keep_across_exec()
    try:
        posix.execve(path, list(argv), env)
    except OSError as exc:
        from .failures import exec_error

        raise exec_error(path, argv, env, exc) from None


def unwrapped_meanwhile(link: str, shim: str, root: str) -> "Optional[str]":
    """LINK itself if an unwrap put the real program back there while we were starting or waiting."""
    try:
        st = posix.stat(link)
    except OSError:
        return None
    try:
        shim_st = posix.stat(shim)
        if (st.st_dev, st.st_ino) == (shim_st.st_dev, shim_st.st_ino):
            return None
    except OSError:
        pass  # the unwrap removed the program's own shim
    return None if is_shim(link, root) else link


# ---- its devices ---------------------------------------------------------------------------

def obtain(root: str, prog: str, settings: "Settings", environ: "Any",
           count: "Optional[int]" = None, layout: bool = True, ticket: str = "") -> "Grant":
    """Lease devices for one run under SETTINGS.

    LAYOUT: whether sync's device layout may stand in for an enumeration (no monitor).
    TICKET: the place in the service's line a wait before this one was given (wire.py)."""
    value = settings.values()
    count = value["gpus"] if count is None else count
    lease_dir = loc.under(root, loc.LEASE_DIR)
    preset = environ.get(CVD)
    marker = environ.get(LEASE_ENV)
    if marker:
        from .inherited import inherited_devices

        inherited = inherited_devices(lease_dir, marker, preset)
        if inherited is not None:
            return Grant(*inherited)
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
    # Where the service arbitrates (docs/admin/ways.md) every run, shares and Slurm jobs
    # too, is its grant: a user cannot open the lease files, and waits for a service that is
    # restarting; root decides for itself only while it is down, so a stopped service never
    # locks the admin out. Elsewhere an unshared run asks a service that answers.
    arbiter = _service_arbitrates(root, lease_dir)
    must = arbiter and posix.geteuid() != 0
    if must or ((arbiter or (job is None and not share)) and exists(loc.under(root, loc.SERVICE_SOCKET))):
        from .client import from_service

        served = from_service(root, prog, value, environ, count, job, must, ticket)
        if served is not None:
            return whole_devices(root, served.lease, environ, served.extra, served.defaults)

    return _Run(root, prog, settings, environ, count, sharing, share).take(job, preset, layout)


def _service_arbitrates(root: str, lease_dir: str) -> bool:
    """Whether the service is this install's one arbiter: its recorded way (paths.py), or
    a lease directory it made root's alone when it started by hand in a daemonless install."""
    if loc.recorded_way(root) == loc.SERVICE:
        return True
    try:
        return not posix.stat(lease_dir).st_mode & 0o001
    except OSError:
        return False  # no lease directory: the run says so as it decides


def _grant_without_lease(prog: str, job: "Any", preset: "Optional[str]") -> "Optional[Grant]":
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


def _device_source(root: str, prog: str, value: "Dict[str, Any]", lease_dir: str, layout: bool) -> "Any":
    """Where this launch reads the machine from (devices/source.py); None when NVML is
    unusable, no_driver allows that and there are no lease files: no lease at all."""
    from ..devices.source import choose

    try:
        return choose(root, layout)
    except NvmlUnavailable as exc:
        if value["no_driver"] == "fail":
            raise
        from .failures import without_nvml

        return without_nvml(prog, lease_dir, exc)


class _Run:
    """One run's lease being taken: its candidates on the machine its source reads, the
    acquirer and its wait, the grant."""

    def __init__(self, root: str, prog: str, settings: "Settings", environ: "Any", count: int,
                 sharing: "Any", share: bool) -> None:
        self.root, self.prog, self.settings, self.environ = root, prog, settings, environ
        self.value = settings.values()
        self.count, self.sharing, self.share = count, sharing, share
        self.waited = False

    def take(self, job: "Any", preset: "Optional[str]", layout: bool) -> "Grant":
        """Read the machine, narrow it to this run's candidates, and lease them."""
        from ..policy.effective import UNFILTERED
        from ..sched.candidates import allow_list, check_drained, usable

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
        check_drained(root, candidates, count)
        if max_util < 100 and not any(d.utilization is not None for d in inventory.devices):
            from ..devices import nvml

            try:  # the snapshot and the lean inventory skip utilisation: read it for this filter
                inventory, unread = nvml.inventory(utilization=True), False
            except NvmlUnavailable:
                pass
        return self.lease(source, inventory, unread, candidates, checked_at)

    def lease(self, source: "Any", inventory: "Any", unread: bool, candidates: "List[Any]", checked_at: float) -> "Grant":
        """Wait for and take CANDIDATES' devices; the grant."""
        from ..sched.acquirer import Queued
        from ..sched.candidates import limits_of, synced

        root, value, count = self.root, self.value, self.count
        limits = limits_of(value, count, posix.geteuid())
        lease_dir = loc.under(root, loc.LEASE_DIR)
        leases = LeaseFiles(lease_dir, loc.under(root, loc.SHARE_DIR))
        candidates = synced(candidates, leases, lease_dir, count)
        acquirer = self._acquirer(leases, source, inventory, unread, candidates, checked_at, limits)
        info = f"uid={posix.getuid()}\npid={posix.getpid()}\ncount={count}\nprogram={self.prog}\n".encode()
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
            audit.log("timeout", "warning", program=self.prog, pid=posix.getpid(), reason=str(exc))
            raise
        waited_s = time.monotonic() - start
        audit.log("grant", program=self.prog, pid=posix.getpid(), devices=",".join(lease.uuids),
                  **({"shared": ",".join(lease.shared)} if lease.shared else {}),
                  wait=f"{waited_s:.3f}s")
        if self.waited:
            say(self.prog, f"got {','.join(lease.uuids)} after {waited_s:.1f} s")
        return self.grant(lease, acquirer)

    def _acquirer(self, leases: "LeaseFiles", source: "Any", inventory: "Any", unread: bool, candidates: "List[Any]",
                  checked_at: float, limits: "Dict[str, Any]") -> "Any":
        from ..policy.effective import queue_bounds
        from ..sched.acquirer import Acquirer
        from ..sched.machine import ViewOptions
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
            Request.of(value, self.count, self.share), ViewOptions(
                foreign=value["foreign"], busy_memory_mib=value["busy_memory_mib"], refresh=source.refresh,
                checked_at=checked_at, limit_of=limit_of, drained=drained_now(root, inventory),
                sharing=self.sharing, unread=[d.uuid for d in candidates] if unread else (), root=root,
                admin=lambda: queue_bounds(root)),
            snapshot=source.snapshot)

    def on_wait(self, text: str) -> None:
        from ..sched.acquirer import describe_wait

        self.waited = True
        say(self.prog, describe_wait(text))
        audit.log("wait", program=self.prog, pid=posix.getpid(), reason=text, count=self.count)

    def grant(self, lease: "Lease", acquirer: "Any") -> "Grant":
        """LEASE's grant: a shared run's memory limit, MPS variables and frameworks' defaults."""
        extra, defaults = self.sharing.run_env(self.root, lease.shared, acquirer.current, acquirer.slots,
                                               self.settings.memory_limit_mib)
        return whole_devices(self.root, lease, self.environ, extra, defaults)


def run_shim(root: str, argv: "List[str]", link: "Optional[str]" = None, ticket: str = "") -> "NoReturn":
    """Run the program wrapped at LINK (baked into its own shim); without LINK (the shared
    shim that links made before per-program shims lead to), find it from how we were invoked."""
    from ..policy.effective import effective

    if not argv or not argv[0]:
        raise UsageError("started without a program name")
    invoked = argv[0]
    if link is None:
        from .links import find_link

        from posixpath import abspath  # os: the shared shim of older installs only

        shim = loc.under(root, loc.SHIM)
        link = abspath(find_link(invoked, shim))
    else:
        shim = invoked  # the script the kernel ran, through its link: this program's own shim
    prog = basename(link)
    real = real_program(link, shim, root)
    environ = posixos.environ()
    settings = effective(root, link, environ)
    grant = obtain(root, prog, settings, environ, ticket=ticket)
    grant.program = prog
    if environ.get("CUDAWRAP_VERBOSE"):
        say(prog, f"{CVD}={grant.visible if grant.visible is not None else '(unchanged)'} -> {real}")
    if not lexists(real):
        real = unwrapped_meanwhile(link, shim, root) or real
    exec_program(real, [invoked] + argv[1:], grant.apply(original_environ()), grant)


def main(root: str, link: "Optional[str]" = None, ticket: str = "") -> "NoReturn":
    """The shim's general way (cudawrap/__init__.py: TICKET, a place in the service's line a
    wait there was given): errors become one line and the documented exit code."""
    argv = sys.argv
    _guarded(basename(link or (argv[0] if argv and argv[0] else "cudawrap")),
             lambda: run_shim(root, argv, link, ticket))


def fail(prog: str, message: str, hint: "Optional[str]", exit_code: int) -> "NoReturn":
    """Report a refusal the service sent to the fast path as this way reports its own errors."""
    error = (NoDeviceError if exit_code == NoDeviceError.exit_code else CudawrapError)(message, hint)
    error.exit_code = exit_code
    _guarded(prog, lambda: _raise(error))


def _raise(error: "CudawrapError") -> "NoReturn":
    raise error


def exec_failed(root: str, link: str, real: str, argv: "List[str]", env: "Dict[bytes, bytes]",
                exc: "OSError") -> "NoReturn":
    """The fast path's exec of REAL failed with EXC: run the program where an unwrap put it
    back meanwhile, else say why, as exec_program says it (the lease's descriptors are
    inheritable already)."""
    def again() -> "NoReturn":
        path = real
        if isinstance(exc, FileNotFoundError):
            path = unwrapped_meanwhile(link, argv[0], root) or real  # argv[0]: the shim, through its link
        exec_program(path, argv, env, Grant(None, None))

    _guarded(basename(link), again)


def _guarded(prog: str, run: "Any") -> "NoReturn":
    """RUN (which execs or raises); a CudawrapError becomes one line (and its hint) and its exit status."""
    try:
        run()
    except CudawrapError as exc:
        from .failures import report

        report(prog, exc)
    except KeyboardInterrupt:
        posix._exit(130)
    posix._exit(posix.EX_SOFTWARE)  # RUN returned: it must not
