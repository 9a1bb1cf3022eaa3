"""The bases every command is built on, and how a failure is shown: one line and an exit code.

Subcommand modules import these (not the package, which assembles them into ``cudawrap``),
so the package and its subcommands do not import each other.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
import sys
from typing import Any, Dict, List, Optional

from plumbum import cli
from plumbum.cli.switches import SwitchError

from ..errors import CudawrapError

log = logging.getLogger("cudawrap.cli")


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
            import difflib

            close = difflib.get_close_matches(args[0], sorted(self._subcommands), n=1)
            guess = f"did you mean '{self.PROGNAME} {close[0]}'? " if close else ""
            raise_usage(f"unknown command '{args[0]}'", f"{guess}run '{self.PROGNAME} --help' for the commands")
        if not self.nested_command:
            self.help()
            return os.EX_USAGE
        return 0


def raise_usage(message: str, hint: Optional[str] = None) -> None:
    from ..errors import UsageError

    raise UsageError(message, hint)


def require_install(layout: Any) -> None:
    """SetupError (72) where LAYOUT's root holds no install: a command that reads the devices'
    leases there would show every device as having no lease file, as if all were well."""
    import os

    from ..errors import SetupError

    if layout.installed:
        return
    if os.environ.get("CUDAWRAP_ROOT"):
        hint = ("CUDAWRAP_ROOT names the install root: set it to the directory given to "
                "`install.sh --prefix`, or unset it for the installed root")
    else:
        hint = "install cudawrap (install.sh, or the .deb), or set CUDAWRAP_ROOT to a --prefix install's root"
    raise SetupError(f"no cudawrap install at {layout.root}", hint)


def report(prog: str, exc: CudawrapError, debug: bool) -> int:
    """Print EXC as one line (and a hint line); return its exit code."""
    from ..base.text import printable  # messages name paths, and file names are chosen by users

    print(printable(f"{prog}: {exc.message}"), file=sys.stderr)
    if exc.hint:
        print(printable(f"hint: {exc.hint}"), file=sys.stderr)
    if debug:
        log.exception("traceback")
    return exc.exit_code


def first_paragraph(doc: str) -> str:
    """DOC's first paragraph on one line."""
    return " ".join(re.split(r"\n\s*\n", doc.strip())[0].split())


def exit_codes() -> Dict[int, List[str]]:
    """Exit code -> what it means, from the docstrings of errors.py's classes."""
    from .. import errors

    codes: Dict[int, List[str]] = {}
    for _, cls in inspect.getmembers(errors, inspect.isclass):
        if issubclass(cls, errors.CudawrapError) and cls is not errors.CudawrapError:
            doc = first_paragraph(cls.__doc__ or "")
            codes.setdefault(cls.exit_code, []).append(doc.rstrip("."))
    return dict(sorted(codes.items()))
