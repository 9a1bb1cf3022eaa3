"""Device leases: one root-created lock file per device UUID, held with ``flock``.

The lease is the open file description, not a process: the descriptor is made
inheritable and survives ``execv``, so the kernel releases it when the program and
every child that inherited it have exited (kill -9 included). No daemon, no heartbeat,
no cleanup job. Users open lease files read-only; only root creates or removes them.
"""

import errno
import fcntl
import posix
import stat

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, Iterable, List, Optional, Set, Tuple

from ..errors import SetupError
from ..locations import LEASE_ENV, PROGRAM_ENV  # noqa: F401 - named here by the lease's users

OPEN_FLAGS = posix.O_RDONLY | posix.O_NOFOLLOW | posix.O_CLOEXEC | posix.O_NONBLOCK


def check_dir(path: str, what: str, hint: str) -> "posix.stat_result":
    """A directory that must exist and be writable only by its owner (root, system-wide)."""
    try:
        st = posix.stat(path)
    except FileNotFoundError:
        raise SetupError(f"the {what} {path} is missing", hint=hint) from None
    except OSError as exc:
        raise SetupError(f"cannot use the {what} {path}: {exc.strerror}", hint=hint) from None
    if not stat.S_ISDIR(st.st_mode):
        raise SetupError(f"the {what} {path} is not a directory", hint=hint)
    if st.st_mode & 0o022:
        # Anyone who can write here could swap lease files and get one device twice.
        raise SetupError(f"the {what} {path} is writable by others; refusing to trust it",
                         hint="run `cudawrap doctor --repair` as root")
    return st


SYNC_HINT = "run `cudawrap sync` as root (at boot the cudawrap-sync unit does this)"


class Lease:
    """Locks held on some devices; inheritable across exec once granted.

    FDS: uuid -> descriptor on its lease file (exclusive lock: the whole device; shared
    lock: a share). SLOTS: uuid -> descriptor on the slot file a share holds exclusively.
    """

    def __init__(self, fds: "Dict[str, int]", slots: "Optional[Dict[str, int]]" = None) -> None:
        self.fds = dict(fds)
        self.slots = dict(slots or {})

    @property
    def uuids(self) -> "List[str]":
        return list(self.fds)

    @property
    def shared(self) -> "List[str]":
        return [u for u in self.fds if u in self.slots]

    def part(self, uuids: "Iterable[str]") -> "Lease":
        return Lease({u: self.fds[u] for u in uuids}, {u: self.slots[u] for u in uuids if u in self.slots})

    def marker(self) -> str:
        from .. import lease_marker

        return lease_marker(self.fds, self.slots)

    def keep_across_exec(self) -> None:
        for fd in list(self.fds.values()) + list(self.slots.values()):
            posix.set_inheritable(fd, True)

    def release(self) -> None:
        # Slots first: a slot locked without its lease counts as a share held apart from it
        # (Acquirer.machine), which a live process letting go must not look like.
        for fd in list(self.slots.values()) + list(self.fds.values()):
            try:
                posix.close(fd)  # closing our only reference drops the flock
            except OSError:
                pass
        self.fds.clear()
        self.slots.clear()


