"""`cudawrap sync`: bring the runtime area in line with the devices that exist now.

Run by root at install, at boot (the runtime directory is on tmpfs) and after MIG is
reconfigured: new devices get lease files, vanished ones lose theirs once nobody holds
them, dead waiters' queue entries are removed, and the shim's policy cache and device
layout cache (``invcache``) are rebuilt.
"""
from __future__ import annotations

import fcntl
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from ..devices import invcache
from ..policy import effective as policy
from ..lease.claims import Claims, claim, claims_dir
from ..devices.model import Inventory
from ..errors import CannotWrite, ConfigError, NvmlUnavailable
from ..install.installation import prepare_runtime
from ..lease.holders import proc_locks
from ..lease.files import OPEN_FLAGS
from ..paths import Layout
from ..base.text import printable
from ..sched.queue import WaitQueue


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
    sync_slots(layout, inventory, claims.mine, keep)
    return created, removed, claims


def sync_slots(layout: Layout, inventory: Inventory, mine: List[str], keep: List[str] = ()) -> None:
    """Slot files for the shareable devices among MINE ([sharing] slots >= 2); KEEP's stay."""
    from ..lease.sharing import configured

    sharing = configured(str(layout.root))
    parents = {d.uuid: d.parent_uuid for d in inventory.devices}
    wanted = {uuid: sharing.slots_for(uuid, parents.get(uuid)) for uuid in mine}
    share_dir = str(layout.share_dir)
    if keep and os.path.isdir(share_dir):  # a lost GPU: keep every slot file, as its lease files
        for name in os.listdir(share_dir):
            uuid, _, slot = name.rpartition(".")
            if slot.isdigit():
                wanted[uuid] = max(wanted.get(uuid, 0), int(slot))
    sync_slot_files(share_dir, wanted)


def sync_leases(layout: Layout, inventory: Inventory) -> Tuple[List[str], List[str]]:
    """Lease files for INVENTORY's devices; (created, removed). Also the monitor's step."""
    created, removed, _ = claimed_leases(layout, inventory)
    return created, removed


# A name in the queue directory changed less than this ago may be a waiter's entry being
# made (created, then locked a moment later): never swept. Only its owner can backdate it.
SWEEP_MIN_AGE_S = 10.0


def sweep_queue(layout: Layout) -> List[str]:
    """Remove what no live waiter holds from the queue directory; the names removed.

    Anyone may create files there (it is sticky and world-writable like /tmp); a waiter
    holds a lock on its entry for as long as it waits. Files nobody has locked for a while,
    and links, FIFOs and the like, are not any waiter's: left there they would fill the
    runtime filesystem. unlink never follows a link; directories are left alone.
    """
    locked = proc_locks()
    removed: List[str] = []
    queue_dir = str(layout.queue_dir)
    now = time.time()
    for name in sorted(os.listdir(queue_dir)):
        try:
            st = os.lstat(os.path.join(queue_dir, name))
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) in locked or now - st.st_mtime < SWEEP_MIN_AGE_S:
            continue
        try:
            os.unlink(os.path.join(queue_dir, name))
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed


def sync(layout: Layout) -> SyncReport:
    """Bring the runtime area in step; a full or read-only filesystem is one CannotWrite."""
    try:
        return _sync(layout)
    except OSError as exc:
        raise CannotWrite.from_os_error(exc, str(layout.runtime_dir)) from None


def _sync(layout: Layout) -> SyncReport:
    from ..devices import nvml

    report = SyncReport()
    from ..install.way import DAEMONLESS, record_way

    # At boot, before the service starts: the directories are the way's (an install from
    # before the way file gets the way it ran, recorded).
    record_way(layout, DAEMONLESS)
    prepare_runtime(layout)
    report.lines.extend(retired_lines(layout))
    _open_nodes(layout, report)
    try:
        inventory = nvml.inventory()
    except NvmlUnavailable as exc:
        report.nvml_error = str(exc)
        # Without the driver nobody can tell which devices exist: removing "vanished" ones
        # would mean all of them. They go at the first sync with the driver back, or at reboot.
        report.lines.append(f"warning: {exc}; lease files left as they are (which devices exist is unknown)")
    else:
        report.created, report.removed, claims = claimed_leases(layout, inventory)
        invcache.write(str(layout.root), inventory)  # launches without the monitor start from it
        if report.created or report.removed:
            # The monitor's last snapshot names the devices before this sync: launches within
            # its few seconds of freshness would look for lease files that are gone (a stopped
            # service's monitor, then MIG reconfigured). A running monitor writes it again.
            try:
                os.unlink(layout.usage_snapshot)
            except FileNotFoundError:
                pass
        if claims.warning:
            report.lines.append(f"warning: {claims.warning}")
        for uuid in report.created:
            report.lines.append(f"lease file created for {uuid}")
        for uuid, why in sorted(claims.unclaimed.items()):
            done = ("leased here all the same; remove it to claim the device machine-wide"
                    if uuid in claims.mine else "not leased here: another install may manage it")
            report.lines.append(f"warning: {uuid} not claimed: {printable(why)}; {done}")
        for uuid in report.removed:
            why = ("managed by another install" if uuid in claims.others else
                   "unclaimed" if uuid in claims.unclaimed else "vanished device")
            report.lines.append(f"lease file removed for {why} {uuid}")
        for uuid, other in sorted(claims.others.items()):
            report.lines.append(f"warning: {uuid} is managed by the cudawrap install at {printable(other)} "
                                f"(claimed in {claims_dir()}); not leased here")
            report.elsewhere.append(uuid)
        for gpu in inventory.lost:
            report.lines.append(f"warning: NVML reports GPU {gpu} lost or failing; its lease files are kept")
        report.lines.extend(f"warning: {line}" for line in limit_warnings(layout, inventory))
        report.lines.append(f"{len(inventory.devices)} devices, {len(report.created)} new, {len(report.removed)} removed"
                            + (f", {len(report.elsewhere)} managed by another install" if report.elsewhere else ""))
    WaitQueue(str(layout.queue_dir)).scan()  # removes dead waiters' entries (root may)
    swept = sweep_queue(layout)
    if swept:
        report.lines.append(f"removed {len(swept)} file(s) from the queue directory that no waiter holds")
    policy.write_cache(str(layout.root))
    held = not_renewed(layout)
    if held:
        report.lines.append(f"warning: {held}")
    return report


