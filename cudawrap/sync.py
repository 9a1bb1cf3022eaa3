"""`cudawrap sync`: bring the runtime area in line with the devices that exist now.

Run by root at install, at boot (the runtime directory is on tmpfs) and after MIG is
reconfigured: new devices get lease files, vanished ones lose theirs once nobody holds
them, dead waiters' queue entries are removed, and the shim's policy cache and device
layout cache (``invcache``) are rebuilt.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from . import invcache, policy
from .devices import Inventory
from .errors import NvmlUnavailable
from .installation import prepare_runtime
from .leases import sync_lease_files
from .paths import Layout
from .waitqueue import WaitQueue


@dataclass
class SyncReport:
    lines: List[str] = field(default_factory=list)
    created: List[str] = field(default_factory=list)
    removed: List[str] = field(default_factory=list)
    nvml_error: Optional[str] = None


def sync_leases(layout: Layout, inventory: Inventory) -> Tuple[List[str], List[str]]:
    """Lease files for INVENTORY's devices; (created, removed). Also the monitor's step."""
    # With a GPU lost or failing we cannot tell which MIG instances still exist, so
    # nothing is removed: a running job's lease file must keep excluding others.
    keep = os.listdir(layout.lease_dir) if inventory.lost and layout.lease_dir.is_dir() else []
    return sync_lease_files(str(layout.lease_dir), inventory.uuids(), keep)


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
        report.created, report.removed = sync_leases(layout, inventory)
        invcache.write(str(layout.root), inventory)  # launches without the monitor start from it
        for uuid in report.created:
            report.lines.append(f"lease file created for {uuid}")
        for uuid in report.removed:
            report.lines.append(f"lease file removed for vanished device {uuid}")
        for gpu in inventory.lost:
            report.lines.append(f"warning: NVML reports GPU {gpu} lost or failing; its lease files are kept")
        report.lines.append(f"{len(inventory.devices)} devices, {len(report.created)} new, {len(report.removed)} removed")
    WaitQueue(str(layout.queue_dir), str(layout.queue_lock)).live()  # drops dead waiters' entries
    policy.write_cache(str(layout.root))
    return report
