"""A run's leftovers ended through its run cgroup ([health] leftover_action = "kill"): the
whole cgroup, its children and daemons with it, never guessed by pid. Apart from cgroups.py
(the service's own bookkeeping of run cgroups): the monitor's health step calls this, with no
service state, from whichever process looks at the leftovers."""
from __future__ import annotations

import logging
import os

from ..base import cgroup
from ..base.proc import start_time
from .cgroups import RUN_PREFIX

log = logging.getLogger(__name__)


def kill_run_of(pid: int, ticks: int) -> bool:
    """End every process of the run cgroup PID is in (a run's leftovers: its lease has ended),
    through the cgroup (cgroup.kill, or the freezer and a kill of each): its children and
    daemons too, none of them guessed by pid. False where PID (started at TICKS) is in no run
    cgroup of cudawrap's, or is another process now."""
    try:
        found = cgroup.mounts()
        where = cgroup.current(pid)
    except OSError:
        return False
    if start_time(pid) != ticks:
        return False  # the pid was reused
    mechanisms = []
    if "devices" in found and "freezer" in found:
        mechanisms.append(("devices", cgroup.V1(found["devices"], found["freezer"])))
    if "unified" in found:
        mechanisms.append(("unified", cgroup.V2(found["unified"])))
    for name, mech in mechanisms:
        path = where.get(name, "")
        if os.path.basename(path).startswith(RUN_PREFIX):
            try:
                mech.kill(path)
            except OSError as exc:
                log.warning("the leftovers in %s could not be ended through it: %s", path, exc)
                return False
            return True
    return False
