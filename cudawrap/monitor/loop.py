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
from typing import Callable, Optional, Set

from ..devices import invcache, snapshot
from ..policy import effective as policy
from ..errors import CannotWrite, CudawrapError, NvmlUnavailable
from ..paths import Layout
from ..ops.sync import sync_leases, sync_slots

log = logging.getLogger(__name__)


def refresh_once(layout: Layout, said: Optional[Set[str]] = None) -> Optional[str]:
    """Write one snapshot; returns an error message instead when NVML is unavailable.
    SAID: problems said already (by the loop: ConfigNote), not said again.

    Raises CannotWrite when the runtime directory cannot take it (full, over quota).
    """
    try:
        return _refresh(layout, said)
    except OSError as exc:
        raise CannotWrite.from_os_error(exc, str(layout.runtime_dir)) from None


def _refresh(layout: Layout, said: Optional[Set[str]] = None) -> Optional[str]:
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
            if said is None or exc.message not in said:
                log.warning("cannot rebuild the launch cache: %s", exc)
            if said is not None:
                said.add(exc.message)
    return None


class ConfigNote:
    """The config as the monitor's parts read it, said of once: a broken one (any table: each
    part keeps its last good settings, or the defaults where none was good, and says nothing
    itself) in one line per edit, and its fix. SAID: the problems said, for the loop's parts."""

    def __init__(self, layout: Layout, said: Set[str]) -> None:
        self.path = layout.config_file
        self.said = said
        self.signature: object = ()
        self.good = False  # a config read well since the start
        self.broken = False

    def cycle(self) -> None:
        from ..errors import ConfigError
        from ..policy.config import load_config
        from ..base.filestamp import file_signature

        signature = file_signature(self.path)
        if signature == self.signature:
            return
        self.signature = signature
        try:
            load_config(self.path)
        except ConfigError as exc:
            if exc.message not in self.said:
                kept = "its last good settings" if self.good else "the default settings"
                log.warning("%s; the monitor keeps %s until it is fixed", exc.message, kept)
            self.said.add(exc.message)
            self.broken = True
            return
        self.said.clear()
        if self.broken:
            log.warning("the config reads well again: the monitor follows it")
        self.good, self.broken = True, False


def watch_memory(watch: object) -> None:
    """One memory step (memwatch); a failure is logged, never the end of the monitor."""
    try:
        watch.cycle()  # type: ignore[attr-defined]
    except (CudawrapError, OSError) as exc:
        log.warning("memory accounting skipped this cycle: %s", exc)


def run(layout: Layout, period: float = snapshot.PERIOD_S,
        should_stop: Callable[[], bool] = lambda: False, strict: bool = True) -> None:
    """The loop until SHOULD_STOP. STRICT: a bad [health] value stops it at start (one line,
    78: `cudawrap monitor`); else the last good settings, or the defaults, hold until the
    config is fixed (the service's child: its snapshot is how the service sees foreign work)."""
    from .. import locations as loc
    from ..base.daemon import one_at_a_time

    lock_file = loc.under(str(layout.root), loc.MONITOR_LOCK)
    try:
        lock = one_at_a_time(lock_file, _another)
    except OSError as exc:
        raise CannotWrite.from_os_error(exc, lock_file) from None
    try:
        _loop(layout, period, should_stop, strict)
    finally:
        os.close(lock)


def _another(pid: Optional[int]) -> None:
    # Two loops would each sample the ledger and rewrite the snapshot: the second waits.
    log.warning("another monitor runs (pid %s): this one takes over when it stops", pid or "?")


def _loop(layout: Layout, period: float, should_stop: Callable[[], bool], strict: bool = True) -> None:
    from ..base.audit import notice_if_unreachable
    from ..memory.watch import Watch
    from ..health.keeper import MonitorHealth
    from .metrics import MonitorHook

    notice_if_unreachable()
    hook = MonitorHook(layout)  # the ledger of leases and the metrics file, every cycle
    watch = Watch(layout)  # each run's GPU memory, and shares over their limit
    health = MonitorHealth(layout, strict)  # GPU health: drain on a reset-class error, resume when clear
    last_error: Optional[str] = None
    said: Set[str] = set()
    config = ConfigNote(layout, said)
    while not should_stop():
        config.cycle()
        try:
            error = refresh_once(layout, said)
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
