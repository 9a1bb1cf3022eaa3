"""The ledger as the service writes it: one turn of its loop, one lock, one read and one write.

A turn (turn()) takes the ledger's lock at its first record, reads the state once and writes
it once at its end, whatever number of grants and ends it records; the service's loop
carries a turn on to the next while hand-overs follow each other, and the state's rewrite
and the fsyncs run on a thread of their own (background(), ledger/writer.py), so the disk's
latency is not a launch's.

Apart from bookkeeping.py (what a grant's and an end's records say, a restart's recovery):
this is when and under which lock they are written, which the loop steers (idle_within,
idle, release) without knowing what a record holds.
"""
from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

from ..ledger import looks as ledger, files as ledgerfile
from ..paths import Layout

if TYPE_CHECKING:
    from ..ledger.writer import Writer

IDLE_SYNC_S = 0.05  # the ledger is made durable once nothing happened for this long
CARRY_IDLE_S = 0.002  # a carried turn's state is written once nothing happened for this long
CARRY_MAX_S = 0.02  # or this long after its lock was taken, whatever happens (a look waits)

_unsynced: "set[Path]" = set()  # ledger files written since their last fsync
# What a grant's record needs that does not change between grants, kept between them: the
# service records a grant before its descriptors leave, so every read here is a hand-over's.
# (Not the ledger's state: other processes replace it, and a file replaced within one tick of
# the clock by one of the same size, on a reused inode, looks unchanged.)
_kept: Dict[str, Any] = {}
# The service's (background()): the state's rewrites and the fsyncs, off its loop. Elsewhere
# each is made at once, by whoever records.
_writer: Optional["Writer"] = None


def background(layout: Layout) -> None:
    """From now on the state is rewritten, and records made durable, on a thread of their
    own (ledger/writer.py): the service's loop goes on meanwhile. What the first grant
    would otherwise read is read now: the configuration's [ledger] limits (parsing it took
    25 ms of the first hand-over) and the boot id."""
    global _writer
    if _writer is None:
        from ..ledger.writer import Writer

        _writer = Writer()
    _limits(layout)
    boot()


def flush() -> None:
    """Make what was recorded durable (one fsync per file written since the last flush)."""
    paths = sorted(_unsynced)
    _unsynced.clear()
    if _writer is None:
        _fsync(paths)
    else:
        _writer.submit(lambda: _fsync(paths))


def finish() -> None:
    """The carried turn's state written, its lock let go and every record made durable,
    before the service leaves."""
    release()
    flush()
    if _writer is not None:
        _writer.wait()


def _fsync(paths: List[Path]) -> None:
    import os

    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # rotated away meanwhile: rotation renames, the data is in the new name
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _signature(path: Path) -> Optional[Tuple[int, int, int, int]]:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _limits(layout: Layout) -> Tuple[int, int]:
    """[ledger] max_mib and keep, parsed again only when the configuration file changed."""
    from ..policy.config import load_config
    from ..errors import CudawrapError

    sig = (str(layout.config_file), _signature(layout.config_file))
    if _kept.get("limits_of") == sig:
        return _kept["limits"]
    try:
        config = load_config(layout.config_file)
        limits = (config["max_mib"] << 20, config["keep"])
    except CudawrapError:  # a broken config: the defaults, rather than a lost record
        limits = (64 << 20, 4)
    _kept.update(limits_of=sig, limits=limits)
    return limits


def boot() -> str:
    """This boot's id, read once (the service dies with the boot)."""
    if "boot" not in _kept:
        _kept["boot"] = ledger.boot_id()
    return _kept["boot"]


# root -> (the ledger's state, the ledger): a turn begins each hand-over, where building the
# paths again cost ~0.05 ms of a cold CPU.
_paths: Dict[str, Tuple[Path, Path]] = {}


def _turn_paths(layout: Layout) -> Tuple[Path, Path]:
    key = str(layout.root)
    paths = _paths.get(key)
    if paths is None:
        paths = _paths[key] = (layout.state_dir / ledgerfile.STATE, ledgerfile.ledger_path(layout))
    return paths


