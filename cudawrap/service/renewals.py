"""Replacing the lease and slot files whose descriptors are out there, a part of Grants.

A void grant leaves its client the descriptors it was sent (a flock belongs to the open file
description, and closing our copies takes nothing back), and at the service's start anyone
may hold descriptors opened before it made the directories root's: each such file is
replaced by a fresh one (lease/renew.py) the first time it is found free, and RENEWING
lists those still waiting; `cudawrap revoke` replaces a device's files held or not.

Apart from grants.py because it is what makes an old descriptor worth nothing, not who
holds what: its state (renewing, voided) is the Grants', of which this is a part.
"""
from __future__ import annotations

import os
from typing import Iterable, List, Optional, Tuple

from ..lease.renew import replace
from .granted import Held


class Renewals:
    """The files to replace, and their replacing (a part of grants.Grants)."""

    def path_of(self, uuid: str, slot: int) -> str:
        return self.leases.path(uuid) if slot == 0 else self.leases.slot_path(uuid, slot)

    def renew(self, files: Iterable[Tuple[str, int]]) -> List[str]:
        """Replace each of FILES ((uuid, slot), slot 0: its lease file) that nobody holds
        now; the others wait in RENEWING for a later try (renew_free). The uuids whose lease
        file was replaced (tried again at the next decision)."""
        before = set(self.renewing)
        replaced: List[str] = []
        for uuid, slot in files:
            try:
                done = replace(self.path_of(uuid, slot))
            except OSError:
                done = False
            if done is False:
                self.renewing.add((uuid, slot))
                continue
            self.renewing.discard((uuid, slot))
            if slot == 0:
                self.voided.pop(uuid, None)
                self.leases.forget(uuid)  # our descriptor names the old file
                replaced.append(uuid)
        if self.renewing != before:
            self._note_renewing()
        return replaced

    def renew_free(self) -> List[str]:
        """renew() those of RENEWING found free, tried through the descriptors we keep open
        (an open of ours would wake our own watch, and every waiting run's)."""
        sent = {u for p in self.pending.values() for u in p.devices}  # its client's lock may be coming
        free = [(u, k) for u, k in sorted(self.renewing)
                if u not in sent and (self.leases.free_now(u) if k == 0 else self.leases.slot_free(u, k))]
        return self.renew(free) if free else []

    def _note_renewing(self) -> None:
        """For sync and doctor, the files of RENEWING held by no grant of ours (one name a
        line; no file when none): held through a descriptor opened before the service took
        the directories over, or one it granted before a restart."""
        ours = self.books()
        names = sorted(os.path.basename(self.path_of(u, k)) for u, k in self.renewing if u not in ours)
        try:
            if not names:
                self.renewing_file.unlink(missing_ok=True)
            else:
                tmp = self.renewing_file.with_name(self.renewing_file.name + ".tmp")
                tmp.write_text("".join(f"{n}\n" for n in names))
                tmp.replace(self.renewing_file)
        except OSError:
            pass  # only a report: the set itself is ours

    def every_file(self) -> List[Tuple[str, int]]:
        """(uuid, slot) of every lease file (slot 0) and slot file there is."""
        uuids = sorted(n for n in self.leases.names() if n.startswith(("GPU-", "MIG-")))
        return [(u, k) for u in uuids for k in [0] + _slot_numbers(self.leases.share_dir, u)]

    def revoke(self, uuid: str, by: str) -> Tuple[List[Held], List[str]]:
        """`cudawrap revoke`: UUID's lease and slot files replaced, held or not, so that no
        descriptor on them guards anything; the grants holding it end (their record says
        BY revoked it) once their clients have gone. (The grants, the keys of those sent and
        not taken, which the caller voids.)"""
        for slot in [0] + _slot_numbers(self.leases.share_dir, uuid):
            try:
                replace(self.path_of(uuid, slot), held_too=True)
            except OSError:
                pass
            self.renewing.discard((uuid, slot))
        self._note_renewing()
        self.voided.pop(uuid, None)
        self.leases.forget(uuid)
        holding = [h for h in self.held.values() if uuid in h.devices and uuid not in h.ended]
        for held in holding:
            held.how = f"revoked by {by}"
            if held.slots.get(uuid):
                held.slots[uuid] = 0  # its slot is let go: the share's file is a new one
            held.ended.append(uuid)
        return holding, [k for k, p in self.pending.items() if uuid in p.devices]


def _slot_numbers(share_dir: Optional[str], uuid: str) -> List[int]:
    """The numbers of UUID's slot files in SHARE_DIR (sync makes them)."""
    try:
        names = os.listdir(share_dir) if share_dir else []
    except OSError:
        return []
    tails = [n[len(uuid) + 1:] for n in names if n.startswith(uuid + ".")]
    return sorted(int(t) for t in tails if t.isascii() and t.isdigit() and len(t) <= 6)
