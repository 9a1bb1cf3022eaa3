"""The admin CLI: ``cudawrap`` and ``create-cudawrap``, thin plumbum adapters over the core.

This module only assembles: the ``cudawrap`` group and its subcommand table, and the console
scripts' entry points. Subcommands live one per module on the bases in app.py and are
registered by dotted name so plumbum imports only the one that runs; nothing in this package
imports this module back except to read the assembled group (man pages, completion). Errors
are caught here and printed as one line.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

from plumbum import cli

from ..errors import CudawrapError
from ..paths import version_text
from .app import Command, Group, exit_codes, raise_usage, report

__all__ = ["Command", "Cudawrap", "Group", "create_main", "main", "raise_usage", "report"]


class Cudawrap(Group):
    """Share the GPUs and MIG instances of this server fairly among wrapped programs.

    Run 'cudawrap COMMAND --help' for a command's switches, 'man cudawrap' for more.
    """

    PROGNAME = "cudawrap"
    VERSION = version_text()

    debug = cli.Flag(["--debug"], help="show tracebacks and debug logging")

    def epilogue(self) -> str:
        import textwrap

        codes = " ".join(f"{code}: {'; '.join(meanings)}." for code, meanings in exit_codes().items())
        return "\n" + textwrap.fill(f"Exit codes: 0: done. {codes}", 80) + "\n"


_SUBCOMMANDS = {
    "list": "cudawrap.cli.admin.ListCommand",
    "unwrap": "cudawrap.cli.admin.UnwrapCommand",
    "doctor": "cudawrap.cli.admin.DoctorCommand",
    "wrap": "cudawrap.cli.admin.WrapCommand",
    "sync": "cudawrap.cli.runtime.SyncCommand",
    "status": "cudawrap.cli.runtime.StatusCommand",
    "monitor": "cudawrap.cli.runtime.MonitorCommand",
    "serve": "cudawrap.cli.serve_cmd.ServeCommand",
    "way": "cudawrap.cli.serve_cmd.WayCommand",
    "run": "cudawrap.cli.runtime.RunCommand",
    "config": "cudawrap.cli.config_cmd.ConfigCommand",
    "drain": "cudawrap.cli.ops.DrainCommand",
    "resume": "cudawrap.cli.ops.ResumeCommand",
    "cancel": "cudawrap.cli.ops.CancelCommand",
    "revoke": "cudawrap.cli.ops.RevokeCommand",
    "usage": "cudawrap.cli.ops.UsageCommand",
    "mps": "cudawrap.cli.mps_cmd.MpsCommand",
    "health": "cudawrap.cli.health_cmd.HealthCommand",
    "why": "cudawrap.cli.health_cmd.WhyCommand",
}
for _name, _target in _SUBCOMMANDS.items():
    Cudawrap.subcommand(_name, _target)


def _run(app: type, prog: str, argv: Optional[List[str]]) -> int:
    argv = list(sys.argv if argv is None else argv)
    debug = "--debug" in argv or bool(os.environ.get("CUDAWRAP_DEBUG"))
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format=f"{prog}: %(message)s")
    try:
        _, code = app.run(argv, exit=False)
    except CudawrapError as exc:
        return report(prog, exc, debug)
    except KeyboardInterrupt:
        return 130
    return int(code or 0) if isinstance(code, int) else 0


def main(argv: Optional[List[str]] = None) -> None:
    sys.exit(_run(Cudawrap, "cudawrap", argv))


def create_main(argv: Optional[List[str]] = None) -> None:
    from .admin import CreateCudawrap

    sys.exit(_run(CreateCudawrap, "create-cudawrap", argv))
