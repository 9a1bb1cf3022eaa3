"""What a result was measured on: the machine, and the commit of the checkout."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

REPO = Path(__file__).resolve().parent.parent


def machine_info() -> Dict[str, Any]:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": memory, "python": platform.python_version(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
            "implementation": platform.python_implementation(), "kernel": platform.release(),
            "python_executable": sys.executable}


def checkout() -> Dict[str, Any]:
    """The commit measured, and whether cudawrap/ had uncommitted changes."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO)] + list(args), capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    changed = [line for line in git("status", "--porcelain", "--", "cudawrap", "shims").splitlines() if line]
    return {"commit": git("rev-parse", "--short", "HEAD"), "cudawrap_uncommitted_files": len(changed)}
