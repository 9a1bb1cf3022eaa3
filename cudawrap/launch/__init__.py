"""A run's devices, the general way: the shim comes here when its fast path (cudawrap/__init__.py)
cannot serve the run; `cudawrap run` and the API lease through obtain().

The door defines what every way to a grant gives the run (Grant) and hands on the rest:
general.py finds the real program, leases its devices and execs it; inherited.py narrows a
wrapped parent's lease to the child's CUDA_VISIBLE_DEVICES; client.py asks the service;
failures.py and links.py hold what a usual launch never needs (the errors said, the exec's
fallbacks, the shared shim's search of the links), loaded only when asked for.

Grant is here rather than in a module of its own: each module on the shim's path costs a
launch ~0.1 ms, and every launch loads the door anyway.
"""

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Optional, Tuple

    from ..lease.files import Lease

from .. import locations as loc
from ..lease.files import LEASE_ENV, PROGRAM_ENV
from .. import MPS_VARIABLES  # the shim's fast path (the package) has it loaded already

CVD = "CUDA_VISIBLE_DEVICES"
CVD_B = CVD.encode()


class Grant:
    """What a run got: a lease (possibly inherited) or nothing, and what to tell it. general.py
    makes one of each way to a grant: its own decision, a wrapped parent's lease (inherited.py),
    the service's answer (client.py)."""

    def __init__(self, lease: "Optional[Lease]", visible: "Optional[str]",
                 extra: "Optional[Dict[bytes, bytes]]" = None) -> None:
        self.lease = lease
        self.visible = visible  # value for CUDA_VISIBLE_DEVICES; None = leave it as it is
        self.extra = extra or {}  # more variables: an MPS client's
        self.defaults: "Dict[bytes, bytes]" = {}  # variables set only where the caller has none
        self.drop: "Tuple[bytes, ...]" = ()  # variables to remove
        self.program: "Optional[str]" = None  # the wrapped name, for a run a shim started

    def apply(self, env: "Dict[bytes, bytes]") -> "Dict[bytes, bytes]":
        for name in self.drop:
            env.pop(name, None)
        env.update(self.extra)
        for name, value in self.defaults.items():
            env.setdefault(name, value)
        if self.visible is not None:
            env[CVD_B] = self.visible.encode()
        if self.lease is not None:
            env[LEASE_ENV.encode()] = self.lease.marker().encode()
            if self.program:
                env[PROGRAM_ENV.encode()] = self.program.encode()
            else:  # `cudawrap run` inside a wrapped program: its command is not that program
                env.pop(PROGRAM_ENV.encode(), None)
        return env


def whole_devices(root: str, lease: "Lease", environ: "Any", extra: "Optional[Dict[bytes, bytes]]" = None,
                   defaults: "Optional[Dict[bytes, bytes]]" = None) -> "Grant":
    """The Grant of LEASE with a share's variables (EXTRA, and DEFAULTS where the caller has
    none; sharing.run_env), and a shared run's MPS variables dropped for whole devices."""
    grant = Grant(lease, ",".join(lease.uuids), extra)
    if defaults is not None:
        grant.defaults = defaults
    mps_dir = loc.under(root, loc.MPS_DIR) + "/"
    if not lease.shared and environ.get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(mps_dir):
        # A whole device bypasses MPS: a client of a device's daemon (a shared run's
        # environment passed on) must not be sent to a daemon of a device it does not use.
        grant.drop = MPS_VARIABLES
    return grant


# The body's names, handed on. Imported after the names above: general.py imports them from
# here while this module is still being run (no other module of the launch imports the door).
from .general import exec_failed, exec_program, fail, main, obtain  # noqa: E402,F401


def __getattr__(name: str) -> "Callable[..., Any]":
    """The names handed on from the modules a usual launch never loads, imported only when a
    caller asks for one (PEP 562): the wrapping's check for a script without #!, the links
    searched by `cudawrap config` and the service's peers."""
    if name == "is_script_text":
        from .failures import is_script_text

        return is_script_text
    if name == "find_link":
        from .links import find_link

        return find_link
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
