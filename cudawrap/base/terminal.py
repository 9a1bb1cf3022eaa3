"""A line on a run's own terminal, where it has one: the memory watch warns a shared run
nearing its share there, and the idle watch tells the holder of an idle lease.
"""
from __future__ import annotations

import os


def tell(pid: int, uid: int, text: str) -> None:
    """TEXT on the run's terminal where it has one of its own: its stderr, if that is a tty the
    run's user owns (never a file or pipe: that is the run's output, not ours to write)."""
    import stat

    try:
        fd = os.open(f"/proc/{pid}/fd/2", os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISCHR(st.st_mode) and os.isatty(fd) and st.st_uid == uid:
            os.write(fd, (text + "\n").encode(errors="replace"))
    except OSError:
        pass
    finally:
        os.close(fd)
