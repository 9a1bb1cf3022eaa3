"""`cudawrap sync`: bring the runtime area in line with the devices that exist now.

Run by root at install, at boot (the runtime directory is on tmpfs) and after MIG is
reconfigured: new devices get lease files, vanished ones lose theirs once nobody holds
them, dead waiters' queue entries are removed, and the shim's policy cache is rebuilt.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from . import policy
from .claims import Claims, claim, claims_dir
from .devices import Inventory
from .errors import NvmlUnavailable
from .installation import prepare_runtime
from .leases import sync_lease_files
from .paths import Layout
from .text import printable
from .waitqueue import WaitQueue


@dataclass
class SyncReport:
    lines: List[str] = field(default_factory=list)
    created: List[str] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)
    nvml_error: Optional[str] = None
    elsewhere: List[str] = field(default_factory=list)  # devices another install manages


def claimed_leases(layout: Layout, inventory: Inventory) -> Tuple[List[str], List[str], Claims]:
    """Lease files for the devices of INVENTORY this install holds the machine-wide claim of;
    (created, removed, the claims). Devices another install manages get none (and lose
    ours once no job of ours holds them)."""
    claims = claim(str(layout.root), inventory.uuids())
    # With a GPU lost or failing we cannot tell which MIG instances still exist, so
    # nothing is removed: a running job's lease file must keep excluding others.
    keep = os.listdir(layout.lease_dir) if inventory.lost and layout.lease_dir.is_dir() else []
    created, removed = sync_lease_files(str(layout.lease_dir), claims.mine, keep)
    return created, removed, claims


def sync_leases(layout: Layout, inventory: Inventory) -> Tuple[List[str], List[str]]:
    """Lease files for INVENTORY's devices; (created, removed). Also the monitor's step."""
    created, removed, _ = claimed_leases(layout, inventory)
    return created, removed


def sync(layout: Layout) -> SyncReport:
    from . import nvml

    report = SyncReport()
    prepare_runtime(layout)
    try:
        inventory = nvml.inventory()
    except NvmlUnavailable as exc:
        report.nvml_error = str(exc)
        report.lines.append(f"warning: {exc}; lease files left as they are")
    else:
        report.created, report.removed, claims = claimed_leases(layout, inventory)
        if claims.warning:
            report.lines.append(f"warning: {claims.warning}")
        for uuid in report.created:
            report.lines.append(f"lease file created for {uuid}")
        for uuid in report.removed:
            why = "managed by another install" if uuid in claims.others else "vanished device"
            report.lines.append(f"lease file removed for {why} {uuid}")
        for uuid, other in sorted(claims.others.items()):
            report.lines.append(f"warning: {uuid} is managed by the cudawrap install at {printable(other)} "
                                f"(claimed in {claims_dir()}); not leased here")
            report.elsewhere.append(uuid)
        for gpu in inventory.lost:
            report.lines.append(f"warning: NVML reports GPU {gpu} lost or failing; its lease files are kept")
        report.lines.append(f"{len(inventory.devices)} devices, {len(report.created)} new, {len(report.removed)} removed"
                            + (f", {len(report.elsewhere)} managed by another install" if report.elsewhere else ""))
    WaitQueue(str(layout.queue_dir), str(layout.queue_lock)).live()  # drops dead waiters' entries
    policy.write_cache(str(layout.root))
    return report
