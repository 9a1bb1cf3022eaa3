"""`cudawrap revoke DEVICE`: root takes a lease from whoever holds it, wherever its descriptor went.

A lease is its open file description's flock, which its holder may have passed anywhere
(a child, a socket's queue, a mapping): nobody can take it back. So the lease file (and the
device's slot files) is replaced by a fresh one (lease/renew.py): the old descriptor then
guards nothing, and the device is free for the next run. The service does it in its loop
when it runs (its grants of the device end, recorded as revoked, their runs killed through
their pidfds); without it, here, with the ledger's open records of the device ended. Then
every process still holding a lock on the old files through a descriptor is killed: the
run and the children it passed the lease to.
"""
from __future__ import annotations

import os
import signal
from typing import Dict, List, Tuple

from ..launch import client
from .. import wire
from ..lease.holders import every_pid, fd_holders
from ..lease.renew import replace
from ..paths import Layout
from ..base.users import user_name
from . import bookkeeping
from ..ledger import files as ledgerfile, looks
from ..base.procinfo import process_info


def _files(layout: Layout, uuid: str) -> List[str]:
    """UUID's lease file and slot files."""
    try:
        slots = [n for n in os.listdir(layout.share_dir) if n.startswith(uuid + ".")]
    except OSError:
        slots = []
    return [str(layout.lease_dir / uuid)] + [str(layout.share_dir / n) for n in sorted(slots)]


def _idents(paths: List[str]) -> Dict[Tuple[int, int], str]:
    out = {}
    for path in paths:
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        out[(st.st_dev, st.st_ino)] = os.path.realpath(path)  # as the kernel names it
    return out


def revoke(layout: Layout, uuids: List[str], by: str) -> List[str]:
    """Revoke UUIDS (lease files there are); what was done, a line each."""
    lines: List[str] = []
    files = {u: _files(layout, u) for u in uuids}
    old = _idents([p for paths in files.values() for p in paths])
    reply = client.question(str(layout.root), wire.REVOKE, {"devices": ",".join(uuids), "by": by})
    spare = {os.getpid()}
    done = list(uuids)
    if reply is None:
        looks.look(layout, "revoke")  # the leases held now recorded, to be ended as revoked
        for paths in files.values():
            for path in paths:
                replace(path, held_too=True)
        _end_records(layout, uuids, by)
    else:
        for item in filter(None, reply.get("holders", "").split(",")):
            pid, _uid, what = (item.split(":") + ["", ""])[:3]
            uid = int(_uid) if _uid.isdigit() else -1
            lines.append(f"its grant to pid {pid} ({user_name(uid)}) ended"
                         + (": that run was killed" if what == "killed" else " (that run had exited)"))
        service = reply.get("service", "")
        spare.add(int(service) if service.isascii() and service.isdigit() else 0)
        done = [u for u in reply.get("revoked", "").split(",") if u]
    for pid, path in _holding(old):
        if pid in spare:
            continue
        info = process_info(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        lines.append(f"killed pid {pid} ({info['user']}: {info['command'][:40]}), which held {os.path.basename(path)}")
    return [f"revoked {u}" for u in done] + lines


def _holding(old: Dict[Tuple[int, int], str]) -> List[Tuple[int, str]]:
    """(pid, path) of each process holding a lock, through a descriptor of its own, on one of
    the replaced files OLD ((device, inode) -> the path it had): named by the kernel as that
    path "(deleted)", so that a new file given a freed inode's number is no match."""
    found = fd_holders(old, every_pid(), named={key: path + " (deleted)" for key, path in old.items()})
    first: Dict[int, str] = {}
    for key, pids in found.items():
        for pid in pids:
            first.setdefault(pid, old[key])
    return sorted(first.items())


def _end_records(layout: Layout, uuids: List[str], by: str) -> None:
    """The ledger's open records of UUIDS' leases end now, as revoked by BY (no service)."""
    path = layout.state_dir / ledgerfile.STATE
    if not path.exists():
        return
    with ledgerfile.Locked(layout):
        state = looks.load_state(path)
    for lid, record in state["open"].items():
        if set(record.get("devices", ())) & set(uuids):
            bookkeeping.end(layout, lid, f"revoked by {by}")