class _Turn:
    """The ledger as the service writes it in one turn of its loop: its lock taken once, at
    the first record, its state read once and written once at the end, whatever number of
    grants and ends the turn records (seven releases at once are seven ends and seven grants).

    Each record is appended to the ledger as it happens (a grant before its descriptors
    leave); what can wait does, until the turn's grants are sent: the state's rewrite (a
    look, the monitor's, waits for the lock meanwhile, so it never sees a client's lock that
    the state does not name) and each user's own view of the ends (fsynced, one file each)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.path, self.ledger = _turn_paths(layout)
        self.lock: Optional[ledgerfile.Locked] = None
        self.since = 0.0  # when the lock was taken (time.monotonic())
        self.state: Optional[Dict[str, Any]] = None
        self.limits: Optional[Tuple[int, int]] = None
        self.changed = False
        self.ends: List[Tuple[str, float, str]] = []  # (lease id, when, how), written by settle()
        # Grants sent this turn, entered as open in the state by settle() (the state's read
        # waits until the turn's grants are all sent): (lease id, its record, the boot).
        self.opened: List[Tuple[str, Dict[str, Any], str]] = []
        self.views: List[Dict[str, Any]] = []  # ends for their users' views
        self.released = 0  # times handed to the writer (release()); its last write lets go of the lock

    def locked(self) -> None:
        """The ledger's lock, taken now if not yet (the state is read only when needed)."""
        if self.lock is None:
            self.lock = ledgerfile.Locked(self.layout).__enter__()
            self.since = time.monotonic()

    def open(self) -> Dict[str, Any]:
        """The ledger's state, under its lock (taken now if not yet)."""
        self.locked()
        if self.state is None:
            self.state = ledger.load_state(self.path)
            if self.state["boot"] == boot():
                _kept["boot_current"] = True  # only a reboot changes it, and this service dies with it
        return self.state

    def _limits(self) -> Tuple[int, int]:
        if self.limits is None:
            self.limits = _limits(self.layout)  # one look at the config file per turn
        return self.limits

    def append(self, record: Dict[str, Any]) -> None:
        ledgerfile.append(self.ledger, [record], *self._limits(), durable=False)
        _unsynced.add(self.ledger)

    def settle(self) -> None:
        """Enter the grants sent meanwhile as open (grant()); write the ends recorded meanwhile
        (end()), each unless a look recorded it already."""
        opened, self.opened = self.opened, []
        if opened:
            state = self.open()
            for lid, record, boot in opened:
                state["boot"] = boot
                state["open"][lid] = record
            self.changed = True
        ends, self.ends = self.ends, []
        for lid, at, how in ends:
            record = self.open()["open"].pop(lid, None)
            if record is None:
                continue
            done = ledger.end_record(record, at, at, at, how, "service")
            self.append(done)
            self.changed = True
            self.views.append(done)

    def close(self) -> None:
        self.settle()
        if self.lock is None:
            return
        if _writer is not None:
            _writer.wait()  # a write of this turn's state queued earlier (_reclaimed) comes first
        writes = self.writes()
        try:
            writes.write_state()
        finally:
            self.lock.__exit__()
            self.lock = None
        writes.write_views()

    def writes(self) -> "_Writes":
        """What is to be written of this turn now, taken from it (the state as text): the
        writer's thread then shares nothing with the loop."""
        text = json.dumps(self.state).encode() if self.changed and self.state is not None else None
        views, self.views, self.changed = self.views, [], False
        for done in views:
            _unsynced.add(ledgerfile.user_view_path(self.layout, done["uid"]))
        return _Writes(self.layout, self.path, text, views, self._limits())


@dataclass
class _Writes:
    layout: Layout
    path: Path
    text: Optional[bytes]  # the state, if it changed
    views: List[Dict[str, Any]]  # ends for their users' views
    limits: Tuple[int, int]

    def write_state(self) -> None:
        if self.text is not None:
            ledger.write_state(self.path, self.text)

    def write_views(self) -> None:
        for done in self.views:
            ledgerfile.append_user_view(self.layout, done, self.limits, durable=False)


