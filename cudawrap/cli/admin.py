"""The admin commands: create-cudawrap / cudawrap wrap, list, unwrap, doctor.

Thin adapters: parse switches, check privilege, call the core with an explicit Layout,
print. Results go to stdout, explanations to stderr. The core takes the registry lock
itself, after checking every path without it, so that a refused command changes no file
at all, not even the lock file.
"""
from __future__ import annotations

import json
import logging
import math
import sys
from typing import Any, Dict, Sequence

from plumbum import cli

from ..policy.config import (
    FOREIGN_RULES, FOREVER, MULTI_MIG_RULES, NO_DRIVER_RULES, PLACEMENTS, format_wait, parse_wait, validate_policy,
)
from ..errors import ConfigError, StateError, UsageError
from ..paths import default_layout, version_text
from ..base.text import printable
from .app import Command, report
from .filterswitches import FilterSwitches, key_switches, switch_name

# A program's policy beyond the device filters: key -> its value's name in the help.
POLICY: Dict[str, str] = {
    "gpus": "N",
    "wait": "SECONDS|forever",
    "placement": "|".join(PLACEMENTS),
    "foreign": "|".join(FOREIGN_RULES),
    "busy_memory_mib": "MIB",
    "no_driver": "|".join(NO_DRIVER_RULES),
    "multi_mig": "|".join(MULTI_MIG_RULES),
    "max_gpus": "N",
    "devices": "UUID|INDEX,...",
}
# The order the switches are read in (the first bad one is reported), the registry's order.
READ_ORDER = ("gpus", "wait", "busy_memory_mib", "model", "min_memory_mib", "min_free_memory_mib",
              "max_utilization", "max_gpus", "devices", "share", "placement", "foreign", "no_driver", "multi_mig")
WHOLE_NUMBERS = {"gpus", "busy_memory_mib", "min_memory_mib", "min_free_memory_mib", "max_utilization", "max_gpus"}


def _prog(command: Command) -> str:
    """The program name for messages: "cudawrap" for "cudawrap unwrap"."""
    return str(command.PROGNAME).split()[0]


def _debug() -> bool:
    return logging.getLogger().isEnabledFor(logging.DEBUG)


def _report_failures(prog: str, failures: Sequence[Any]) -> int:
    """Print each failure as one line; the exit code is the first one's."""
    for failure in failures:
        report(prog, failure.error, _debug())
    return failures[0].error.exit_code if failures else 0


def _raw_wait(text: str) -> Any:
    """A --wait value in the registry's JSON-able form: a number of seconds or "forever"."""
    try:
        value = parse_wait(text)
    except ValueError as exc:
        raise UsageError(f"--wait: {exc}") from None
    if value == FOREVER:
        return "forever"
    return int(value) if value == math.floor(value) else value


def _raw_int(switch: str, text: str) -> Any:
    try:
        return int(text.strip())
    except ValueError:
        raise UsageError(f"{switch}: {text!r} is not a whole number") from None


def _raw(key: str, text: str) -> Any:
    """The text of KEY's switch in the registry's JSON-able form (validate_policy checks it)."""
    if key == "wait":
        return _raw_wait(text)
    if key in WHOLE_NUMBERS:
        return _raw_int(switch_name(key), text)
    if key == "devices":
        # The registry keeps JSON: indices as numbers, UUIDs as strings.
        return [int(d) if d.isascii() and d.isdigit() else d
                for d in (part.strip() for part in text.split(",")) if d]
    return text


@key_switches(POLICY)
class CreateCudawrap(FilterSwitches, Command):
    """Wrap CUDA programs: each run then gets its own free GPU or MIG instance.

    PROGRAM is renamed to CUDAWRAP_<name> in the same directory and PROGRAM becomes a
    link to its own cudawrap shim; dpkg-owned programs are diverted so upgrades land at the
    new name. The switches set this program's policy (otherwise the config's applies).
    """

    PROGNAME = "create-cudawrap"
    VERSION = version_text()
    USAGE = "    {progname} [SWITCHES] PROGRAM...\n"

    force = cli.Flag(["--force"], help="wrap a program of the base system (a Debian package marked Essential "
                                       "or of Priority required/important), or one an RPM package owns although "
                                       "an update of that package silently unwraps it (both refused otherwise); "
                                       "nothing else")

    def policy(self) -> Dict[str, Any]:
        """The per-program policy from the switches, raw (as the registry stores it), checked."""
        raw: Dict[str, Any] = {}
        for key in READ_ORDER:
            value = getattr(self, key)
            if isinstance(value, str):
                raw[key] = _raw(key, value)
            elif value:  # a flag given
                raw[key] = True
        for key, value in raw.items():
            try:
                validate_policy({key: value}, switch_name(key))
            except ConfigError as exc:
                raise UsageError(exc.message) from None
        if raw.get("gpus", 1) > raw.get("max_gpus", raw.get("gpus", 1)):
            raise UsageError(f"--gpus {raw['gpus']} is above --max-gpus {raw['max_gpus']}")
        return raw

    def main(self, *programs: str) -> int:
        from ..base.privilege import require_admin
        from ..admin.wrap import wrap_programs

        if not programs:
            raise UsageError("no program given: name the program(s) to wrap")
        policy = self.policy()
        layout = default_layout()
        require_admin(layout)
        outcome = wrap_programs(layout, programs, policy, force=self.force)
        for entry in outcome.wrapped:
            how = f"diverted from package {entry.package}" if entry.diversion else "renamed"
            print(printable(f"wrapped {entry.link} (real program: {entry.real}, {how})"))
        for warning in outcome.warnings:
            print(printable(f"{_prog(self)}: {warning}"), file=sys.stderr)
        return _report_failures(_prog(self), outcome.failed)


