"""systemd on this machine: whether it runs for an install, and systemctl, answered in one line."""
from __future__ import annotations

import os
from typing import Optional

from ..paths import Layout


def systemd_running(layout: Layout) -> bool:
    """Whether LAYOUT's units run here: a system install on a machine booted with systemd."""
    return layout.is_system and os.path.isdir("/run/systemd/system")


def systemctl(*args: str) -> Optional[str]:
    """Run systemctl; None when it worked, else its complaint in one line."""
    import shutil
    import subprocess

    exe = shutil.which("systemctl")
    if exe is None:
        return "systemctl not found"
    done = subprocess.run([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        return " ".join(done.stdout.split())[:300] or f"exit {done.returncode}"
    return None
