"""The admin CLI: ``cudawrap`` and ``create-cudawrap``, thin plumbum adapters over the core.

Subcommands live one per module and are registered by dotted name so plumbum imports
only the one that runs. Errors are caught here and printed as one line.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import List, Optional

from plumbum import cli
from plumbum.cli.switches import SwitchError

from .. import __version__
from ..errors import CudawrapError

log = logging.getLogger(__name__)


_META = ("ShowHelp", "ShowHelpAll", "ShowVersion", "ShowCompletion")


class Command(cli.Application):
    """Base of every command: a bad switch or argument is one line and exit 64, not a help page."""

    def _usage(self, exc: Exception) -> Exception:
        from ..errors import UsageError

        if type(exc).__name__ in _META:
            return exc
        # plumbum appends the converter's exception on a second, indented line: one line only.
        first = (str(exc).strip().splitlines() or [""])[0]
        return UsageError(first.strip().rstrip(":"), f"run '{self.PROGNAME} --help' for usage")

    def _parse_args(self, argv):  # type: ignore[no-untyped-def]
        try:
            return super()._parse_args(argv)
        except SwitchError as exc:
            raise self._usage(exc) from None

    def _validate_args(self, swfuncs, tailargs):  # type: ignore[no-untyped-def]
        try:
            return super()._validate_args(swfuncs, tailargs)
        except SwitchError as exc:
            raise self._usage(exc) from None


class Cudawrap(Command):
    """Share the GPUs and MIG instances of this server fairly among wrapped programs."""

    PROGNAME = "cudawrap"
    VERSION = __version__

    debug = cli.Flag(["--debug"], help="show tracebacks and debug logging")

    def main(self, *args: str) -> int:
        if args:
            raise_usage(f"unknown command '{args[0]}'", "run 'cudawrap --help' for the commands")
        if not self.nested_command:
            self.help()
            return os.EX_USAGE
        return 0


_SUBCOMMANDS = {
    "list": "cudawrap.cli.admin.ListCommand",
    "unwrap": "cudawrap.cli.admin.UnwrapCommand",
    "doctor": "cudawrap.cli.admin.DoctorCommand",
    "wrap": "cudawrap.cli.admin.WrapCommand",
    "sync": "cudawrap.cli.runtime.SyncCommand",
    "status": "cudawrap.cli.runtime.StatusCommand",
    "monitor": "cudawrap.cli.runtime.MonitorCommand",
    "run": "cudawrap.cli.runtime.RunCommand",
    "config": "cudawrap.cli.config_cmd.ConfigCommand",
    "drain": "cudawrap.cli.ops.DrainCommand",
    "resume": "cudawrap.cli.ops.ResumeCommand",
    "cancel": "cudawrap.cli.ops.CancelCommand",
    "usage": "cudawrap.cli.ops.UsageCommand",
}
for _name, _target in _SUBCOMMANDS.items():
    Cudawrap.subcommand(_name, _target)


def raise_usage(message: str, hint: Optional[str] = None) -> None:
    from ..errors import UsageError

    raise UsageError(message, hint)


def report(prog: str, exc: CudawrapError, debug: bool) -> int:
    """Print EXC as one line (and a hint line); return its exit code."""
    print(f"{prog}: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)
    if debug:
        log.exception("traceback")
    return exc.exit_code


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