def _open_nodes(layout: Layout, report: SyncReport) -> None:
    """GPU nodes a service closed ([confine] nodes = "leased") put back as they were, where no
    service runs and none should close them: the config says "open", or the install runs
    without the service (daemonless runs need the nodes as the driver made them). While a
    service runs, the nodes are its own."""
    from ..policy.config import load_config
    from ..confine.nodes import put_back, state_file
    from ..ledger.looks import service_running

    if not os.path.exists(state_file(str(layout.state_dir))) or service_running(layout):
        return
    from ..install.way import SERVICE, read_way

    config = load_config(layout.config_file)
    if config["nodes"] != "leased" or read_way(layout) != SERVICE:
        put_back(str(layout.state_dir), report.lines.append)


def not_renewed(layout: Layout) -> Optional[str]:
    """What the running service has not replaced yet of the files it took over (service/grants.py:
    held at its start, by no grant of its own), said once; None when nothing."""
    from ..ledger.looks import service_running

    try:
        names = (layout.runtime_dir / "service.renewing").read_text().split()
    except OSError:
        return None
    if not names or not service_running(layout):
        return None
    return (f"{len(names)} lease or slot file(s) held since before the service took the directories over, "
            f"by no grant of its own: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}; each is "
            f"replaced once let go (`cudawrap revoke DEVICE` ends such a lease now)")


def retired_lines(layout: Layout) -> List[str]:
    """A line for each retired key the config sets ([service] enforce)."""
    from ..policy.config import load_config, retired_notes

    try:
        return [f"warning: {line}" for line in retired_notes(load_config(layout.config_file))]
    except ConfigError:
        return []  # a broken config stops every launch, which says why


def limit_warnings(layout: Layout, inventory: Inventory) -> List[str]:
    """memconf.limit_problems for the install at LAYOUT (sync and doctor report them)."""
    from ..policy.config import load_config
    from ..errors import CudawrapError
    from ..memory.config import limit_problems

    try:
        return limit_problems(load_config(layout.config_file), inventory.devices)
    except CudawrapError:
        return []  # a broken config stops every launch, which says why


def sync_lease_files(lease_dir: str, present: Iterable[str], keep: Iterable[str] = ()) -> Tuple[List[str], List[str]]:
    """Create lease files for PRESENT devices and remove those of vanished, unheld ones.

    Root runs this (install, boot, `cudawrap sync`). KEEP lists devices whose GPU is lost
    or failing: their files stay, so a job still holding one keeps excluding others.
    Returns (created, removed).
    """
    present = set(present)
    keep = set(keep) | present
    return _sync_files(lease_dir, present,
                       lambda name: name not in keep and (name.startswith("GPU-") or name.startswith("MIG-")))


def sync_slot_files(share_dir: str, wanted: Dict[str, int]) -> Tuple[List[str], List[str]]:
    """Make the slot files <uuid>.1 .. <uuid>.N of each device in WANTED (uuid -> N >= 2);
    remove the others once unheld. Root runs this with the lease files. (created, removed)."""
    names = {f"{uuid}.{k}" for uuid, n in wanted.items() if n > 1 for k in range(1, n + 1)}
    return _sync_files(share_dir, names, lambda name: name not in names)


def _sync_files(directory: str, make: Iterable[str], removable: Callable[[str], bool]) -> Tuple[List[str], List[str]]:
    """Create the lock files MAKE in DIRECTORY (0644, root's) and remove those REMOVABLE says
    once nobody holds them; (created, removed).

    Every file is made, opened and removed relative to the directory, itself opened with
    O_NOFOLLOW. A file still locked (a running job's) stays until a later sync; one removed
    is unlinked while we hold its lock, so nobody can win it on the dead inode.
    """
    # The directory's mode is prepare_runtime's: users' (0755), or root's alone where the
    # service arbitrates; it is not touched here.
    os.makedirs(directory, mode=0o755, exist_ok=True)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        created: List[str] = []
        removed: List[str] = []
        for name in sorted(make):
            try:
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                             dir_fd=dfd)
            except FileExistsError:
                continue
            os.fchmod(fd, 0o644)  # the umask must not make them unreadable for users
            os.close(fd)
            created.append(name)
        for name in sorted(os.listdir(dfd)):
            if not removable(name):
                continue
            try:
                fd = os.open(name, OPEN_FLAGS, dir_fd=dfd)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)  # still held: removed on a later sync
                continue
            os.unlink(name, dir_fd=dfd)
            os.close(fd)
            removed.append(name)
        return created, removed
    finally:
        os.close(dfd)