class WrapCommand(CreateCudawrap):
    """Wrap CUDA programs (the same as create-cudawrap)."""

    PROGNAME = None  # type: ignore[assignment]  # plumbum names it "cudawrap wrap"


def _policy_text(policy: Dict[str, Any]) -> str:
    parts = []
    for key, value in sorted(policy.items()):
        if key == "wait":
            value = format_wait(parse_wait(value))
        parts.append(f"{key}={value}")
    return " ".join(parts) or "-"


class ListCommand(Command):
    """List wrapped programs and how each one looks on disk now (anyone may run it)."""

    as_json = cli.Flag(["--json"], help="print JSON for scripts instead of a table")

    def main(self) -> int:
        from ..policy import registry
        from ..admin.inspect_wraps import inspect_all

        layout = default_layout()
        statuses = inspect_all(layout, registry.load(layout))
        if self.as_json:
            rows = []
            for s in statuses:
                raw = s.entry.to_raw()
                raw.pop("stat")
                raw.update(state=s.state, detail=s.detail, diverted=s.entry.diverted)
                rows.append(raw)
            print(json.dumps(rows, indent=2))
            return 0
        if not statuses:
            print("no programs are wrapped", file=sys.stderr)
            return 0
        table = [("STATE", "PROGRAM", "POLICY", "PACKAGE", "WRAPPED BY", "WRAPPED AT")]
        for s in statuses:
            e = s.entry
            table.append(tuple(printable(cell) for cell in (
                s.state, e.link, _policy_text(dict(e.policy)), e.package or "-", e.wrapped_by, e.wrapped_at)))
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        for s in statuses:
            if s.detail:
                print(printable(f"{s.entry.link}: {s.detail}"), file=sys.stderr)
        return 0


class UnwrapCommand(Command):
    """Put wrapped programs back under their own names and forget them."""

    USAGE = "    {progname} [--force] PROGRAM... | --all\n"

    everything = cli.Flag(["--all"], help="unwrap every wrapped program")
    force = cli.Flag(
        ["--force"],
        help="unwrap even when disk differs from the registry: restore the real program as it is "
             "now; if the name now holds something else, leave it and keep the real program as "
             "NAME.cudawrap-saved; if the real program is gone, just remove the shim link. "
             "Never deletes a program.",
    )

    def main(self, *programs: str) -> int:
        from ..base.privilege import require_admin
        from ..admin.unwrap import unwrap_programs

        if programs and self.everything:
            raise UsageError("give programs or --all, not both")
        if not programs and not self.everything:
            raise UsageError("no program given: name the program(s) to unwrap, or --all")
        layout = default_layout()
        require_admin(layout)
        outcome = unwrap_programs(layout, programs, everything=self.everything, force=self.force)
        if self.everything and not outcome.unwrapped and not outcome.failed:
            print("no programs are wrapped", file=sys.stderr)
        for done in outcome.unwrapped:
            print(printable(done.message))
        return _report_failures(_prog(self), outcome.failed)


class DoctorCommand(Command):
    """Check the installation and every wrapped program; --repair fixes what it can."""

    repair = cli.Flag(["--repair"], help="fix what can be fixed (root or the install's owner)")

    def main(self) -> int:
        from ..admin.doctor import check, healthy
        from ..base.privilege import require_admin

        layout = default_layout()
        if self.repair:
            require_admin(layout, "repair cudawrap")
        findings = check(layout, repair=self.repair)
        for finding in findings:
            print(finding.line())
        if healthy(findings):
            return 0
        errors = sum(f.level == "error" for f in findings)
        hint = "" if self.repair else "; 'cudawrap doctor --repair' fixes what it can"
        print(f"{_prog(self)}: {errors} problem(s) found{hint}", file=sys.stderr)
        return StateError.exit_code

