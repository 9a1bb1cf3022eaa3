"""The cgroup v1 devices controller: a rule as lines for devices.deny and devices.allow.

Follows Documentation/admin-guide/cgroup-v1/devices.rst (security/device_cgroup.c). Each
line is ``TYPE MAJOR:MINOR ACCESS``, one a write. A new cgroup copies its parent's list, and
the kernel refuses (EPERM) an allow its parent does not grant, so a child never widens its
parent. In a cgroup that allows by default ("a *:* rwm", the usual host), a deny line is an
exception, and an allow line only removes an exception of exactly that device: a wildcard
deny cannot have holes. So a span is refused minor by minor (254 lines for the GPU nodes),
and a major refused whole (``c M:* rwm``) only where nothing of it is allowed. In a cgroup
that denies by default (a container's list), a deny removes only an exact allow line and
would leave a wildcard allow open: ``problem`` says so and nothing is written.

devices.list shows only "a *:* rwm" for a default-allow cgroup, whatever its exceptions, so
the list cannot be read back: ``apply`` writes every line of the rule each time (denies
first), which makes it stateless like the v2 program.
"""
from __future__ import annotations

import errno
import os
from typing import List, Optional, Tuple

from .devrule import Rule

ALLOW_ALL = "a *:* rwm"
_WHOLE_MAJOR_LIMIT = 1 << 13  # spans wider than this are refused whole by major (the nvidia-caps table is ~4400)


class DevicesError(OSError):
    """A devices controller write failed, or the rule cannot be written there; says which."""


def lines(rule: Rule) -> Tuple[List[str], List[str]]:
    """(deny lines, allow lines) that make a default-allow cgroup refuse what RULE refuses."""
    deny: List[str] = []
    allow: List[str] = []
    for span in rule.refused:
        holes = sorted(m for (M, m) in rule.allowed if M == span.major and span.low <= m <= span.high)
        if span.high - span.low >= _WHOLE_MAJOR_LIMIT:
            if holes:
                raise DevicesError(errno.EINVAL, f"the v1 devices controller cannot refuse all of major {span.major} "
                                   f"but {holes}: use cgroup v2, or give the span's bounds")
            deny.append(f"c {span.major}:* rwm")
            continue
        for minor in range(span.low, span.high + 1):
            (allow if minor in holes else deny).append(f"c {span.major}:{minor} rwm")
    return deny, allow


def problem(cgroup: str) -> str:
    """Why a rule written into CGROUP (a devices cgroup directory) would not hold, or ""."""
    try:
        with open(os.path.join(cgroup, "devices.list")) as f:
            listed = f.read().split("\n")
    except OSError as e:
        return f"cannot read {cgroup}/devices.list: {e.strerror}"
    if ALLOW_ALL not in listed:
        return (f"{cgroup} allows devices by a list (as a container does): a refusal written below it "
                f"would not close a wildcard it allows")
    return ""


def write(path: str, line: str) -> None:
    """One write(2) of LINE to a cgroup control file: the kernel parses a write as one line."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def changes(before: Rule, after: Rule) -> Tuple[List[str], List[str]]:
    """(deny lines, allow lines) that take a cgroup where BEFORE was applied to AFTER: a run's
    grant writes the lines of its own minors, not all 254 again. Where both refuse the same
    spans (a grant, an end: only the holes differ), from the holes alone: a span of the
    capabilities is thousands of lines, each of its grants a few."""
    if before.refused == after.refused and not any(s.high - s.low >= _WHOLE_MAJOR_LIMIT for s in after.refused):
        def holes(rule: Rule) -> "set[Tuple[int, int]]":
            return {(M, m) for (M, m) in rule.allowed if any(s.major == M and s.low <= m <= s.high for s in rule.refused)}

        old, new = holes(before), holes(after)
        return [f"c {M}:{m} rwm" for M, m in sorted(old - new)], [f"c {M}:{m} rwm" for M, m in sorted(new - old)]
    old_deny, old_allow = lines(before)
    deny, allow = lines(after)
    kept_deny, kept_allow, now_deny = set(old_deny), set(old_allow), set(deny)
    opened = [line for line in old_deny if line not in now_deny]  # an allow removes the exception
    return [line for line in deny if line not in kept_deny], [line for line in allow if line not in kept_allow] + opened


def apply(cgroup: str, rule: Rule, before: Optional[Rule] = None) -> None:
    """Make CGROUP refuse what RULE refuses: each deny line, then each allow line; where BEFORE
    (the rule last applied there) is given, only the lines that differ. An allow the parent
    refuses fails EPERM and is left so: the parent refuses it anyway."""
    if before is None:
        why = problem(cgroup)
        if why:
            raise DevicesError(errno.EPERM, f"cannot confine {cgroup}: {why}")
    deny, allow = lines(rule) if before is None else changes(before, rule)
    deny_file, allow_file = os.path.join(cgroup, "devices.deny"), os.path.join(cgroup, "devices.allow")
    _write_each(deny_file, deny, refused_ok=False)
    _write_each(allow_file, allow, refused_ok=True)


def _write_each(path: str, lines: List[str], refused_ok: bool) -> None:
    """Each of LINES, one write(2) apiece (the kernel parses one a write) through one open."""
    if not lines:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for line in lines:
            try:
                os.write(fd, line.encode())
            except OSError as e:
                if not (refused_ok and e.errno == errno.EPERM):
                    raise DevicesError(e.errno, f"writing {line!r} to {path}: {e.strerror}") from None
    finally:
        os.close(fd)
