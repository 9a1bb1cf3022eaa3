"""The wait queue: one entry file per waiting run, trusted only as far as the kernel vouches.

Each waiter creates an entry in the sticky, world-writable queue directory and holds an
exclusive flock on it while it waits. Everything an entry says about itself is written by
a user, so a reader believes only what the kernel guarantees:

* *alive*: /proc/locks shows a flock on the entry's inode taken by the pid in its name
  (a dead waiter's lock is gone; a lock someone else took on it does not count);
* *whose*: the file's owner, which must also own that pid; it must be a regular file with
  one link (no hard link to somebody else's file);
* *since when*: its ctime, which only the kernel sets (the time it was linked into
  place); the time in its name only tells entries of one moment apart.

What the name claims besides (count, placement, how long before devices are reserved for
it) only shapes that user's own turns, within what the admin's config allows any run
(schedule.Bounds: never reserved for sooner than the config's shortest reserve_after, nor
for a count that can never be met). Only a user's oldest MAX_ENTRIES_PER_USER entries
count in any decision, however many they made. Entries are found with one directory scan
and one read of /proc/locks, O(entries); the file itself is opened only for runs that
narrowed their devices (the list is inside) and for `cudawrap status`.

Entry name: ``<arrival ns, 20 digits>.<pid>.<count><placement><a|n>.<reserve s|inf>.wait``.
"""

import posix
import stat
import time

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, FrozenSet, List, Optional, Tuple

    from .terms import Waiter

from ..base.posixos import same
from ..errors import NoDeviceError, SetupError
from ..lease.files import SYNC_HINT, first_pids, lock_table
from .request import Request

SUFFIX = ".wait"
# A user may have this many runs waiting at once: bounds what one user adds to every scan.
MAX_ENTRIES_PER_USER = 1000
_READ_FLAGS = posix.O_RDONLY | posix.O_NOFOLLOW | posix.O_CLOEXEC | posix.O_NONBLOCK
_PLACEMENT_CODES = {"spread": "s", "pack": "k", "random": "r"}
_PLACEMENTS = {v: k for k, v in _PLACEMENT_CODES.items()}
_MAX_INFO = 64 << 10


def entry_name(key_ns: int, pid: int, request: "Request") -> str:
    """The name of PID's entry for REQUEST: what every reader needs of it; the devices it may
    use and its memory and load filters are in the file ("n": narrowed, read them there)."""
    narrowed = request.candidates is not None or request.dynamic
    reserve = "inf" if request.reserve_after == float("inf") else str(int(request.reserve_after))
    return (f"{key_ns:020d}.{pid}.{request.count}{_PLACEMENT_CODES.get(request.placement, 's')}"
            f"{'n' if narrowed else 'a'}{'h' if request.share else ''}.{reserve}{SUFFIX}")


def parse_name(name: str) -> "Optional[Tuple[int, int, Request, bool]]":
    """(key ns, pid, request, narrowed) from an entry NAME, or None; a narrowed entry's
    request is completed from its file. A shared run's request ends in "h" (a share of each
    device, not the devices).

    ASCII digits only: anyone can create names here, and int() accepts "²" and "1_000".
    """
    if not name.endswith(SUFFIX):
        return None
    parts = name[:-len(SUFFIX)].split(".")
    if len(parts) != 4:
        return None
    key, pid, req, reserve = parts
    share = req.endswith("h")
    if share:
        req = req[:-1]
    digits = req[:-2]
    if not (len(key) == 20 and _digits(key) and _digits(pid) and len(pid) <= 9 and digits
            and _digits(digits) and len(digits) <= 3 and req[-2] in _PLACEMENTS and req[-1] in "an"):
        return None
    if reserve == "inf":
        reserve_s = float("inf")
    elif _digits(reserve) and len(reserve) <= 12:
        reserve_s = float(reserve)
    else:
        return None
    count = int(digits)
    if count < 1:
        return None
    return int(key), int(pid), Request(count, None, _PLACEMENTS[req[-2]], reserve_s, share=share), req[-1] == "n"


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


