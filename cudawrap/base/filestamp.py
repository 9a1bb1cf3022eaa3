"""Whether a file changed since it was last read: the monitor's hooks look every cycle and
re-read the config (or the ledger) only when its signature changed.
"""
from __future__ import annotations

import os
from typing import Any


def file_signature(path: Any) -> Any:
    """What tells a changed file from the one read before (None: none there)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)