_turn: Optional[_Turn] = None
_carried: Optional[_Turn] = None  # a turn ended with carry: its lock still held, its state unwritten
# A turn released to the writer: its lock is let go once its state is written, unless the loop
# took it back meanwhile (_reclaimed). _handover decides which of the two comes first.
_writing: Optional[_Turn] = None
_handover = threading.Lock()


@contextmanager
def turn(layout: Layout, carry: bool = False) -> Iterator[_Turn]:
    """What is recorded within (the service: one turn of its loop) shares one lock, one read
    and one write of the ledger's state (_Turn); a record outside any is a turn of its own.

    CARRY (the service's loop): the turn's ends are written at its end, as always, but its
    lock and its state are kept for the next turn, until release(): the state's rewrite (a
    rename, which ext4 makes flush the new file's data: ~0.5 ms) then waits for a moment
    without hand-overs, and one rewrite serves the seven of a burst. A look waits for the
    lock meanwhile, so it never sees a client's lock that the state does not name."""
    global _turn, _carried
    if _turn is not None and _turn.layout.root == layout.root:
        yield _turn
        return
    outer = _turn
    if _carried is not None and _carried.layout.root == layout.root:
        _turn, _carried = _carried, None
    else:
        _turn = _reclaimed(layout) or _Turn(layout)
    ok = False
    try:
        yield _turn
        ok = True
    finally:
        done, _turn = _turn, outer
        if ok and carry and done.lock is not None:
            done.settle()
            _carried = done
        else:
            done.close()


def release(older_than: float = 0.0) -> None:
    """End the turn carried (turn(carry=True)), if its lock was taken OLDER_THAN seconds ago
    or more: its ends written now, its state then, and its lock let go after it (by the
    writer, in the service: background())."""
    global _carried, _writing
    done = _carried
    if done is None or time.monotonic() - done.since < older_than:
        return
    if _writer is None:
        _carried = None
        done.close()
        return
    # Still carried until handed over: the service's SIGTERM raises wherever its loop is, and
    # a turn dropped on the way would keep the lock for good (the monitor, stopped after the
    # service's loop, then waits for it). Handed over twice, the first write lets go of nothing.
    done.settle()
    writes = done.writes()
    with _handover:
        done.released += 1
        released = done.released
    _writer.submit(lambda: _let_go(done, writes, released))
    _carried, _writing = None, done


def _let_go(done: _Turn, writes: _Writes, released: int) -> None:
    """On the writer's thread: DONE's state written, then its lock let go, unless the loop
    took the turn back since (its RELEASED-th release is not its last then)."""
    try:
        writes.write_state()
    finally:
        with _handover:
            if done.released == released and done.lock is not None:
                done.lock.__exit__()
                done.lock = None
    writes.write_views()


def _reclaimed(layout: Layout) -> Optional[_Turn]:
    """The turn last released to the writer, taken back while its lock is still held and
    young: nobody else could write the ledger since, so its state is still the truth, and a
    hand-over that comes while the writer writes need not wait for it (nor read the state
    again). An older one's lock is let go as it was to be: a look waits for it."""
    global _writing
    done, _writing = _writing, None
    if done is None or done.layout.root != layout.root:
        return None
    with _handover:
        if done.lock is None or time.monotonic() - done.since >= CARRY_MAX_S:
            return None
        done.released += 1  # the writes queued leave the lock held
    return done


def idle_within(timeout: float) -> float:
    """How long the service's loop may wait for news: TIMEOUT, or less when the ledger has
    work for a moment without any (idle())."""
    if _carried is not None:
        return min(timeout, CARRY_IDLE_S)
    return min(timeout, IDLE_SYNC_S) if _unsynced else timeout


def idle() -> None:
    """Nothing happened for idle_within(): the carried turn's state is written now, and once
    that is done and nothing happened again, what was recorded is made durable."""
    if _carried is not None:
        release()
    else:
        flush()


def boot_current() -> bool:
    """Whether a turn has seen the ledger's state be this boot's (only a reboot changes it)."""
    return bool(_kept.get("boot_current"))
