"""The ledger's files: where they are, how a record is appended (whole, under a lock,
durable) and read back, each user's own view, and the monitor's notes.

What goes into them, and from which look at the kernel, is looks.py's; the format and the
guarantees are described there.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from ..paths import Layout

LEDGER = "ledger"
LOCK = "ledger.lock"
STATE = "ledger.state"
USER_DIR = "usage"
RECORD_VERSION = 1
MAX_RECORD = 64 << 10  # a line longer than this is not ours: skipped as corrupt
LEASES = ("grant", "end")
NOTES = ("health-drain", "health-resume", "leftover", "leftover-killed", "idle")
MAX_PENDING = 1000  # notes kept for the next try while the ledger cannot be written


# The service's monitor runs its looks below the grant path (MONITOR_NICE), under this lock,
# which the service's grants wait for. Among the start-ups of a burst of 50 runs its first
# look, starved of the CPU, held the lock 31 ms (11 ms at the service's nice; 1-3 ms once
# they run), and the burst's first grants waited for it. So it holds the lock at the
# service's nice (hold_at_nice), and goes back below once it lets go.
_nice_inside: Optional[int] = None


def hold_at_nice(nice: int) -> None:
    """From now on this process holds the ledger's lock at NICE (raised to it, never lowered)."""
    global _nice_inside
    _nice_inside = nice


def _raised() -> Optional[int]:
    """This process raised to _nice_inside: its nice before, or None if left as it was."""
    if _nice_inside is None:
        return None
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before <= _nice_inside:
        return None
    try:
        os.setpriority(os.PRIO_PROCESS, 0, _nice_inside)
    except OSError:
        return None  # without CAP_SYS_NICE: as it was
    return before


def ledger_path(layout: Layout) -> Path:
    return layout.state_dir / LEDGER


def user_view_path(layout: Layout, uid: int) -> Path:
    return layout.state_dir / USER_DIR / str(uid)


# --- appending ------------------------------------------------------------------------------


def rotated(path: Path, keep: int) -> List[Path]:
    """PATH's files, oldest first: PATH.KEEP … PATH.1, PATH."""
    return [Path(f"{path}.{n}") for n in range(keep, 0, -1)] + [path]


def _rotate(path: Path, keep: int) -> None:
    files = rotated(path, keep)
    for older, newer in zip(files, files[1:]):  # PATH.(n-1) -> PATH.n, …, PATH -> PATH.1
        if os.path.lexists(newer):
            os.replace(newer, older)