class LeaseFiles:
    """The lease files of one lease directory, opened read-only once per process."""

    def __init__(self, lease_dir: str, share_dir: "Optional[str]" = None) -> None:
        self.dir = lease_dir
        self.share_dir = share_dir
        self.owner = check_dir(lease_dir, "lease directory", SYNC_HINT).st_uid
        self._fds: "Dict[str, int]" = {}
        self._idents: "Dict[str, Tuple[int, int]]" = {}  # uuid -> (device, inode) of its descriptor's file
        self._slots: "Dict[str, int]" = {}  # uuid -> locked slot file of a share being taken
        self._probes: "Dict[str, int]" = {}  # slot file -> a descriptor kept for slot_free

    def path(self, uuid: str) -> str:
        return self.dir + "/" + uuid

    def fd(self, uuid: str) -> "Optional[int]":
        """An open descriptor on UUID's lease file, or None if it has none (not synced yet)."""
        fd = self._fds.get(uuid)
        if fd is not None:
            return fd
        if "/" in uuid or uuid in ("", ".", ".."):
            return None
        try:
            fd = posix.open(self.path(uuid), OPEN_FLAGS)
        except OSError:
            return None
        st = posix.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != self.owner:
            posix.close(fd)  # planted by someone else: never trust it
            return None
        self._fds[uuid] = fd
        self._idents[uuid] = (st.st_dev, st.st_ino)  # a descriptor's file never changes
        return fd

    def names(self) -> "Set[str]":
        """The names in the lease directory (a UUID each), in one listing; nothing is opened."""
        try:
            return set(posix.listdir(self.dir))
        except OSError:
            return set()

    def ident(self, uuid: str) -> "Optional[Tuple[int, int]]":
        """(device, inode) of UUID's lease file, as /proc/locks names it; None if it has none."""
        if uuid not in self._idents:
            self.fd(uuid)  # opens it and notes its file; its entry goes with its descriptor
        return self._idents.get(uuid)

    def idents(self, uuids: "Iterable[str]") -> "Dict[str, Optional[Tuple[int, int]]]":
        """ident() of each of UUIDS: a decision reads every device's, once a call each cost
        a decision on 56 MIG instances ~0.03 ms."""
        known = self._idents
        return {u: known[u] if u in known else self.ident(u) for u in uuids}

    def try_lock(self, uuid: str, how: int = fcntl.LOCK_EX) -> bool:
        """Take UUID's lease without blocking; False if someone holds it or it is gone.

        HOW = LOCK_SH takes the device's side of a share (see try_share)."""
        fd = self.fd(uuid)
        if fd is None:
            return False
        ident = self._idents.get(uuid)
        if not _flock_current(fd, self.path(uuid), how, ident):
            if not _same_file(fd, self.path(uuid), ident):
                self.forget(uuid)  # replaced by sync: open the new one next time
            # else held: keep the descriptor (reopening it would tell the watchers that a
            # lock may have been taken, and make them all look at the machine again)
            return False
        return True

    def free_now(self, uuid: str, how: int = fcntl.LOCK_EX) -> bool:
        """Whether nobody holds UUID's lease: its lock, tried and let go at once (it is held
        for microseconds; a taker meeting it tries again, Acquirer._lock).

        HOW = LOCK_SH asks only whether nobody holds it exclusively: two such probes never
        meet, where exclusive ones read each other as holders. A device held by sharers
        reads free that way."""
        if not self.try_lock(uuid, how):
            return False
        self.unlock(uuid)
        return True

    def try_share(self, uuid: str, slots: int) -> bool:
        """Take a share of UUID: the shared lock on its lease file, then the exclusive lock on
        the first free of its SLOTS slot files. False (nothing held) if an exclusive run
        holds the device or every slot is taken."""
        if self.share_dir is None or not self.try_lock(uuid, fcntl.LOCK_SH):
            return False
        for slot in range(1, slots + 1):
            fd = self.open_slot(uuid, slot)
            if fd is None:
                continue  # not made (yet): fewer slots than configured until root syncs
            if _flock_current(fd, self.slot_path(uuid, slot), fcntl.LOCK_EX):
                self._slots[uuid] = fd
                return True
            posix.close(fd)
        self.unlock(uuid)
        return False

    def slot_path(self, uuid: str, slot: int) -> str:
        return f"{self.share_dir}/{uuid}.{slot}"

    def open_slot(self, uuid: str, slot: int) -> "Optional[int]":
        """A new descriptor on UUID's slot file SLOT, or None where there is none (root's, a
        regular file; fewer slot files than configured until root syncs)."""
        if self.share_dir is None or "/" in uuid:
            return None
        try:
            fd = posix.open(self.slot_path(uuid, slot), OPEN_FLAGS)
        except OSError:
            return None
        st = posix.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == self.owner:
            return fd
        posix.close(fd)
        return None

    def slot_free(self, uuid: str, slot: int) -> bool:
        """Whether nobody holds UUID's slot SLOT: its lock tried and let go at once, through a
        descriptor kept open (closing one would wake whoever watches the slot files)."""
        path = self.slot_path(uuid, slot)
        fd = self._probes.get(path)
        if fd is not None and not _same_file(fd, path):
            posix.close(self._probes.pop(path))  # replaced by sync
            fd = None
        if fd is None:
            fd = self.open_slot(uuid, slot)
            if fd is None:
                return False
            self._probes[path] = fd
        if not _flock_current(fd, path, fcntl.LOCK_EX):
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True

    def unlock(self, uuid: str) -> None:
        slot = self._slots.pop(uuid, None)
        if slot is not None:
            posix.close(slot)  # before the lease: see Lease.release
        fd = self._fds.get(uuid)
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def slot_idents(self, uuid: str, slots: int) -> "List[Tuple[int, int]]":
        """(device, inode) of each of UUID's SLOTS slot files that exists (root's, regular)."""
        out: "List[Tuple[int, int]]" = []
        if self.share_dir is None:
            return out
        for slot in range(1, slots + 1):
            try:
                st = posix.stat(self.slot_path(uuid, slot), follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_uid == self.owner:
                out.append((st.st_dev, st.st_ino))
        return out

    def forget(self, uuid: str) -> None:
        self._idents.pop(uuid, None)
        fd = self._fds.pop(uuid, None)
        if fd is not None:
            posix.close(fd)

    def take(self, uuids: "Iterable[str]") -> "Lease":
        """Hand the (locked) descriptors of UUIDS over to a Lease; close the others."""
        chosen = {u: self._fds.pop(u) for u in uuids}
        for u in chosen:
            self._idents.pop(u, None)
        slots = {u: self._slots.pop(u) for u in chosen if u in self._slots}
        self.close()
        return Lease(chosen, slots)

    def close(self) -> None:
        for fd in list(self._slots.values()) + list(self._fds.values()) + list(self._probes.values()):
            posix.close(fd)
        self._fds.clear()
        self._idents.clear()
        self._slots.clear()
        self._probes.clear()


def _flock_current(fd: int, path: str, how: int, ident: "Optional[Tuple[int, int]]" = None) -> bool:
    """flock FD (HOW, without blocking) and check it is still the file at PATH.

    sync removes the files of vanished devices while holding their lock; a lock won on such
    an unlinked file would not exclude a holder of a new file. False (unlocked) otherwise.
    """
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise
    if not _same_file(fd, path, ident):
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    return True


def _same_file(fd: int, path: str, ident: "Optional[Tuple[int, int]]" = None) -> bool:
    """Whether FD (whose file is IDENT, (device, inode), where known) is still the file at
    PATH (sync has not replaced or removed it)."""
    try:
        current = posix.stat(path, follow_symlinks=False)
    except OSError:
        return False
    if ident is None:
        mine = posix.fstat(fd)
        ident = (mine.st_dev, mine.st_ino)
    return (current.st_dev, current.st_ino) == ident


def _lock_fields(line: str) -> "Optional[Tuple[int, int, int, bool]]":
    """(pid, device, inode, exclusive) of one granted flock line of /proc/locks or fdinfo."""
    parts = line.split()
    if len(parts) < 6 or parts[1] != "FLOCK":  # "->" marks a blocked request, not a lock
        return None
    try:
        major, minor, inode = parts[5].split(":")
        return int(parts[4]), posix.makedev(int(major, 16), int(minor, 16)), int(inode), parts[3] == "WRITE"
    except ValueError:
        return None


def lock_kind(fd: int, pid: str = "self") -> "Optional[bool]":
    """The flock the open file description behind PID's FD holds now: True exclusive,
    False shared, None none.

    The kernel lists in /proc/PID/fdinfo/FD only the locks that this very open file
    description owns, so this tells "locked through this descriptor" from "locked by
    someone else" without trying the lock (which would take a free one).
    """
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("lock:"):
            fields = _lock_fields(line[len("lock:"):])
            if fields is not None:
                return fields[3]
    return None


# The sizes of the read calls of the second and third reads of /proc/locks (see lock_table):
# the kernel finds its place anew where each call's buffer ran full, so these put the
# places where a read can skip a lock elsewhere than a page (~70 locks) apart.
_REREAD_SIZES = (2500, 1700)


def _read_locks(size: int = 1 << 16) -> "Tuple[Dict[str, str], int]":
    """The lines of one read of /proc/locks (read calls of SIZE bytes), keyed by what they
    say (without the number of their place, which shifts); and how many calls gave data."""
    pieces: "List[bytes]" = []
    try:
        fd = posix.open("/proc/locks", posix.O_RDONLY | posix.O_CLOEXEC)
    except OSError:
        return {}, 0
    try:
        while True:
            piece = posix.read(fd, size)
            if not piece:
                break
            pieces.append(piece)
    except OSError:
        pass
    finally:
        posix.close(fd)
    lines = b"".join(pieces).decode("ascii", "replace").splitlines()
    return {line.partition(":")[2]: line for line in lines}, len(pieces)


def lock_table() -> "Dict[Tuple[int, int], List[Tuple[int, bool]]]":
    """(device, inode) -> (pid that took it, exclusive) for each granted flock (/proc/locks).

    A file has one exclusive lock or any number of shared ones (a device's sharers). The pid
    is the one that took the lock: it may have exited since (a child holding the descriptor
    keeps the lock) or been reused. Check it with `fd_holders` before naming it.

    The kernel hands /proc/locks out at most a page (~70 locks) per read call and finds its
    place anew by counting for each: a lock let go meanwhile earlier in the list shifts the
    rest, and the held lock at the page's edge is skipped (one shown twice, when one is
    taken). With 600 locks held and others taking and letting go of 100, up to half the reads
    missed a held one. A lease seen free that is held costs only a lost race, but a waiter whose
    entry is missed looks dead (it put itself last in line), and a user whose lease is
    missed looks under their limit. So a listing that took several calls is read again with
    calls of other sizes, whose edges fall on other locks: a lock skipped by one read is seen
    by the next. Two reads that agree are taken as whole; otherwise every lock seen in any
    counts (one let go meanwhile counts held for this look; its close wakes the watchers).
    0 misses in 15,000 tables under the same churn (tests/test_locktable.py). Lines
    are told apart by what they say: one process's two shared locks on one file count once.
    """
    lines, calls = _read_locks()
    previous = lines.keys()
    for size in _REREAD_SIZES:
        if calls <= 1:
            break  # one call: one consistent pass over the list
        again, calls = _read_locks(size)
        if again.keys() == previous:
            break
        lines = {**lines, **again}
        previous = again.keys()
    table: "Dict[Tuple[int, int], List[Tuple[int, bool]]]" = {}
    for line in lines.values():
        fields = _lock_fields(line)
        if fields is not None:
            pid, dev, inode, exclusive = fields
            table.setdefault((dev, inode), []).append((pid, exclusive))
    return table


def first_pids(table: "Dict[Tuple[int, int], List[Tuple[int, bool]]]") -> "Dict[Tuple[int, int], int]":
    return {key: entries[0][0] for key, entries in table.items()}
