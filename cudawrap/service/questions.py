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
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import NotPermitted, UsageError
from ..sched.schedule import GRANTED, Verdict, Waiter
from ..base.procinfo import printable
from ..base.users import either, user_name

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


def whole(root: str, waiting: List[Dict[str, Any]], asker: int, private: bool,
          named: Dict[str, Dict[str, Any]], pause: Callable[[], None] = lambda: None) -> str:
    """The whole of `cudawrap status` as root reads it, for ASKER, who cannot read the lease
    files (the service is the install's arbiter): this line, the holders the service granted
    (NAMED: holders()), others' hidden where PRIVATE. (NVML is read here, off the service's
    loop: reply().)"""
    from pathlib import Path

    from ..paths import Layout
    from ..ops.status import machine_status

    # Others' runs, processes and leftovers are hidden there, as for the asker's own look.
    status = machine_status(Layout(Path(root)), ask_service=False, line=waiting, viewer=asker, private=private)
    for device in status["devices"]:
        holder = device.get("holder")
        if device["uuid"] in named and holder is not None and named[device["uuid"]]["pid"] is not None:
            device["holder"] = dict(holder, **named[device["uuid"]])
    pause()
    return json.dumps(status, default=str)


class Look:
    """What a STATUS is answered from (reply()), taken on the service's loop: DECIDING's
    (the service's service.waitline.Line) decision now with CLAIMED (the grants sent) and GRANTED
    (the grants held), as far as its grants (its other verdicts are worked out from its own
    copies of the line), the queue entries it counted and their files, the HELD grants'
    holders and the waiting CLIENTS' pids, as ASKER may see them. What the loop changes
    after, the answer does not read: a status costs the loop a decision's look, no more."""

    __slots__ = ("root", "decision", "entries", "mine", "paths", "deciding", "named", "pids", "asker", "private",
                 "grants")

    def __init__(self, root: str, deciding: Any, claimed: Dict[str, Any], granted: Dict[str, int],
                 held: List[Any], clients: Sequence[Any], asker: int, private: bool) -> None:
        self.root, self.asker, self.private = root, asker, private
        self.mine = [c.waiter for c in clients if c.waiter is not None]
        # Every grant in it, as a decision of the loop's; its other verdicts (every waiter's
        # place and why: most of the work with 900 waiting) on the thread (Decision.finish).
        self.decision = deciding.decide(self.mine, claimed, granted)
        self.entries, self.paths, self.deciding = list(deciding.entries), dict(deciding.paths), deciding
        self.named = holders(held, asker, private)  # reads grants the loop changes: here
        # Whether it found a grant to make (the loop's next decision makes it): a status
        # that found none costs the loop no decision of its own.
        self.grants = any(v.kind == GRANTED for v in self.decision.values())
        self.pids = [(c.peer.pid, c.peer.uid) for c in clients]


def reply(seen: Look, with_whole: bool, pause: Callable[[], None] = lambda: None) -> Dict[str, str]:
    """Off the loop (service/answers.py: finish): the reply to a STATUS from SEEN, as its asker
    may see it; WITH_WHOLE, the user's whole status too (the service arbitrating). PAUSE
    between its steps (each ~10 ms with 900 waiting): the loop's work goes first."""
    asker, private = seen.asker, seen.private
    verdicts = seen.decision.finish()  # every waiter's verdict, not the grants alone
    pause()
    waiting = line(seen.entries, seen.mine, verdicts, seen.deciding.programs(seen.entries, seen.paths),
                   asker, private)
    pause()
    out = answer(waiting, seen.named)
    # For `cudawrap cancel`: under private_status, the asker's own waiting runs only.
    out["service_pids"] = ",".join(f"{pid}:{uid}" for pid, uid in seen.pids
                                   if not private or asker in (0, uid))
    if with_whole:
        pause()
        out["status"] = whole(seen.root, waiting, asker, private, seen.named, pause)
    return out
