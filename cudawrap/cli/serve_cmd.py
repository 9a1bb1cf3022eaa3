"""`cudawrap serve`: run the service that grants every lease (root; the cudawrap unit)."""
from __future__ import annotations

from plumbum import cli

from ..errors import UsageError
from ..paths import default_layout
from .app import Command


class ServeCommand(Command):
    """Grant leases through a socket: turns, limits and accounting by the kernel's word (root)."""

    daemon = cli.Flag(["--daemon"], help="run in the background (installs without systemd); pid file and "
                                         "log in the runtime directory; stop it with kill")

    def main(self) -> int:
        from .. import locations as loc
        from ..base.daemon import AlreadyRunning, detach
        from ..errors import SetupError
        from ..lease.files import SYNC_HINT
        from ..ops.servestart import serve
        from ..base.privilege import require_admin

        layout = default_layout()
        require_admin(layout, "run the cudawrap service")
        root = str(layout.root)
        if not layout.runtime_dir.is_dir():
            raise SetupError(f"the runtime directory {layout.runtime_dir} is missing", hint=SYNC_HINT)
        if self.daemon:
            pid_file = loc.under(root, loc.SERVICE_PID)
            try:
                detach(pid_file, loc.under(root, loc.SERVICE_LOG), "serve")
            except AlreadyRunning as exc:
                raise UsageError(f"the service is already running (pid {exc.pid}, pid file {pid_file})",
                                 hint=f"stop it with: kill $(cat {pid_file})") from None
        serve(root)
        return 0
