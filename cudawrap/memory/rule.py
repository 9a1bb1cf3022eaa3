"""Each run's GPU memory judged, pure: whose memory a GPU process's is (its run's holder), how
much each run uses, and what to do about a shared run over its share: warn at 90 %, then,
once over for ``grace_s``, report it or end it (SIGTERM, then SIGKILL after ``kill_after_s``).
`decide()` changes nothing but the run's Track; watch.py acts on what it returns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Set

WARN_AT = 0.9  # of the limit: the holder is told before anything happens
GIB_MIB = 1024


@dataclass(frozen=True)
class Limit:
    limit_mib: int  # 0: none
    action: str
    grace_s: float
    kill_after_s: float


def owner(pid: int, parents: Mapping[int, int], holders: Mapping[int, int]) -> Optional[int]:
    """The holder (a key of HOLDERS, pid -> itself) PID descends from, or None. PARENTS: pid -> ppid."""
    seen: Set[int] = set()
    while pid and pid not in seen:
        if pid in holders:
            return pid
        seen.add(pid)
        pid = parents.get(pid, 0)
    return None


def account(process_memory: Mapping[str, Mapping[int, Optional[int]]],
            member_of: Mapping[int, int]) -> Dict[int, Dict[str, int]]:
    """holder pid -> device -> MiB used: PROCESS_MEMORY (device -> pid -> MiB, None where
    the driver hides it) summed over each run's members (MEMBER_OF: pid -> holder pid)."""
    out: Dict[int, Dict[str, int]] = {}
    for uuid, by_pid in process_memory.items():
        for pid, mib in by_pid.items():
            holder = member_of.get(pid)
            if holder is not None and mib is not None:
                used = out.setdefault(holder, {})
                used[uuid] = used.get(uuid, 0) + mib
    return out


@dataclass
class Track:
    """What the watch remembers of one shared run on one device between cycles."""

    warned: bool = False
    over_since: Optional[float] = None
    term_at: Optional[float] = None
    killed: bool = False
    reported: bool = False  # "over, but only warned" said once


@dataclass(frozen=True)
class Action:
    kind: str  # "warn", "over" (over the limit, warn only), "term", "kill"
    pid: int
    uuid: str
    used_mib: int
    limit: Limit


def decide(track: Track, pid: int, uuid: str, used_mib: int, limit: Limit, now: float) -> List[Action]:
    """What to do about one shared run using USED_MIB of UUID now; updates TRACK. Pure but for TRACK."""
    if limit.limit_mib <= 0:
        return []
    out: List[Action] = []
    if used_mib >= WARN_AT * limit.limit_mib and not track.warned:
        track.warned = True
        out.append(Action("warn", pid, uuid, used_mib, limit))
    if used_mib <= limit.limit_mib:
        if track.term_at is None:
            track.over_since = None  # back inside its share before anything was done
        return out
    if track.over_since is None:
        track.over_since = now
    if now - track.over_since < limit.grace_s:
        return out
    if limit.action != "terminate":
        if not track.reported:
            track.reported = True
            out.append(Action("over", pid, uuid, used_mib, limit))
        return out
    if track.term_at is None:
        track.term_at = now
        out.append(Action("term", pid, uuid, used_mib, limit))
    elif not track.killed and now - track.term_at >= limit.kill_after_s:
        track.killed = True
        out.append(Action("kill", pid, uuid, used_mib, limit))
    return out


def gib(mib: float) -> str:
    return f"{mib / GIB_MIB:.1f}"


def ended_line(program: str, pid: int, user: str, used_mib: int, limit_mib: int) -> str:
    """The line the audit log and the ledger keep: "recon (pid 4242, alice) ended: 43.2 GiB on a 40 GiB share"."""
    return f"{program} (pid {pid}, {user}) ended: {gib(used_mib)} GiB on a {limit_mib / GIB_MIB:g} GiB share"