def parse_info(data: bytes) -> "Dict[str, str]":
    """key=value lines of an entry's contents (untrusted text)."""
    out: "Dict[str, str]" = {}
    for line in data.decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition("=")
        if sep and key not in out:
            out[key] = value
    return out


class Entry:
    """This process's place in the queue."""

    def __init__(self, name: str, fd: int, path: str) -> None:
        self.name = name
        self.fd = fd
        self.path = path
        self.size = posix.fstat(fd).st_size


class Scan:
    """The live, valid waiters at one moment, and the lock table it was judged by."""

    def __init__(self, waiters: "List[Waiter]", table: "Dict[Tuple[int, int], List[Tuple[int, bool]]]",
                 paths: "Dict[str, str]") -> None:
        self.waiters = waiters
        self.table = table  # lock_table(): every flock, shared ones (device shares) included
        self.locks = first_pids(table)
        self.paths = paths  # key -> entry path


class WaitQueue:
    def __init__(self, queue_dir: str) -> None:
        self.dir = queue_dir
        try:
            st = posix.stat(queue_dir)
        except OSError:
            raise SetupError(f"the queue directory {queue_dir} is missing", hint=SYNC_HINT) from None
        # Sticky and world-writable, like /tmp: anyone may queue, nobody may remove
        # another user's entry.
        if not stat.S_ISDIR(st.st_mode) or not st.st_mode & stat.S_ISVTX:
            raise SetupError(f"the queue directory {queue_dir} is not a sticky directory",
                             hint="run `cudawrap doctor --repair` as root")
        self.dev = st.st_dev
        self.uid = posix.geteuid()
        # Per entry (name and inode: inodes are reused as entries come and go, names never):
        # what was read once, as entries never change what they claim.
        self._asks: "Dict[Tuple[str, int], Optional[Tuple[Optional[FrozenSet[str]], int, int]]]" = {}
        self._owner_ok: "Dict[Tuple[int, int], bool]" = {}

    # -- reading ---------------------------------------------------------------------------
    def idle(self) -> bool:
        """Whether no entry at all is in the queue (live or dead: either way, not idle)."""
        try:
            with posix.scandir(self.dir) as it:
                return not any(item.name.endswith(SUFFIX) for item in it)
        except OSError:
            return False

    def scan(self, clean: bool = True, mine: str = "", bounded: bool = True) -> "Scan":
        """Every live and valid waiter; dead entries we may remove are removed (CLEAN).
        MINE: the caller's own entry, alive whatever the lock table says (we hold its lock).
        BOUNDED: only each user's oldest MAX_ENTRIES_PER_USER (as every decision counts them)."""
        from .terms import Waiter  # here, not at the top: a launch nobody waits before never scans

        waiters: "List[Waiter]" = []
        paths: "Dict[str, str]" = {}
        try:
            with posix.scandir(self.dir) as it:
                items = list(it)
        except OSError:
            return Scan(waiters, lock_table(), paths)
        # The lock table is read after the listing: an entry is linked into place only once
        # its owner holds the lock, so every name listed either shows its lock here or is
        # really gone. (Read before, a newcomer would look dead and be removed.)
        table = lock_table()
        locks = first_pids(table)
        found: "List[Tuple[int, str, int, int, int, Request, bool]]" = []
        for item in items:
            parsed = parse_name(item.name)
            if parsed is None:
                continue
            _key_ns, pid, request, narrowed = parsed
            holder = pid if item.name == mine else locks.get((self.dev, item.inode()))
            if holder != pid:
                if holder is None and clean:
                    self._remove_dead(self.dir + "/" + item.name)
                continue
            try:
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or not self._owns(st.st_uid, pid):
                continue
            # Arrived when it was linked into place (its ctime, set by the kernel only), not
            # when its name says: the name is the user's word.
            found.append((st.st_ctime_ns, item.name, st.st_ino, st.st_uid, pid, request, narrowed))
        found.sort(key=lambda f: f[:2])  # (arrival, name): unique
        per_user: "Dict[int, int]" = {}
        for arrival_ns, name, ino, uid, pid, request, narrowed in found:
            # A user's oldest MAX_ENTRIES_PER_USER count, in every decision: the bound holds
            # whoever made the entries (enqueue checks it only for runs that queue honestly).
            per_user[uid] = per_user.get(uid, 0) + 1
            if bounded and per_user[uid] > MAX_ENTRIES_PER_USER:
                continue
            path = self.dir + "/" + name
            if narrowed:
                ident = (name, ino)
                if ident not in self._asks:
                    if len(self._asks) > 4 * MAX_ENTRIES_PER_USER:
                        self._asks.clear()
                    self._asks[ident] = self._read_asks(path)
                asks = self._asks[ident]
                if asks is None:
                    continue
                request = request.replace(candidates=asks[0], min_free_mib=asks[1], max_util=asks[2])
            waiters.append(Waiter(name, uid, pid, request, arrival_ns / 1e9))
            paths[name] = path
        return Scan(waiters, table, paths)

    def _owns(self, uid: int, pid: int) -> bool:
        """Whether UID owns process PID (the lock holder), remembered per pid: one process
        holding many entries is asked about once."""
        known = self._owner_ok.get((uid, pid))
        if known is None:
            from ..base.proc import real_uid  # only for an entry not seen before

            known = real_uid(pid) == uid
            if len(self._owner_ok) > 4 * MAX_ENTRIES_PER_USER:
                self._owner_ok.clear()
            self._owner_ok[(uid, pid)] = known
        return known

    def _read_asks(self, path: str) -> "Optional[Tuple[Optional[FrozenSet[str]], int, int]]":
        """(devices it may use or None for any, min free MiB, max utilisation %) from PATH."""
        info = self.read_info(path)
        if info is None:
            return None
        listed = info.get("candidates")
        candidates = None if listed is None else frozenset(u for u in listed.split(",") if u)
        numbers = []
        for key, default in (("min_free_mib", 0), ("max_util", 100)):
            text = info.get(key, str(default))
            if not (_digits(text) and len(text) <= 9):
                return None
            numbers.append(int(text))
        return candidates, numbers[0], numbers[1]

    @staticmethod
    def read_info(path: str) -> "Optional[Dict[str, str]]":
        try:
            fd = posix.open(path, _READ_FLAGS)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(posix.fstat(fd).st_mode):
                return None
            return parse_info(posix.read(fd, _MAX_INFO))
        except OSError:
            return None
        finally:
            posix.close(fd)

    def _remove_dead(self, path: str) -> None:
        """Remove a dead entry: our own, or anyone's as root (the sticky bit refuses the rest),
        and only once a lock on it is seen to be free (the kernel's word, not the table's)."""
        import fcntl

        try:
            if self.uid != 0 and posix.lstat(path).st_uid != self.uid:
                return
            fd = posix.open(path, _READ_FLAGS)
        except OSError:
            return
        try:
            if not stat.S_ISREG(posix.fstat(fd).st_mode):
                return
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            posix.unlink(path)  # while holding the lock: nobody is waiting on it
        except OSError:
            pass  # locked: alive after all
        finally:
            posix.close(fd)

    # -- joining and leaving -----------------------------------------------------------------
    def enqueue(self, request: "Request", info: bytes, mine: int = 0) -> "Entry":
        """Join the queue with REQUEST (INFO: more lines for its file). MINE: this user's live
        entries already (for the per-user bound)."""
        if mine >= MAX_ENTRIES_PER_USER:
            raise NoDeviceError(f"you already have {mine} runs waiting, the most one user may have",
                                hint="wait for some of them to start, or cancel some (`cudawrap cancel PID`)")
        pid = posix.getpid()
        body = info
        if request.candidates is not None:
            body += ("candidates=" + ",".join(sorted(request.candidates)) + "\n").encode()
        if request.dynamic:
            body += f"min_free_mib={request.min_free_mib}\nmax_util={request.max_util}\n".encode()
        # Created 0600 and locked before anyone else may open it: a reader that took a
        # shared lock first would otherwise stall us (and be blamed on us). Unnamed
        # (O_TMPFILE) until linked into place, so that joining removes no temporary name:
        # far-back waiters sleep until something is removed (farwait).
        key_ns = time.time_ns()
        tmp = None
        try:
            fd = posix.open(self.dir, posix.O_TMPFILE | posix.O_RDWR | posix.O_CLOEXEC, 0o600)
            source = f"/proc/self/fd/{fd}"  # linked with AT_SYMLINK_FOLLOW, as open(2) shows
            link: "Dict[str, int]" = {"src_dir_fd": fd}  # any dir fd makes posix.link use linkat (not link(), which
            # would try to link the /proc symlink itself); an absolute path ignores it
        except (AttributeError, OSError):  # a file system without O_TMPFILE: a named one
            fd = -1
            link = {}
        while fd < 0:
            tmp = source = f"{self.dir}/.new-{pid}-{key_ns}"
            try:
                fd = posix.open(tmp, posix.O_RDWR | posix.O_CREAT | posix.O_EXCL | posix.O_NOFOLLOW | posix.O_CLOEXEC, 0o600)
            except FileExistsError:  # planted by someone else: never opened, just avoided
                key_ns += 1
            except OSError as exc:
                raise SetupError(f"cannot join the wait queue in {self.dir}: {exc.strerror}",
                                 hint="ask an admin to check the runtime file system (`cudawrap doctor`)") from None
        import fcntl

        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            posix.write(fd, body)
            posix.fchmod(fd, 0o644)  # now others may read what we ask for
            while True:
                name = entry_name(key_ns, pid, request)
                try:
                    posix.link(source, self.dir + "/" + name, **link)  # link, unlike rename, never replaces
                    break
                except FileExistsError:
                    key_ns += 1
        except OSError as exc:
            posix.close(fd)
            raise SetupError(f"cannot join the wait queue in {self.dir}: {exc.strerror}",
                             hint="ask an admin to check the runtime file system (`cudawrap doctor`)") from None
        finally:
            if tmp is not None:
                try:
                    posix.unlink(tmp)
                except OSError:
                    pass
        return Entry(name, fd, self.dir + "/" + name)

    def leave(self, entry: "Entry") -> None:
        try:
            posix.unlink(entry.path)
        except OSError:
            pass
        if entry.fd >= 0:
            posix.close(entry.fd)  # drops the lock
            entry.fd = -1

    def cancelled_by(self, entry: "Entry") -> "Optional[str]":
        """Who cancelled ENTRY (`cudawrap cancel` appended a line), or None."""
        try:
            size = posix.fstat(entry.fd).st_size
        except OSError:
            return None
        if size == entry.size:
            return None
        data = posix.pread(entry.fd, min(size, _MAX_INFO), 0)
        by = parse_info(data).get("cancel")
        return by if by else None


def poke(path: str) -> None:
    """Wake the waiter of entry PATH: it watches its entry for opens (see acquire.Watch)."""
    try:
        posix.close(posix.open(path, _READ_FLAGS))
    except OSError:
        pass


def cancel(path: str, by: str) -> None:
    """Tell the waiter of PATH to give up, and take its entry out of the queue: only its
    owner and root can write it (and, the directory being sticky, remove it).

    The waiter reads the line through its own descriptor, so removing the entry at once
    costs it nothing; a process that never reads it (an entry made by hand) is out of
    everyone's decisions all the same, as nobody sees a removed entry."""
    fd = posix.open(path, posix.O_WRONLY | posix.O_APPEND | posix.O_NOFOLLOW | posix.O_CLOEXEC | posix.O_NONBLOCK)
    try:
        posix.write(fd, f"cancel={by}\n".encode("utf-8", "replace"))
        if same(posix.fstat(fd), posix.lstat(path)):  # not one made since under its name
            posix.unlink(path)
    finally:
        posix.close(fd)
