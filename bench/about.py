"""What a result was measured on: the machine, and the commit of the checkout."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

REPO = Path(__file__).resolve().parent.parent
RESULT_FILES = ("bench/RESULTS.md", "bench/REAL-GPU.md")


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
    """The commit measured, whether cudawrap/ or shims/ had uncommitted changes, and whether
    anything did but the result files (`dirty`)."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO)] + list(args), capture_output=True, text=True)
        return done.stdout.rstrip() if done.returncode == 0 else ""

    changed = [line for line in git("status", "--porcelain", "--", "cudawrap", "shims").splitlines() if line]
    # Anything uncommitted but the result files themselves (a bench writing its section
    # must not make the next one's checkout look changed).
    dirty = [line for line in git("status", "--porcelain").splitlines()
             if line and line[3:] not in RESULT_FILES]
    return {"commit": git("rev-parse", "--short", "HEAD"), "cudawrap_uncommitted_files": len(changed),
            "dirty": bool(dirty)}


def commit_text(co: Dict[str, Any]) -> str:
    """The commit as a result's header names it."""
    return f"{co.get('commit') or 'unknown'}" + (" + uncommitted changes" if co.get("dirty") else "")
