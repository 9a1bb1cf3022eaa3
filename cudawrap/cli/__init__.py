"""The admin CLI: ``cudawrap`` and ``create-cudawrap``, thin plumbum adapters over the core.

Subcommands live one per module and are registered by dotted name so plumbum imports
only the one that runs. Errors are caught here and printed as one line.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
from typing import List, Optional

from plumbum import cli
from plumbum.cli.switches import SwitchError

from ..errors import CudawrapError
from ..paths import version_text

log = logging.getLogger(__name__)


_META = ("ShowHelp", "ShowHelpAll", "ShowVersion", "ShowCompletion")


def tidy_help(text: str) -> str:
    """plumbum's help without the ":str" it shows after every value switch's NAME (every value
    here is text; the NAME says what it is), the help column kept aligned."""
    lines = text.splitlines(keepends=True)
    # The help column: where plumbum indents a switch's wrapped help lines.
    column = min((len(line) - len(line.lstrip(" ")) for line in lines
                  if line.startswith(" " * 20) and line.strip()), default=36)
    out = []
    for line in lines:
        head, sep, rest = line.partition(":str")
        if sep and line.startswith("    -") and rest[:1] in (" ", "\n"):
            rest = rest.lstrip(" ")
            line = head.ljust(column - 1) + " " + rest if rest.strip() else head + rest
        out.append(line)
    return "".join(out)


class Command(cli.Application):
    """Base of every command: a bad switch or argument is one line and exit 64, not a help page."""

    def __init__(self, executable: str) -> None:
        super().__init__(executable)
        if not self._subcommands:  # --help-all lists subcommands: none here
            self._switches_by_name.pop("help-all", None)
        # A switch whose every name was taken over (--help, below) or removed is not shown.
        self._switches_by_func = {func: info for func, info in self._switches_by_func.items()
                                  if any(self._switches_by_name.get(n) is info for n in info.names)}

    @cli.switch(["-h", "--help"], overridable=True, group="Meta-switches", help="Prints this help message and quits")
    def help(self) -> None:  # noqa: A003 - plumbum's name
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            super().help()
        sys.stdout.write(tidy_help(text.getvalue()) + self.epilogue())

    def epilogue(self) -> str:
        """Text after the switches in --help."""
        return ""

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


class Group(Command):
    """A command of commands: alone, or with an unknown command, it is a usage error."""

    SUBCOMMAND_HELPMSG = False  # said once, in the description, instead of after every command's line

    def main(self, *args: str) -> int:
        if args:
            raise_usage(f"unknown command '{args[0]}'", f"run '{self.PROGNAME} --help' for the commands")
        if not self.nested_command:
            self.help()
            return os.EX_USAGE
        return 0


class Cudawrap(Group):
    """Share the GPUs and MIG instances of this server fairly among wrapped programs.

    Run 'cudawrap COMMAND --help' for a command's switches, 'man cudawrap' for more.
    """

    PROGNAME = "cudawrap"
    VERSION = version_text()

    debug = cli.Flag(["--debug"], help="show tracebacks and debug logging")

    def epilogue(self) -> str:
        import textwrap

        from .manpages import exit_codes

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
    "run": "cudawrap.cli.runtime.RunCommand",
    "config": "cudawrap.cli.config_cmd.ConfigCommand",
    "drain": "cudawrap.cli.ops.DrainCommand",
    "resume": "cudawrap.cli.ops.ResumeCommand",
    "cancel": "cudawrap.cli.ops.CancelCommand",
    "usage": "cudawrap.cli.ops.UsageCommand",
    "mps": "cudawrap.cli.mps_cmd.MpsCommand",
    "health": "cudawrap.cli.health_cmd.HealthCommand",
    "why": "cudawrap.cli.health_cmd.WhyCommand",
}
for _name, _target in _SUBCOMMANDS.items():
    Cudawrap.subcommand(_name, _target)


def raise_usage(message: str, hint: Optional[str] = None) -> None:
    from ..errors import UsageError

    raise UsageError(message, hint)


def report(prog: str, exc: CudawrapError, debug: bool) -> int:
    """Print EXC as one line (and a hint line); return its exit code."""
    from ..text import printable  # messages name paths, and file names are chosen by users

    print(printable(f"{prog}: {exc.message}"), file=sys.stderr)
    if exc.hint:
        print(printable(f"hint: {exc.hint}"), file=sys.stderr)
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
