"""bench/RESULTS.md, one section per benchmark: each writes its own when it runs.

run.py, service.py, health.py and attacks.py each replace only their own section, between
`<!-- bench:NAME:start -->` and `<!-- bench:NAME:end -->`, so the others' figures stay as
their runs wrote them and every figure sits under the header of the run that measured it:
the date (UTC), the checkout's commit, the machine and the interpreter. Targets are
judged here, met or MISSED, never left for the reader to work out.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

from about import checkout, commit_text, machine_info
from report import fmt, table, verdict_text

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"

# The sections in the file, in this order; a new one goes before the first that follows it
# (attacks-planted, attacks-storm, ... by their prefix).
ORDER = ("run", "service", "cgroupmove", "health", "attacks")

PREAMBLE = ("# Benchmark results\n\n"
            "Each benchmark writes its own section of this file when it runs, and replaces only that "
            "section; each section's header says when it was measured (UTC), on which commit, on which "
            "machine and with which interpreter. How each one measures: bench/README.md.\n")


def markers(name: str) -> Tuple[str, str]:
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


SECTION = re.compile(r"<!-- bench:([\w-]+):start -->.*?<!-- bench:\1:end -->\n?", re.S)


def sections(text: str) -> Dict[str, str]:
    """name -> its section, markers included, as it stands in TEXT."""
    return {m.group(1): m.group(0).rstrip("\n") for m in SECTION.finditer(text)}


def _rank(name: str) -> int:
    return next((i for i, n in enumerate(ORDER) if name == n or name.startswith(n + "-")), len(ORDER))


def replace_section(text: str, name: str, body: str) -> str:
    """TEXT with NAME's section replaced by BODY (inside new markers), or inserted in ORDER;
    every other byte as it was. A file without any section (none yet, or a whole file as
    run.py used to write it) starts again from the preamble."""
    start, end = markers(name)
    block = f"{start}\n{body.strip()}\n{end}\n"
    found = list(SECTION.finditer(text))
    if not found:
        return PREAMBLE + "\n" + block
    own = next((m for m in found if m.group(1) == name), None)
    if own is not None:
        return text[:own.start()] + block + text[own.end():]
    after = next((m for m in found if _rank(m.group(1)) > _rank(name)), None)
    if after is not None:
        return text[:after.start()] + block + "\n" + text[after.start():]
    return text.rstrip("\n") + "\n\n" + block


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    path.write_text(replace_section(text, name, body), encoding="utf-8")
    print(f"results: section {name} of {path}", file=sys.stderr)


# ---- what a section's header says -------------------------------------------------------------

def now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def interpreter_text(interp: Optional[Dict[str, Any]]) -> str:
    """The installed shim's interpreter where there is an install, else this one."""
    if interp:
        return f"`{interp['python']}` (→ {interp['resolves_to']}), Python {interp['version']}"
    here = os.path.abspath(sys.executable)
    return f"`{here}` (→ {os.path.realpath(here)}), Python {sys.version.split()[0]}"


def header(command: str, date: str, co: Dict[str, Any], machine: Dict[str, Any],
           interp: Optional[Dict[str, Any]] = None, mode: str = "") -> str:
    """The line under a section's title: what ran, when, on what, with what."""
    load = ""
    start, end = machine.get("load_average_at_start"), machine.get("load_average_at_end")
    if start and end:
        load = f", load average (1 min) {start[0]} at start and {end[0]} at end"
    return (f"Measured by `{command}`{f' ({mode} mode)' if mode else ''}, {date}, checkout "
            f"{commit_text(co)}; {machine['cpu']}, {machine['cores']} cores{load}; interpreter "
            f"{interpreter_text(interp)}.")


def invocation(argv: Sequence[str]) -> str:
    """ARGV as this interpreter ran it: a venv of the checkout named relative to it."""
    here = os.path.abspath(sys.executable)
    repo = str(RESULTS.parent.parent) + os.sep
    return " ".join([here[len(repo):] if here.startswith(repo) else os.path.basename(here)] + list(argv))


class Run:
    """When and on what a benchmark ran: taken at its start (the load average at its end too)."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.command = invocation(argv)
        self.date = now()
        self.checkout = checkout()
        self.machine = machine_info()

    def header(self, interp: Optional[Dict[str, Any]] = None, mode: str = "") -> str:
        machine = dict(self.machine, load_average_at_end=[round(x, 2) for x in os.getloadavg()])
        return header(self.command, self.date, self.checkout, machine, interp, mode)


# ---- the figures, judged ----------------------------------------------------------------------

def at_most(value: Optional[float], limit: float) -> Optional[bool]:
    return None if value is None else value <= limit


def below(value: Optional[float], limit: float) -> Optional[bool]:
    return None if value is None else value < limit


def targets_table(rows: Sequence[Tuple[str, Any, str, Optional[bool]]]) -> str:
    """(what, measured, target, met) rows: a figure not measured is said so, and judged –."""
    return table(["what", "measured", "target", ""],
                 [(w, "not measured" if m is None else fmt(m, 2), t, verdict_text(ok)) for w, m, t, ok in rows])


def tally(rows: Sequence[Tuple[str, Any, str, Optional[bool]]]) -> str:
    judged = [ok for *_rest, ok in rows if ok is not None]
    missed = judged.count(False)
    return (f"{len(judged) - missed} of {len(judged)} targets met"
            + (f", **{missed} MISSED**" if missed else "") + ".")


# ---- a script that only prints ----------------------------------------------------------------

class _Tee(io.TextIOBase):
    def __init__(self, out: Any) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


class Recorded:
    def __init__(self, argv: Sequence[str]) -> None:
        self.run = Run(argv)
        self.printed = ""


@contextlib.contextmanager
def recording(argv: Sequence[str]) -> Iterator[Recorded]:
    """What the block prints, still printed, and kept (.printed) with when and on what it ran."""
    done = Recorded(argv)
    tee = _Tee(sys.stdout)
    saved, sys.stdout = sys.stdout, tee
    try:
        yield done
    finally:
        sys.stdout = saved
        done.printed = tee.kept.getvalue()


def printed_section(title: str, recorded: Recorded, note: str) -> str:
    """A section for a script that prints its figures and sets no target: them, as printed."""
    return "\n".join([title, "", recorded.run.header(), "", note, "", "```text", recorded.printed.rstrip("\n"),
                      "```", ""])
