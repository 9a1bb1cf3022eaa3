"""The waiter (shims/cudawrap-wait.c): built at install with the machine's C compiler.

A shim told to wait by the service execs it, so that the hand-over from a freed device to
the waiting run is an exec from a small C process rather than from the interpreter (whose
memory the kernel tears down in exec: ~1 ms, measured). Optional: where no compiler is found
the shim waits itself, as before; the install says so, and `cudawrap doctor` too.
"""
from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path
from typing import Callable, List, Optional

from ..paths import Layout

WAITER_SOURCE = "cudawrap-wait.c"
# Compilers tried in this order; CC (as make reads it) comes first.
COMPILERS = ("cc", "gcc", "clang")


def source() -> Path:
    """shims/cudawrap-wait.c, installed (the package cudawrap.shims) or beside a checkout."""
    try:
        from .. import shims
    except ImportError:
        return Path(__file__).resolve().parents[2] / "shims" / WAITER_SOURCE
    return Path(shims.__file__).parent / WAITER_SOURCE


def compiler() -> Optional[List[str]]:
    """The C compiler command to build with (CC, else the first of COMPILERS on PATH), or None."""
    words = shlex.split(os.environ.get("CC", ""))
    found = shutil.which(words[0]) if words else None
    if found:
        return [found] + words[1:]
    for name in COMPILERS:
        found = shutil.which(name)
        if found:
            return [found]
    return None


def build_waiter(layout: Layout, say: Callable[[str], None]) -> bool:
    """Build the waiter into the install (atomically); True if it is there now. Without a
    compiler, or if the build fails, a waiter of an earlier build is removed: the shim passes
    it its arguments by this version's layout, and without one the shim waits itself."""
    from plumbum import local

    target, code = layout.waiter, source()
    cc = compiler()
    why = ""
    if cc is None:
        why = "no C compiler (cc, gcc or clang) found"
    elif not code.is_file():
        why = f"no {code} in the package"
    else:
        tmp = target.with_name(f".new.{os.getpid()}.{target.name}")
        target.parent.mkdir(parents=True, exist_ok=True)
        rc, _out, err = local[cc[0]].run([*cc[1:], "-O2", "-o", str(tmp), str(code)], retcode=None)
        if rc == 0:
            os.chmod(tmp, 0o755)
            os.replace(tmp, target)  # a run waiting in the old one keeps it; the next gets this
            say(f"==> waiter {target} (built with {cc[0]}): waiting runs start ~1 ms sooner once granted")
            return True
        tmp.unlink(missing_ok=True)
        why = f"{cc[0]} failed: " + " ".join(err.split())[:200]
    try:
        target.unlink()
    except FileNotFoundError:
        pass
    say(f"==> no waiter built ({why}): runs wait for the service in the shim's interpreter; "
        "install a C compiler (apt-get install gcc) and run install.sh again for hand-overs ~1 ms faster")
    return False
