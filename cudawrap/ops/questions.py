"""What the service answers besides requests: who holds and who waits, and cancels.

`cudawrap status` asks for the line as the service decides it (its own waiters and the
queue directory's, in one order) and for who holds each device it granted, named by the
kernel's word (the uid and program it knew at the grant). With ``private`` the asker sees
others' waits and leases without their names, pids and programs. `cudawrap cancel` sends
pids: the owner of a waiting run or root may end it, as the kernel says who is asking; the
run's client is answered with the reason and exits 75.
"""
from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional, Sequence

from ..errors import NotPermitted, UsageError
from ..sched.schedule import Verdict, Waiter
from .procinfo import printable
from ..users import either, user_name

HIDDEN = "?"


def _waiter(w: Waiter, verdict: Optional[Verdict], program: str, visible: bool) -> Dict[str, Any]:
    return {"key": w.key if visible else HIDDEN,  # a key holds its pid
            "user": user_name(w.uid) if visible else HIDDEN, "pid": w.pid if visible else None,
            "count": w.count, "program": printable(program) if visible else HIDDEN,
            "waiting_s": round(max(0.0, time.time() - w.arrival), 1),
            "position": verdict.position + 1 if verdict else None,
            "reason": verdict.text if verdict else "unknown",
            "candidates": sorted(w.candidates) if w.candidates is not None else None}


def line(entries: Sequence[Waiter], mine: Sequence[Waiter], verdicts: Dict[str, Verdict],
         programs: Dict[str, str], asker: int, private: bool) -> List[Dict[str, Any]]:
    """Everyone waiting, in the order they are served. PROGRAMS: a queue entry's own word
    of its program (its file), for what the service's waiters' kernel-read program is."""
    out = [_waiter(w, verdicts.get(w.key), programs.get(w.key, w.program),
                   not private or asker in (0, w.uid)) for w in list(entries) + list(mine)]
    out.sort(key=lambda w: (w["position"] is None, w["position"] or 0, w["key"]))
    return out


def holders(held: Sequence[Any], asker: int, private: bool) -> Dict[str, Dict[str, Any]]:
    """uuid -> the holder of each lease the service granted and that is not yet released.
    Shares are left out: a shared device has several, which the lock table names (status)."""
    out: Dict[str, Dict[str, Any]] = {}
    for h in held:
        visible = not private or asker in (0, h.uid)
        for uuid in h.devices:
            if uuid in h.ended or uuid in h.slots:
                continue
            # An exited client's pid names nobody now (or another user's process, reused).
            out[uuid] = {"pid": h.pid if visible and not h.exited else None,
                         "user": user_name(h.uid) if visible else HIDDEN,
                         "program": (h.program.rsplit("/", 1)[-1] or "(not a wrapped program)") if visible else HIDDEN,
                         "since": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(h.since)) if visible else HIDDEN}
    return out


def answer(waiting: List[Dict[str, Any]], held: Dict[str, Dict[str, Any]]) -> Dict[str, str]:
    return {"json": json.dumps({"waiting": waiting, "holders": held})}


def cancellable(pids_text: str, waiting: Dict[int, Any], asker: int, private: bool = False) -> List[Any]:
    """The service's waiting clients among PIDS_TEXT that ASKER may cancel, all checked
    first; NotPermitted for one that is someone else's (nothing is cancelled then), who is
    not named where PRIVATE."""
    chosen = []
    for text in pids_text.split(","):
        if not (text.isascii() and text.isdigit() and len(text) <= 9):
            raise UsageError(f"pids={pids_text[:40]!r}: not a list of pids")
        client = waiting.get(int(text))
        if client is None:
            continue
        if asker != 0 and client.peer.uid != asker and private:
            raise NotPermitted(f"pid {text} is not your run; only its owner or root may cancel it")
        if asker != 0 and client.peer.uid != asker:
            raise NotPermitted(f"pid {text} is {user_name(client.peer.uid)}'s run; only "
                               f"{either(client.peer.uid, 0)} may cancel it")
        chosen.append(client)
    return chosen


def whole(root: str, waiting: List[Dict[str, Any]], asker: int, private: bool, held: Sequence[Any]) -> str:
    """The whole of `cudawrap status` as root reads it, for ASKER, who cannot read the lease
    files (the service is the install's arbiter): this line, the holders the service granted named, others'
    hidden where PRIVATE. (NVML is read here, in the service's loop: a status costs the
    grants behind it a few milliseconds.)"""
    from pathlib import Path

    from ..paths import Layout
    from .status import machine_status

    # Others' runs, processes and leftovers are hidden there, as for the asker's own look.
    status = machine_status(Layout(Path(root)), ask_service=False, line=waiting, viewer=asker, private=private)
    named = holders(held, asker, private)
    for device in status["devices"]:
        holder = device.get("holder")
        if device["uuid"] in named and holder is not None and named[device["uuid"]]["pid"] is not None:
            device["holder"] = dict(holder, **named[device["uuid"]])
    return json.dumps(status, default=str)


def status(root: str, deciding: Any, claimed: Dict[str, Any], held: List[Any], clients: Sequence[Any],
           asker: int, private: bool, with_whole: bool) -> Dict[str, Any]:
    """The reply to a STATUS: the line as DECIDING (the service's ops.line.Line) decides it
    now with CLAIMED (the grants sent), the HELD grants and the service's waiting CLIENTS,
    as ASKER may see them; WITH_WHOLE, the user's whole status too (the service arbitrating)."""
    mine = [c.waiter for c in clients if c.waiter is not None]
    verdicts = deciding.decide(mine, claimed).finish()  # every waiter's verdict, not the grants alone
    waiting = line(deciding.entries, mine, verdicts, deciding.programs(), asker, private)
    reply = answer(waiting, holders(held, asker, private))
    # For `cudawrap cancel`: under private_status, the asker's own waiting runs only.
    reply["service_pids"] = ",".join(f"{c.peer.pid}:{c.peer.uid}" for c in clients
                                     if not private or asker in (0, c.peer.uid))
    if with_whole:
        reply["status"] = whole(root, waiting, asker, private, held)
    return reply
