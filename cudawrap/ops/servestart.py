"""Starting `cudawrap serve`: room for thousands of clients, the service's lock, the monitor's
loop in a child of its own, then the loop that grants (serve.py) until a signal ends it."""
from __future__ import annotations

import gc
import logging
import os
import signal
import time

from .. import locations as loc
from ..errors import SetupError
from ..install.units import MONITOR_NICE
from ..paths import Layout
from .serve import Service, _say


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

    # The only arbiter, however started (README "One arbiter"): the lease, slot and queue
    # directories become root's before the first grant (and users' again at its stop only
    # where the install runs daemonless: _step_down).
    refuse_stranded_waiters(Layout(Path(root)))
    prepare_runtime(Layout(Path(root)), True)
    lock = _hold_service_lock(root)
    from .accounts import recover

    found, closed = recover(Layout(Path(root)))  # before the monitor's first look: see recover
    monitor = start_monitor(Layout(Path(root)), lock)  # before NVML is opened here: a fork must not share it
    try:
        service = Service(root, config["max_connections_per_uid"], config["private_status"])
        if found:
            service.notes.append(f"{found} grant(s) sent before a crash and missing from the ledger's state: "
                                 "followed from now on")
        if closed:
            service.notes.append(f"{closed} lease(s) whose end was recorded before a crash were still open "
                                 "in the ledger's state: closed there")
        _say(f"listening on {service.path}")
        for note in service.notes:
            _say(note)
        # Everything made so far (modules, the inventory, the policy) lives as long as the
        # service: kept out of the collector's full passes, which took 12 ms each, measured
        # in a burst, and could fall between a release and the grant it frees.
        gc.freeze()
        service.run()
    finally:
        stop_monitor(monitor)
        _step_down(Layout(Path(root)))
        os.close(lock)
        _say(f"stopped (pid {os.getpid()})")  # the journal's or the --daemon log's last line


def refuse_stranded_waiters(layout: Layout) -> None:
    """Refuse to start while users' runs wait in the queue directory (a daemonless install's):
    once the directories are root's they could never take their turn, and the service has no
    connection to hand them one. Root's waiters may stay: root still opens the lease files."""
    from ..errors import RunsWaiting
    from ..sched.queue import WaitQueue

    users = sorted({w.pid for w in WaitQueue(str(layout.queue_dir)).scan(bounded=False).waiters if w.uid != 0})
    if users:
        raise RunsWaiting(f"{len(users)} run(s) of users wait in {layout.queue_dir} (pid "
                   f"{', '.join(map(str, users[:5]))}{', …' if len(users) > 5 else ''}): once the service "
                   f"holds the directories they could never take their turn; not started",
                   hint="start it once none waits (`cudawrap status` lists them)")


def _step_down(layout: Layout) -> None:
    """A service started by hand in a daemonless install gives the directories back as it
    stops (its runs keep their locks; its waiters decide for themselves); in an install that
    runs with it they stay root's, and users' runs wait for its restart."""
    from ..install.runtime import prepare_runtime
    from ..paths import SERVICE, recorded_way

    if recorded_way(str(layout.root)) != SERVICE:
        try:
            prepare_runtime(layout, False)
        except OSError as exc:
            _say(f"warning: the directories stay root's ({exc}): `cudawrap sync` gives them back")


def _hold_service_lock(root: str) -> int:
    """The service's lock (root's alone), held for its life: see ledger.service_running."""
    from ..base.daemon import AlreadyRunning, hold

    path = loc.under(root, loc.SERVICE_LOCK)
    try:
        return hold(path)
    except AlreadyRunning:
        raise SetupError(f"a service already holds {path}",
                         hint="stop it first (systemctl stop cudawrap, or cudawrap serve --stop)") from None


def start_monitor(layout: object, lock: int) -> int:
    """The monitor's loop (ops/monitor.py: the snapshot, the ledger's look at foreign work,
    health, memory, metrics) in a child of the service: it shares no interpreter with the
    grant path, and one lock (the ledger's, which its look holds ~1-3 ms: ledger.observe;
    it holds it at the service's nice: ledgerfile.hold_at_nice); it runs at the monitor
    unit's Nice=, dies with the service (PR_SET_PDEATHSIG: also when the service is killed
    with -9), and waits its turn while a cudawrap-monitor unit runs one. It lets go of the
    service's LOCK: that says the service lives, not its monitor."""
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        os.close(lock)
        _die_with(os.getppid())
        from .ledgerfile import hold_at_nice

        hold_at_nice(os.getpriority(os.PRIO_PROCESS, 0))  # the lock the service's grants wait for
        os.setpriority(os.PRIO_PROCESS, 0, MONITOR_NICE)  # as its unit runs it: a hand-over comes first
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


STOP_MONITOR_S = 5.0  # then SIGKILL: a service's stop must not hang on its monitor


def stop_monitor(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_MONITOR_S
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return
            time.sleep(0.01)
    except (ProcessLookupError, ChildProcessError):
        pass
