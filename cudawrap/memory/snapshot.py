"""The memory snapshot: each run's memory on each device as the last memory cycle saw it,
written by the monitor to the runtime directory, read by status and the metrics.
"""
from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Dict, Mapping, Optional

from ..paths import Layout

log = logging.getLogger(__name__)

SNAPSHOT = "memory.json"  # in the runtime directory: what status and the metrics show


def write_snapshot(layout: Layout, snapshot: Mapping[str, Any], private: bool = False) -> None:
    """SNAPSHOT as the runtime directory's memory.json, whole or not at all (a new file renamed
    over the old): a reader never sees half of one. PRIVATE ([service] private_status): root
    alone may read it, as it names each run's pid, user and program."""
    from ..base.safepath import create_new

    directory = str(layout.runtime_dir)
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        tmp = create_new(dfd, f".{SNAPSHOT}.", json.dumps(snapshot).encode(), suffix=".tmp",
                         mode=0o600 if private else 0o644)
        os.replace(tmp, SNAPSHOT, src_dir_fd=dfd, dst_dir_fd=dfd)
    except OSError as exc:
        log.warning("cannot write %s/%s: %s", directory, SNAPSHOT, exc.strerror or exc)
    finally:
        os.close(dfd)


def read_snapshot(layout: Layout, max_age: float = 10.0) -> Optional[Dict[str, Any]]:
    """The last cycle's snapshot if it is recent (root's file; None otherwise)."""
    path = layout.runtime_dir / SNAPSHOT
    try:
        st = os.stat(path)
        if st.st_uid != 0 and st.st_uid != os.geteuid():
            return None
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or time.time() - float(data.get("time", 0)) > max_age:
        return None
    return data

