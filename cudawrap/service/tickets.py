"""Reconnect tickets: a waiting run keeps its place in line across a restart of the service.

When the service puts a run in line it gives it a ticket (a field of its ``wait`` message):
``1.UID.PID.START.ARRIVAL.EXPIRY.MAC``, where START is the process's start time (clock
ticks since boot, so the pid names one process for good), ARRIVAL the service's clock at
the request (ns) and EXPIRY when the ticket lapses (ms). MAC is an HMAC-SHA256 of all of
it and the boot id, under a key only root reads (the state directory's ``service.key``,
0600). The client only echoes it: should the connection end before a grant (the service
died), the run sends it with its request to the restarted service, which honours it
(the run gets its original arrival back) only when the signature verifies; the uid, pid
and start time are the kernel's word for the connection (SO_PEERCRED, /proc); it has not
lapsed; it was given by an earlier service (one that started before this one) and comes
back within RECONNECT_S of this one's start; and it has not restored a place already.
Anything else is a newcomer, and the service's log says why. So a ticket cannot be handed
to another process or user, forged, or used to jump the line outside a restart.

A restarted service grants nothing for GRACE_S, or until as many tickets came back as runs
held them in its predecessor (Census): then it decides for everyone in line at once, the
runs that waited before the restart in their old places and newcomers in theirs, so a
newcomer that happened to reach it first is not granted ahead of them.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import stat
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

VERSION = "1"
KEY_BYTES = 32
MAC_HEX = 32  # 128 bits of the HMAC: unguessable, and the message stays short
MAX_TICKET = 160
# A ticket's life. The service gives each waiter a new one every REFRESH_S, so a run that
# has waited for hours still holds a live one; an old one replayed later has lapsed.
TTL_S = 300.0
REFRESH_S = TTL_S / 2
# Runs whose service went away try again every ~0.2 s for connect_retry_s (launch/client.py), so
# those that are still there are back within a second of the restart on an idle machine;
# 30 s leaves room for a loaded one and for thousands of waiters in the backlog.
RECONNECT_S = 30.0
# How long a restarted service grants nothing while the runs that waited before it come back:
# fifteen of the clients' retry gaps (0.2 s), so every waiter that is still alive has tried
# again within it even on a loaded machine; it ends early once they all came back.
GRACE_S = 3.0


class Refused(ValueError):
    """Why a ticket restores nothing (the run waits as a newcomer)."""


def load_key(path: Path) -> Tuple[bytes, str]:
    """The service's key at PATH, and "" or why it was made anew: a missing key, or one the
    service cannot trust (not a plain file of its own user, mode 0600, of the right size,
    with one name) is replaced by a new random one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return _new_key(path), "missing"
    except OSError as exc:
        return _new_key(path), f"cannot be read ({exc.strerror})"
    try:
        st = os.fstat(fd)
        data = os.read(fd, KEY_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        why = "not a plain file"
    elif st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o600 or st.st_nlink != 1:
        why = f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}, {st.st_nlink} names"
    elif len(data) != KEY_BYTES:
        why = f"{len(data)} bytes long"
    else:
        return data, ""
    return _new_key(path), why


def _new_key(path: Path) -> bytes:
    key = os.urandom(KEY_BYTES)
    _replace(path, key, 0o600, durable=True)
    return key


