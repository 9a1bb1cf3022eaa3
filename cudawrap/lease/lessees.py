"""Which of a device's processes hold its lease, as the kernel's lock table says: status
shows the others as foreign, and the monitor looks among them for leftovers of ended runs.
"""
from __future__ import annotations

import os
from typing import Iterable, List

from .holders import fd_holders


def foreign_pids(lease_dir: str, uuid: str, pids: Iterable[int]) -> List[int]:
    """PIDS on the device that do not hold its lease (children of the lessee hold it too)."""
    pids = list(pids)
    try:
        st = os.stat(os.path.join(lease_dir, uuid), follow_symlinks=False)
    except OSError:
        return pids
    lessees = fd_holders([(st.st_dev, st.st_ino)], pids).get((st.st_dev, st.st_ino), [])
    return [p for p in pids if p not in lessees]