def append(path: Path, records: Sequence[Dict[str, Any]], max_bytes: int, keep: int,
           mode: int = 0o600, group: Optional[int] = None, durable: bool = True) -> None:
    """Append RECORDS as one write, durably (unless not DURABLE: the caller syncs later);
    raises OSError and leaves the file as it was.

    The caller holds the ledger lock (the only writers are root processes taking it).
    """
    if not records:
        return
    data = "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in records).encode()
    for attempt in (1, 2):
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            st = os.fstat(fd)
            if not (st.st_mode & 0o170000 == 0o100000) or st.st_uid != os.geteuid():
                raise OSError(errno.EPERM, "not a regular file of ours", str(path))
            if st.st_mode & 0o7777 != mode:
                os.fchmod(fd, mode)  # whatever the umask, and after an admin's chmod
            if group is not None and st.st_gid != group:
                os.fchown(fd, -1, group)
            if attempt == 1 and st.st_size and st.st_size + len(data) > max_bytes and keep > 0:
                os.close(fd)
                fd = -1
                _rotate(path, keep)
                continue
            prefix = b""
            if st.st_size and os.pread(fd, 1, st.st_size - 1) != b"\n":
                prefix = b"\n"  # a torn line from before (a crash mid-write): never glue onto it
            try:
                written = os.write(fd, prefix + data)
                if written != len(prefix) + len(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                if durable:
                    os.fsync(fd)
            except OSError:
                os.ftruncate(fd, st.st_size)  # cut back what went in: the file stays as it was
                raise
            return
        finally:
            if fd >= 0:
                os.close(fd)


class Locked:
    """The ledger's lock: held while observing and appending (root processes only)."""

    def __init__(self, layout: Layout) -> None:
        self.path = layout.state_dir / LOCK

    def __enter__(self) -> Locked:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        self.before = _raised()
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
        if self.before is not None:
            os.setpriority(os.PRIO_PROCESS, 0, self.before)


# --- reading --------------------------------------------------------------------------------


def _valid(record: Any) -> bool:
    if not isinstance(record, dict):
        return False
    if record.get("event") in LEASES:
        return isinstance(record.get("id"), str)
    return (record.get("event") in NOTES and isinstance(record.get("device"), str)
            and isinstance(record.get("at"), (int, float)))


def read(files: Sequence[Path], problems: List[str], kinds: Sequence[str] = LEASES) -> Iterator[Dict[str, Any]]:
    """The records of FILES of the KINDS asked for, in order; an unreadable line is skipped
    with one line in PROBLEMS (a readable record of another kind is skipped silently)."""
    for path in files:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            continue
        with f:
            yield from _records(f, str(path), problems, kinds)


def tail(path: Path, max_bytes: int, kinds: Sequence[str] = LEASES) -> List[Dict[str, Any]]:
    """The records of KINDS in the last MAX_BYTES of PATH (a cut first line left out), in
    order; [] where it cannot be read. Unreadable lines are skipped silently."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - max_bytes))
            lines = f.read().split(b"\n")
    except OSError:
        return []
    return list(_records(lines[1 if size > max_bytes else 0:], str(path), [], kinds))


def _records(lines: Iterable[bytes], where: str, problems: List[str], kinds: Sequence[str]) -> Iterator[Dict[str, Any]]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line) if len(line) <= MAX_RECORD else None
        except ValueError:
            record = None
        if not _valid(record):
            problems.append(f"{where}:{number}: unreadable record skipped")
            continue
        if record["event"] in kinds:
            yield record


# --- what the kernel shows --------------------------------------------------------------------


def private_group(uid: int) -> Optional[int]:
    """UID's primary group if only that user is in it (a user private group), else None."""
    import grp
    import pwd

    try:
        pw = pwd.getpwuid(uid)
        gr = grp.getgrgid(pw.pw_gid)
    except KeyError:
        return None
    return gr.gr_gid if gr.gr_name == pw.pw_name and not set(gr.gr_mem) - {pw.pw_name} else None


def append_user_view(layout: Layout, record: Dict[str, Any], limits: Tuple[int, int], durable: bool = True) -> None:
    """RECORD into its user's own view (usage/UID, readable by their private group alone),
    after the ledger has it: the looks' and the service's ends, the monitor's notes. Nothing
    where the user has no private group; a failure is left for the next end to catch up.
    LIMITS: (max bytes of a file, rotated files kept); DURABLE as append() takes it."""
    group = private_group(record["uid"])
    if group is None:
        return  # no group of that user alone: only root sees these records
    directory = layout.state_dir / USER_DIR
    try:
        directory.mkdir(mode=0o755, exist_ok=True)
        append(user_view_path(layout, record["uid"]), [record], *limits, mode=0o640, group=group, durable=durable)
    except OSError:
        pass  # the ledger has it; the user's view catches up with the next end


class Notes:
    """The monitor's notes for the ledger: gathered during a cycle, written at its end under
    the ledger's lock; kept for the next cycle while the ledger cannot take them (a full disk)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.pending: List[Dict[str, Any]] = []

    def add(self, event: str, device: str, at: float, **facts: Any) -> None:
        if event not in NOTES:
            raise ValueError(f"not a ledger note: {event}")
        self.pending.append({"v": RECORD_VERSION, "event": event, "device": device, "at": round(at, 3), **facts})
        del self.pending[:-MAX_PENDING]  # a ledger that stays unwritable must not grow memory

    def flush(self, limits: Tuple[int, int]) -> Optional[str]:
        """Write the pending notes (and each user's to their own view); why not, or None."""
        if not self.pending:
            return None
        try:
            with Locked(self.layout):
                append(ledger_path(self.layout), self.pending, *limits)
                for record in self.pending:
                    if isinstance(record.get("uid"), int) and record["uid"] >= 0:
                        append_user_view(self.layout, record, limits)  # their own idle time, leftovers
        except OSError as exc:
            return f"cannot write the ledger {ledger_path(self.layout)}: {exc.strerror or exc}"
        self.pending = []
        return None