def _replace(path: Path, data: bytes, mode: int, durable: bool = False) -> None:
    """PATH now holds DATA, mode MODE (whatever the umask): written beside it, then renamed
    over it, so a reader sees the old file or the new one whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _boot_id() -> str:
    from ..ledger.looks import boot_id

    return boot_id()


class Tickets:
    """Gives tickets and judges them, for one run of the service (started at STARTED)."""

    def __init__(self, key: bytes, started: float, boot: Optional[str] = None) -> None:
        self.key = key
        self.started = started
        self.boot = _boot_id() if boot is None else boot
        self.spent: Dict[str, float] = {}  # MAC -> its expiry (s): places restored already

    def _mac(self, uid: int, pid: int, start: int, arrival_ns: int, expiry_ms: int) -> str:
        text = f"{VERSION}|{self.boot}|{uid}|{pid}|{start}|{arrival_ns}|{expiry_ms}".encode("ascii")
        return hmac.new(self.key, text, hashlib.sha256).hexdigest()[:MAC_HEX]

    def issue(self, uid: int, pid: int, start: int, arrival_ns: int, now: float) -> str:
        """The ticket of the process PID (started at START) of UID, in line since ARRIVAL_NS."""
        expiry_ms = int((now + TTL_S) * 1000)
        mac = self._mac(uid, pid, start, arrival_ns, expiry_ms)
        return f"{VERSION}.{uid}.{pid}.{start}.{arrival_ns}.{expiry_ms}.{mac}"

    def check(self, text: str, uid: int, pid: int, start: Optional[int], now: float) -> int:
        """The arrival (ns) TEXT restores for the process PID (started at START) of UID, as the
        kernel names the connection; Refused (with the reason) when it restores nothing.
        A ticket honoured once is spent."""
        parts = text.split(".")
        if (len(text) > MAX_TICKET or len(parts) != 7 or parts[0] != VERSION
                or not all(p.isascii() and p.isdigit() for p in parts[1:6])
                or len(parts[6]) != MAC_HEX):
            raise Refused("not a ticket")
        t_uid, t_pid, t_start, arrival_ns, expiry_ms = (int(p) for p in parts[1:6])
        mac = parts[6]
        if not hmac.compare_digest(mac, self._mac(t_uid, t_pid, t_start, arrival_ns, expiry_ms)):
            raise Refused("its signature does not verify (forged, altered, or from before a reboot)")
        if t_uid != uid:
            raise Refused(f"it was given to uid {t_uid}")
        if t_pid != pid or t_start != start:
            raise Refused(f"it was given to another process (pid {t_pid})")
        expiry = expiry_ms / 1000
        if now >= expiry:
            raise Refused(f"it lapsed {now - expiry:.0f} s ago")
        if expiry - TTL_S >= self.started:
            raise Refused("it was given by this service: it keeps a place only across a restart")
        if now >= self.started + RECONNECT_S:
            raise Refused(f"it came back more than {RECONNECT_S:g} s after the restart")
        self.spent = {m: e for m, e in self.spent.items() if e > now}
        if mac in self.spent:
            raise Refused("it has restored a place already")
        self.spent[mac] = expiry
        return arrival_ns


class Census:
    """How many runs hold tickets, as the service's last word to a successor (a root file in
    the runtime directory, a tmpfs: gone after a reboot, as the runs are). A rise is written
    at once (a successor that expects too few would end its grace before all are back), a
    fall at most once a second (one that expects too many only waits out GRACE_S), and
    the same count again every REFRESH_S, so its time says whether those tickets may still
    be live.

    It is written in place, one record of one length over the last, through a descriptor
    kept open: a reader sees one record whole (a successor reads it once this service is
    gone), and the loop that writes it between hand-overs pays a write, not a new file
    renamed over the old one (~2.4 ms on ext4, which flushes the new file's data first: a
    runtime directory that is no tmpfs, as in a prefix install)."""

    WIDTH = 10  # digits of the count: every record is as long as the last

    def __init__(self, path: Path) -> None:
        self.path = path
        self.written = -1
        self.at = float("-inf")
        self.fd = -1

    def previous(self, now: float) -> int:
        """How many runs waited in the service before this one (0 if it said nothing, or its
        word is older than a ticket's life, or the file is not the service's own)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return 0
        try:
            st = os.fstat(fd)
            data = os.read(fd, 64) if stat.S_ISREG(st.st_mode) else b""
        finally:
            os.close(fd)
        words = data.split()
        if st.st_uid != os.geteuid() or st.st_mode & 0o022 or len(words) != 2 or not words[0].isdigit():
            return 0
        try:
            said = float(words[1])
        except ValueError:
            return 0
        return int(words[0]) if now - said < TTL_S else 0

    def note(self, count: int, now: float, exact: bool = False) -> None:
        """Record COUNT waiters (NOW: time.monotonic()), as often as the class says; EXACT:
        now, whatever was written when (the service's last word as it stops: a successor
        told of runs that left the line meanwhile would wait out its grace for them)."""
        if not exact and count == self.written and now - self.at < REFRESH_S:
            return
        if not exact and count < self.written and now - self.at < 1.0:
            return
        try:
            self._write(f"{count:{self.WIDTH}d} {time.time():.3f}\n".encode("ascii"))
        except OSError:
            return  # the runtime directory is gone: a restart then waits for nobody
        self.written, self.at = count, now

    def _write(self, record: bytes) -> None:
        if self.fd >= 0 and os.fstat(self.fd).st_nlink == 0:
            os.close(self.fd)  # removed meanwhile (the runtime directory made anew): a new file
            self.fd = -1
        if self.fd < 0:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
                    raise OSError(f"{self.path} is not a file of the service's own")
                os.fchmod(fd, 0o644)  # whatever the umask
                os.ftruncate(fd, 0)  # a longer record of an older version's
            except OSError:
                os.close(fd)
                raise
            self.fd = fd
        os.pwrite(self.fd, record, 0)
