"""`cudawrap monitor`: keep the shim's usage snapshot fresh, and lease files in step.

Optional: launches are correct without it, only slower (each asks NVML itself). The
service (`cudawrap serve`) runs this loop in a child of its own; installs without the
service run it as the cudawrap-monitor unit or `--daemon`. One loop runs at a time (the
lock MONITOR_LOCK): a second waits, and takes over when the first stops. When a device
appears (MIG reconfigured) it gets a lease file at once, as `cudawrap sync` would.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

from ..devices import invcache, snapshot
from ..policy import effective as policy
from ..errors import CannotWrite, CudawrapError, NvmlUnavailable
from ..paths import Layout
from .sync import sync_leases, sync_slots

log = logging.getLogger(__name__)


def refresh_once(layout: Layout) -> Optional[str]:
    """Write one snapshot; returns an error message instead when NVML is unavailable.

    Raises CannotWrite when the runtime directory cannot take it (full, over quota).
    """
    try:
        return _refresh(layout)
    except OSError as exc:
        raise CannotWrite.from_os_error(exc, str(layout.runtime_dir)) from None


def _refresh(layout: Layout) -> Optional[str]:
    from ..devices import nvml

    root = str(layout.root)
    try:
        inventory = nvml.inventory()
    except NvmlUnavailable as exc:
        try:
            os.unlink(layout.usage_snapshot)  # stale data must not outlive the driver
        except FileNotFoundError:
            pass
        return str(exc)
    lease_dir = str(layout.lease_dir)
    existing = set(os.listdir(lease_dir)) if os.path.isdir(lease_dir) else set()
    if set(inventory.uuids()) - existing:
        sync_leases(layout, inventory)  # a device appeared (MIG reconfigured)
    snapshot.write(root, inventory)
    invcache.write(root, inventory)  # rewritten only when the layout changed
    if not policy.cache_is_current(root):
        # The config or registry changed: rebuild so launches stay off the slow path.
        try:
            policy.write_cache(root)
            # [sharing] slots may have changed: the slot files follow at once.
            sync_slots(layout, inventory, [u for u in inventory.uuids() if u in existing])
        except CudawrapError as exc:
            log.warning("cannot rebuild the launch cache: %s", exc)
    return None


def watch_memory(watch: object) -> None:
    """One memory step (memwatch); a failure is logged, never the end of the monitor."""
    try:
        watch.cycle()  # type: ignore[attr-defined]
    except (CudawrapError, OSError) as exc:
        log.warning("memory accounting skipped this cycle: %s", exc)


def run(layout: Layout, period: float = snapshot.PERIOD_S,
        should_stop: Callable[[], bool] = lambda: False) -> None:
    from .. import locations as loc
    from ..base.daemon import one_at_a_time

    lock_file = loc.under(str(layout.root), loc.MONITOR_LOCK)
    try:
        lock = one_at_a_time(lock_file, _another)
    except OSError as exc:
        raise CannotWrite.from_os_error(exc, lock_file) from None
    try:
        _loop(layout, period, should_stop)
    finally:
        os.close(lock)


def _another(pid: Optional[int]) -> None:
    # Two loops would each sample the ledger and rewrite the snapshot: the second waits.
    log.warning("another monitor runs (pid %s): this one takes over when it stops", pid or "?")


def _loop(layout: Layout, period: float, should_stop: Callable[[], bool]) -> None:
    from ..base.audit import notice_if_unreachable
    from .memwatch import Watch
    from .health import MonitorHealth
    from .metrics import MonitorHook

    notice_if_unreachable()
    hook = MonitorHook(layout)  # the ledger of leases and the metrics file, every cycle
    watch = Watch(layout)  # each run's GPU memory, and shares over their limit
    health = MonitorHealth(layout)  # GPU health: drain on a reset-class error, resume when clear
    last_error: Optional[str] = None
    while not should_stop():
        try:
            error = refresh_once(layout)
        except CudawrapError as exc:
            # A full runtime filesystem or a broken driver: say so once and keep trying,
            # rather than exit and be restarted in a loop by systemd.
            error = exc.message
        health.cycle()
        hook.cycle()
        if error is None:
            watch_memory(watch)
        if error != last_error:
            if error:
                log.warning("%s; shims ask NVML themselves until this is resolved", error)
            elif last_error:
                log.warning("the snapshot is written again")
            last_error = error
        time.sleep(period if error is None else max(period, 5.0))
