"""Starting `cudawrap serve`: room for thousands of clients, the service's lock, the monitor's
loop in a child of its own, then the loop that grants (loop.py) until a signal ends it."""
from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import time
from typing import Optional

from .. import locations as loc
from ..errors import SetupError
from ..install.units import MONITOR_NICE
from ..paths import Layout
from .journal import say
from .loop import Service


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

    # The only arbiter, however started (docs/admin/ways.md): the lease, slot and queue
    # directories become root's before the first grant (and users' again at its stop only
    # where the install runs daemonless: _step_down).
    refuse_stranded_waiters(Layout(Path(root)))
    prepare_runtime(Layout(Path(root)), True)
    lock = _hold_service_lock(root)
    from .bookkeeping import recover

    found, closed = recover(Layout(Path(root)))  # before the monitor's first look: see recover
    monitor = Keeper(root, start_monitor(Layout(Path(root)), lock))  # before NVML is opened here: a fork must not share it
    try:
        service = Service(root, config["max_connections_per_uid"], config["private_status"])
        if found:
            service.notes.append(f"{found} grant(s) sent before a crash and missing from the ledger's state: "
                                 "followed from now on")
        if closed:
            service.notes.append(f"{closed} lease(s) whose end was recorded before a crash were still open "
                                 "in the ledger's state: closed there")
        say(f"listening on {service.path}")
        for note in service.notes:
            say(note)
        # Everything made so far (modules, the inventory, the policy) lives as long as the
        # service: kept out of the collector's full passes, which took 12 ms each, measured
        # in a burst, and could fall between a release and the grant it frees.
        gc.freeze()
        service.run()
    finally:
        monitor.stop()
        _step_down(Layout(Path(root)))
        os.close(lock)
        say(f"stopped (pid {os.getpid()})")  # the journal's or the --daemon log's last line


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
            say(f"warning: the directories stay root's ({exc}): `cudawrap sync` gives them back")


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
    """The monitor's loop (monitor/loop.py: the snapshot, the ledger's look at foreign work,
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
        from ..ledger.files import hold_at_nice

        hold_at_nice(os.getpriority(os.PRIO_PROCESS, 0))  # the lock the service's grants wait for
        os.setpriority(os.PRIO_PROCESS, 0, MONITOR_NICE)  # as its unit runs it: a hand-over comes first
        from ..monitor.loop import run

        run(layout, strict=False)  # type: ignore[arg-type]
    except BaseException:  # noqa: BLE001 - whatever ends it, never return into the parent's code
        logging.getLogger(__name__).exception("the monitor's loop ended")
        code = 1
    os._exit(code)


def monitor_child(root: str, parent: int, level: int, fmt: str) -> None:
    """The monitor's loop in a process of its own, exec'd by the Keeper: as start_monitor's
    child, with the service's log format (LEVEL, FMT), dying with PARENT (the service)."""
    from pathlib import Path

    logging.basicConfig(level=level, format=fmt)
    _die_with(parent)
    from ..ledger.files import hold_at_nice

    hold_at_nice(os.getpriority(os.PRIO_PROCESS, 0))
    os.setpriority(os.PRIO_PROCESS, 0, MONITOR_NICE)
    from ..monitor.loop import run

    try:
        run(Layout(Path(root)), strict=False)
    except BaseException:  # noqa: BLE001 - said in the log; the Keeper starts another
        logging.getLogger(__name__).exception("the monitor's loop ended")
        os._exit(1)


# A monitor that ended is started again after this long, doubled at each end that follows
# within RESTART_CALM_S of its start, up to RESTART_MAX_S: a dead monitor is a transient
# (foreign processes are seen again within a second), one that cannot start does not spin.
RESTART_FIRST_S = 0.5
RESTART_MAX_S = 60.0
RESTART_CALM_S = 60.0


class Keeper:
    """The service's monitor child, kept running: a thread waits for its end and starts it
    again, after a backoff, logged. NVML is open in the service by then, so the new one is
    exec'd (a fork would share NVML's state), and dies with the service as the first does."""

    def __init__(self, root: str, pid: int) -> None:
        import threading

        self.root = root
        self.pid = pid  # -1 once reaped: stop() never signals a pid reused since
        self.proc: Optional[subprocess.Popen] = None  # the one started again (reaped by its wait())
        self.started = time.monotonic()
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # held to reap (_ended) and to signal (stop)
        self.thread = threading.Thread(target=self._keep, name="monitor-keeper", daemon=True)
        self.thread.start()

    def _keep(self) -> None:
        delay = RESTART_FIRST_S
        while True:
            pid, code = self._ended()
            if self.stopping.is_set():
                return
            if time.monotonic() - self.started >= RESTART_CALM_S:
                delay = RESTART_FIRST_S
            how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            say(f"the monitor (pid {pid}) ended ({how}): started again in {delay:g} s")
            while True:
                if self.stopping.wait(delay):
                    return
                delay = min(delay * 2, RESTART_MAX_S)
                try:
                    proc = self._spawn()
                    break
                except OSError as exc:
                    say(f"the monitor could not be started again: {exc}; trying again in {delay:g} s")
            with self.lock:
                self.proc, self.pid, self.started = proc, proc.pid, time.monotonic()
                if self.stopping.is_set():  # stop() came meanwhile, with no pid to end
                    proc.terminate()
            say(f"the monitor started again (pid {proc.pid})")

    def _ended(self) -> "tuple[int, int]":
        """Once the monitor has ended: its pid, and its exit status or minus its signal."""
        pid = self.pid
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped yet: its pid is still its own
        except ChildProcessError:
            pass
        with self.lock:
            self.pid = -1
            if self.proc is not None:
                return pid, self.proc.wait()
            try:
                return pid, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            except ChildProcessError:
                return pid, 0

    def _spawn(self) -> subprocess.Popen:
        import sys

        handler = next(iter(logging.getLogger().handlers), None)
        fmt = getattr(getattr(handler, "formatter", None), "_fmt", None) or "cudawrap: %(message)s"
        code = (f"import sys; sys.path[:] = {sys.path!r}; from cudawrap.service.start import monitor_child; "
                f"monitor_child({self.root!r}, {os.getpid()}, {logging.getLogger().level}, {fmt!r})")
        return subprocess.Popen([sys.executable, "-I", "-c", code], stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        """End the monitor and its keeping: SIGTERM, SIGKILL after STOP_MONITOR_S."""
        self.stopping.set()
        self._signal(signal.SIGTERM)
        self.thread.join(STOP_MONITOR_S)
        if self.thread.is_alive():
            self._signal(signal.SIGKILL)
            self.thread.join(STOP_MONITOR_S)

    def _signal(self, signum: int) -> None:
        with self.lock:
            if self.pid > 0:
                try:
                    os.kill(self.pid, signum)
                except ProcessLookupError:
                    pass


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
