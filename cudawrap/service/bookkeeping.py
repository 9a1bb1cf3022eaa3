"""The ledger, written by the service at the moment a grant is made and when it ends.

The record is in the file (the page cache) before the descriptors leave, which a crash of
the service cannot lose; the fsync that makes it survive a crash of the machine (which
ends every lease anyway) is left to ledgerturn.flush(), which the service calls once it is
idle, so the disk's latency is not a launch's. When and under which lock the records are
written (one turn of the service's loop) is ledgerturn.py's.

Records have the daemonless ledger's shape (ledger.observe) with exact times
(``start_lo == start_hi``, ``end_lo == end_hi``) and ``seen_by = "service"``. Each grant
is written before its descriptors are sent (a crash between the two loses no record) and
entered in the ledger's state as open, so a root command's later look (status, usage, the
monitor) knows it already; its end is written only while the state still has it open, so
neither side records a lease twice.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..ledger import looks as ledger, files as ledgerfile
from ..paths import Layout
from ..base.users import user_name
from . import ledgerturn


def _client(pid: int, program: str, ticks: Optional[int] = None, exe: Optional[str] = None
            ) -> Optional[Tuple[int, str, str]]:
    """PID's start (clock ticks since boot), its program's name and its executable; None when
    it is gone. PROGRAM (a shim's run: the link the kernel says it runs) spares reading /proc
    for a name, and TICKS and EXE (read when it connected) for its start and its executable
    (for a run waiting in the waiter, the waiter's at its grant, the interpreter's then): a
    client gone since is told by the send, which then fails."""
    from ..base.proc import executable, start_time

    if not program:
        p = ledger.proc(pid)
        return (p.ticks, p.program, p.exe) if p is not None else None
    ticks = start_time(pid) if ticks is None else ticks
    return None if ticks is None else (ticks, program.rsplit("/", 1)[-1], executable(pid) if exe is None else exe)


def grant(layout: Layout, pid: int, uid: int, devices: List[str], program: str, asked: float,
          shared: Optional[float], send: Callable[[], bool], ticks: Optional[int] = None,
          exe: Optional[str] = None) -> Optional[str]:
    """Record the grant of DEVICES to PID (asked at ASKED, time.time()), SEND it (its
    descriptors), then enter it in the ledger's state as open; its lease id, or None when PID
    is gone already or the sending failed (its end is recorded then). SHARED: a grant of
    shares, and what it counts as, in devices (as a look records a share: ledger._grant);
    TICKS, EXE: PID's start and executable, where they were read before (_client).

    The record is written before the descriptors leave (a crash between the two loses no
    record), the state after (ledgerturn's turn), so the launch waits for neither the state's rewrite
    nor a look."""
    client = _client(pid, program, ticks, exe)
    if client is None:
        return None
    ticks, name, exe = client
    now = time.time()
    boot = ledgerturn.boot()
    lid = ledger.lease_id(boot, pid, ticks, sorted(devices))
    record: Dict[str, Any] = {
        "v": ledgerfile.RECORD_VERSION, "event": "grant", "id": lid, "uid": uid, "user": user_name(uid),
        "pid": pid, "ticks": ticks, "program": name, "exe": exe,
        "devices": sorted(devices), "start": round(now, 3), "start_lo": round(now, 3), "start_hi": round(now, 3),
        "seen_by": "service", "seen": now, "wait_s": round(max(now - asked, 0.0), 3)}
    if shared is not None:
        record["shared"] = True
        record["devices_held"] = round(shared, 4)
    with ledgerturn.turn(layout) as t:
        # The state is read before the send only until it is seen to be this boot's: after
        # that, the lock alone (a look waits for it), and the state read at the turn's end,
        # once its grants are sent.
        if ledgerturn.boot_current():
            t.locked()
        elif t.open()["boot"] not in ("", boot):
            return lid if send() else None  # a look after the restart records it (and ends what the old boot held)
        t.append(record)
        if not send():
            t.append(ledger.end_record(record, now, now, now, "not taken (the client went away)", "service"))
            return None
        # Entered as open at the turn's end (settle): a second grant of the turn (seven
        # releases at once) is sent before the state is read (~0.1 ms on a cold CPU).
        t.opened.append((lid, record, boot))
    return lid


def end(layout: Layout, lid: str, how: str = "ended") -> None:
    """Record the end of lease LID, at this time, unless a look recorded it already: written
    at the turn's end (ledgerturn's settle), after the turn's grants are sent, so a hand-over's
    grant waits neither for the state's read nor for the end's record."""
    now = time.time()
    with ledgerturn.turn(layout) as t:
        t.ends.append((lid, now, how))


TAIL_BYTES = 1 << 20  # of the ledger, read at a start for grants the state missed: far more than one turn writes


def recover(layout: Layout) -> Tuple[int, int]:
    """Bring the ledger's state up to its last records, which a service killed before its
    turn's state was written (turn(carry=True): up to CARRY_MAX_S after them) left behind.
    Before the monitor's first look, which would otherwise record them again: grants recorded
    and sent (of this boot, with no end) are entered as open; leases whose end is recorded are
    no longer open (a restarted service would end them a second time). How many of each."""
    path = layout.state_dir / ledgerfile.STATE
    with ledgerfile.Locked(layout):
        state = ledger.load_state(path)
        boot = ledger.boot_id()
        if state["boot"] not in ("", boot):
            return 0, 0  # a look after the reboot ends what the old boot held
        granted: Dict[str, Dict[str, Any]] = {}
        ended = set()
        for record in ledgerfile.tail(ledgerfile.ledger_path(layout), TAIL_BYTES):
            if record["event"] == "end":
                ended.add(record["id"])
            elif record.get("seen_by") == "service" and record["id"].startswith(boot[:8]):
                granted[record["id"]] = record
        missing = {i: r for i, r in granted.items() if i not in ended and i not in state["open"]}
        closed = [i for i in state["open"] if i in ended]
        for lid in closed:
            del state["open"][lid]
        if missing:
            state["boot"] = boot
            state["open"].update(missing)
        if missing or closed:
            ledger.save_state(path, state)
    return len(missing), len(closed)


def still_open(layout: Layout) -> List[Dict[str, Any]]:
    """The grants a service recorded that no end has closed yet (for a restarted service)."""
    path = layout.state_dir / ledgerfile.STATE
    with ledgerfile.Locked(layout):
        state = ledger.load_state(path)
    if state["boot"] != ledger.boot_id():
        return []
    return [r for r in state["open"].values() if r.get("seen_by") == "service"]
