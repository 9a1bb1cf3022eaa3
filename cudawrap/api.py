"""The Python API: ``cudawrap.acquire()`` at the top of a script, race-free.

Like gpuselect's one-liner, but the devices are leased: the lease lives as long as this
process (and children that inherit its descriptors), and nobody else is given them.
Call it before anything initialises CUDA (``import torch`` alone does not; the first
CUDA call does), because CUDA reads CUDA_VISIBLE_DEVICES only once.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Optional

from . import launch
from .policy import effective as policy
from .policy.config import parse_gpus, parse_wait
from .errors import UsageError
from .lease.files import LEASE_ENV, PROGRAM_ENV
from .launch import CVD, Grant
from .paths import default_layout

_held: Optional[Grant] = None
# The caller's values of the variables acquire() sets, put back by release(): a later
# acquire() must choose from what the caller allowed, not from the devices given back.
_saved: Dict[str, Optional[str]] = {}


def acquire(count: int = 1, wait: Any = None, root: Optional[str] = None, *,
            model: Optional[str] = None, min_memory_mib: Optional[int] = None,
            min_free_memory_mib: Optional[int] = None,
            max_utilization: Optional[int] = None, share: Optional[bool] = None) -> List[str]:
    """Lease COUNT devices (waiting up to WAIT seconds; None = the config's wait).

    MODEL, MIN_MEMORY_MIB, MIN_FREE_MEMORY_MIB and MAX_UTILIZATION narrow the choice as
    the settings of those names do (a user can narrow the admin's, never widen them).
    SHARE=True takes a share of each device (a slot, docs/admin/sharing.md) instead of the
    whole device; an MPS client's variables are set in os.environ too.

    Sets CUDA_VISIBLE_DEVICES and returns the leased UUIDs; a second call returns the
    same lease. Raises cudawrap.errors.NoDeviceError (and other CudawrapError) on failure.
    """
    global _held
    if _held is not None:
        return _held.lease.uuids if _held.lease else []
    try:
        count = parse_gpus(count)
        wait_s = None if wait is None else parse_wait(wait)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    root = root or str(default_layout().root)
    settings = policy.effective(root, None)
    if wait_s is not None:
        settings.set("wait", wait_s, "acquire(wait=…)")
    asks = {"model": model, "min_memory_mib": min_memory_mib,
            "min_free_memory_mib": min_free_memory_mib, "max_utilization": max_utilization}
    for key, raw in asks.items():
        if raw is not None:
            policy.ask(settings, key, raw, f"acquire({key}=…)", f"{key}={raw!r}")
    if share is not None:
        policy.ask_share(settings, bool(share), "acquire(share=…)", f"share={share!r}")
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    grant = launch.obtain(root, prog, settings, os.environ, count=count)
    _saved.clear()
    _saved.update({name: os.environ.get(name) for name in (LEASE_ENV, PROGRAM_ENV, CVD)})
    if grant.lease is not None:
        # Inheritable, so a program this process execs (or a child that keeps its fds)
        # keeps the devices leased while it runs on them.
        grant.lease.keep_across_exec()
        os.environ[LEASE_ENV] = grant.lease.marker()
        os.environ.pop(PROGRAM_ENV, None)  # a wrapped parent's name is not this lease's
    if grant.visible is not None:
        os.environ[CVD] = grant.visible
    for name in grant.drop:
        _saved.setdefault(name.decode(), os.environ.get(name.decode()))
        os.environ.pop(name.decode(), None)
    for name, value in grant.extra.items():  # an MPS client's pipe directory and shares
        _saved.setdefault(name.decode(), os.environ.get(name.decode()))
        os.environ[name.decode()] = value.decode()
    _held = grant
    return grant.lease.uuids if grant.lease else []


def release() -> None:
    """Give the devices back before the process ends (rarely needed: exit does it)."""
    global _held
    if _held is not None and _held.lease is not None:
        _held.lease.release()
    for name, value in _saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _saved.clear()
    _held = None
