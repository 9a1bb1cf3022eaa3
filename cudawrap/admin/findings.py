"""What `cudawrap doctor` finds, one line each, and the base of its checks: a finding added,
or with --repair a problem's fix tried and its outcome added instead.

Levels: ``ok``, ``note`` (something not checked, and why), ``warning`` (worth knowing, not
broken: e.g. a binary upgraded through its diversion), ``error`` (broken: the install is
unhealthy), ``fixed`` (was broken, repaired just now).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Mapping, Optional

from ..base import audit
from ..errors import CudawrapError
from ..paths import Layout
from ..base.text import printable
from .divert import Dpkg

LEVEL_OK = "ok"
LEVEL_NOTE = "note"
LEVEL_WARNING = "warning"
LEVEL_ERROR = "error"
LEVEL_FIXED = "fixed"


@dataclass(frozen=True)
class Finding:
    level: str
    subject: str
    message: str

    def line(self) -> str:
        """One line for the admin's terminal: names found on disk are chosen by users, so
        control characters are escaped (a planted name cannot fake or hide a finding)."""
        return printable(f"{self.level}: {self.subject}: {self.message}")


class Checkup:
    """The findings of one run of doctor over LAYOUT, and how a problem is reported or repaired."""

    def __init__(self, layout: Layout, repair: bool, dpkg: Dpkg, environ: Mapping[str, str]) -> None:
        self.layout = layout
        self.repair = repair
        self.dpkg = dpkg
        self.environ = environ
        self.findings: List[Finding] = []

    def add(self, level: str, subject: str, message: str) -> None:
        self.findings.append(Finding(level, subject, message))

    def problem(self, subject: str, message: str, fix: Optional[Callable[[], str]],
                level: str = LEVEL_ERROR) -> None:
        """Report a problem; with --repair and a FIX, try it and report the outcome instead."""
        if not (self.repair and fix):
            self.add(level, subject, message)
            return
        try:
            done = fix()
        except (CudawrapError, OSError) as exc:
            why = exc.message if isinstance(exc, CudawrapError) else (exc.strerror or str(exc))
            self.add(LEVEL_ERROR, subject, f"{message}; repair failed: {why}")
        else:
            self.add(LEVEL_FIXED, subject, f"{message}; {done}")
            audit.log("repair", subject=subject, problem=message, done=done)
