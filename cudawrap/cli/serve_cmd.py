"""`cudawrap serve`: run the service that grants every lease (root; the cudawrap unit)."""
from __future__ import annotations

from plumbum import cli

from ..errors import UsageError
from ..paths import default_layout
from .app import Command


class ServeCommand(Command):
    """Grant leases through a socket: turns, limits and accounting by the kernel's word (root)."""

    daemon = cli.Flag(["--daemon"], help="run in the background (installs without systemd); pid file and "
                                         "log in the runtime directory; stop it with --stop")
    stop = cli.Flag(["--stop"], excludes=["--daemon"],
                    help="stop the service that --daemon started, once sure the pid is still its own")

    def main(self) -> int:
        from .. import locations as loc
        from ..base.daemon import AlreadyRunning, detach, release
        from ..errors import SetupError
        from ..lease.files import SYNC_HINT
        from ..service.start import serve
        from ..base.privilege import require_admin

        layout = default_layout()
        require_admin(layout, "run the cudawrap service")
        root = str(layout.root)
        pid_file = loc.under(root, loc.SERVICE_PID)
        if self.stop:
            return stop_daemon(root, pid_file)
        if not layout.runtime_dir.is_dir():
            raise SetupError(f"the runtime directory {layout.runtime_dir} is missing", hint=SYNC_HINT)
        from ..service.start import refuse_stranded_waiters

        refuse_stranded_waiters(layout)  # here too: a --daemon's refusal is said in this terminal
        if not self.daemon:
            serve(root)
            return 0
        try:
            fd = detach(pid_file, loc.under(root, loc.SERVICE_LOG), "serve", "cudawrap serve --stop")
        except AlreadyRunning as exc:
            raise UsageError(f"the service is already running (pid {exc.pid}, pid file {pid_file})",
                             hint="stop it with: cudawrap serve --stop") from None
        try:
            serve(root)
        finally:
            release(pid_file, fd)
        return 0


def stop_daemon(root: str, pid_file: str) -> int:
    """`cudawrap serve --stop`: end the --daemon service of ROOT and say so."""
    from .. import locations as loc
    from ..base.daemon import running, stop
    from ..errors import SetupError

    try:
        pid = stop(pid_file)
    except (OSError, TimeoutError) as exc:
        raise SetupError(f"cannot stop the service of {pid_file}: {exc}",
                         hint="see `cudawrap status`; stop it yourself if it is one") from None
    if pid is not None:
        print(f"cudawrap serve: stopped the service (pid {pid})")
        return 0
    other = running(loc.under(root, loc.SERVICE_LOCK))
    if other is not None:
        raise SetupError(f"the service runs (pid {other}), but not from `cudawrap serve --daemon` "
                         f"(no live {pid_file})", hint="stop it as it was started: systemctl stop cudawrap")
    print(f"cudawrap serve: no service runs (no live {pid_file})")
    return 0


class WayCommand(Command):
    """Say, or switch (root), which way this install runs: with the service or daemonless."""

    DESCRIPTION_MORE = (
        "With the service, it is the only arbiter: the lease, slot and queue directories are root's "
        "and every run is its grant (root's own decide for themselves only while it is down). "
        "Daemonless, each run decides for itself. Switching keeps every lease held; it refuses "
        "(exit 75, nothing changed) while runs wait on the side it leaves, as they would lose their turn.")

    def main(self, way: str = "") -> int:
        from ..admin.way import service_pid, switch
        from ..base.privilege import require_admin
        from ..paths import WAYS, recorded_way

        layout = default_layout()
        if not way:
            recorded = recorded_way(str(layout.root))
            pid = service_pid(layout)
            running = f"the service runs (pid {pid})" if pid else "no service runs"
            print(f"{recorded or 'no way recorded'} ({layout.way_file}); {running}")
            return 0
        if way not in WAYS:
            raise UsageError(f"no way {way!r}: choose service or daemonless", hint="cudawrap way --help")
        require_admin(layout, "switch the way this install runs")
        switch(layout, way, lambda line: print(f"cudawrap way: {line}", flush=True))
        return 0
