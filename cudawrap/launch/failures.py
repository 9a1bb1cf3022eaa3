"""What the general launch needs only when something fails: its errors said in one line with
their exit status, the exec's failures and its fallback for a script without #!, and the
devices leased without NVML.

Apart from general.py because a launch that goes well never needs any of it, and each module
on the shim's path costs a launch ~0.1 ms: general.py imports it where a failure is met.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, NoReturn, Sequence

from .. import say
from ..base import audit
from ..errors import CannotExecute, CudawrapError, NoDeviceError, NvmlUnavailable, ProgramNotFound

ENOEXEC = 8  # errno.ENOEXEC on Linux, without importing errno
SH = "/bin/sh"


def report(prog: str, exc: CudawrapError) -> NoReturn:
    """Say EXC in one line (and its hint) as PROG, audit it, and exit with its status."""
    say(prog, exc.message)
    if exc.hint:
        say(prog, f"hint: {exc.hint}")
    if os.environ.get("CUDAWRAP_DEBUG"):
        import traceback

        traceback.print_exc()
    if not isinstance(exc, NoDeviceError):
        audit.log("error", "error", program=prog, pid=os.getpid(), reason=exc.message)
    os._exit(exc.exit_code)


def exec_error(path: str, argv: Sequence[str], env: Dict[bytes, bytes], exc: OSError) -> CudawrapError:
    """Why the exec of PATH failed with EXC, as the launch says it. A file the kernel would not
    run (ENOEXEC) that reads as a shell script is first run with /bin/sh (run_with_sh): this
    returns only if that cannot be done."""
    if isinstance(exc, FileNotFoundError):
        return ProgramNotFound(f"{path}: not found")
    if isinstance(exc, PermissionError):
        return CannotExecute(f"{path}: permission denied")
    if exc.errno == ENOEXEC and is_script_text(path):
        run_with_sh(path, argv, env)
    return CannotExecute(f"{path}: cannot execute: {exc.strerror}")


def is_script_text(path: str) -> bool:
    """Whether PATH, which the kernel would not run (ENOEXEC), reads as a shell script: no
    NUL in its first line, as bash decides before running such a file itself (a binary for
    another machine must fail as it is, not as shell syntax errors)."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:
        return False
    return b"\0" not in head.split(b"\n", 1)[0]


def run_with_sh(path: str, argv: Sequence[str], env: Dict[bytes, bytes]) -> None:
    """Run the script PATH, which has no #! line, with /bin/sh, as execvp does (glibc's
    maybe_script_execute: `/bin/sh PATH ARGS...`): a shell ran it fine before it was wrapped.
    Returns only if /bin/sh cannot be run (the caller then reports the first error)."""
    try:
        os.execve(SH, [SH, path, *argv[1:]], env)
    except OSError:
        pass


def without_nvml(prog: str, lease_dir: str, exc: NvmlUnavailable) -> Any:
    """Where a launch reads the machine from when NVML is unusable (EXC) and the no_driver setting
    allows that: the lease files' names alone (devices/source.py's GenericSource), or None
    where there are none (the run goes without a lease)."""
    from ..devices.source import GenericSource
    from ..lease.known import lease_file_inventory

    # The lease files root made still name the devices (NVML may be broken only for
    # us, a driver upgraded under a loaded module): one lease each, by UUID, rather
    # than every run on device 0.
    inventory = lease_file_inventory(lease_dir)
    audit.log("no-driver", "warning", program=prog, pid=os.getpid(), reason=str(exc))
    if inventory is None:
        say(prog, f"warning: {exc}; running without a device lease")
        return None
    say(prog, f"warning: {exc}; leasing by the lease files alone (processes on the devices unseen)")
    return GenericSource(inventory)
