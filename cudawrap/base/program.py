"""The wrapped program itself: the name it was reached by, the real program beside it, and
becoming it (exec, same pid) with what it was granted (Grant: the devices, the lease marker
a child finds its parent's lease by, a share's variables).

On the shim's general path: only os and the C modules it needs (one module, not two: each
module the launch loads costs it ~0.1 ms).
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, NoReturn, Optional, Sequence, Tuple

    Lease = Any  # lease.files.Lease, a layer above this one

from .. import locations as loc
from ..errors import CannotExecute, ProgramNotFound, UsageError
from ..locations import LEASE_ENV, PROGRAM_ENV


def find_link(invoked: str, shim: str) -> str:
    """The wrapped name through which the shim was reached.

    That is the last link in INVOKED's symlink chain with a CUDAWRAP_<name> beside it, so
    the real program is found even when a user ran it through another symlink elsewhere
    (/usr/local/bin/recon -> /opt/app/bin/recon -> shim) or the shim is itself reached
    through links. Without any such sibling, the last link names the missing program.
    """
    chain = []
    path = invoked
    for _ in range(40):  # the kernel's own limit on symlink chains
        if not os.path.islink(path):
            break
        chain.append(path)
        target = os.readlink(path)
        path = target if target.startswith("/") else os.path.join(os.path.dirname(path), target)
    if not chain:
        try:
            if os.path.samefile(invoked, shim):
                raise UsageError(
                    "this is cudawrap's shim; run a wrapped program by its own name",
                    hint="wrap a program with `create-cudawrap PATH`, or use `cudawrap run -- CMD`")
        except OSError:
            pass
        return invoked
    for link in reversed(chain):
        directory, name = os.path.split(link)
        if os.path.lexists(os.path.join(directory, loc.REAL_PREFIX + name)):
            return link
    return chain[-1]


def is_shim(path: str, root: str) -> bool:
    """Whether PATH resolves to a shim of the install at ROOT (the prototype or a program's own)."""
    target = os.path.realpath(path)
    return (target == os.path.realpath(loc.under(root, loc.SHIM))
            or os.path.dirname(target) == os.path.realpath(loc.under(root, loc.SHIM_DIR)))


def real_program(link: str, shim: str, root: str = "") -> str:
    """CUDAWRAP_<name> beside LINK; refuses anything that would lead back to a shim: SHIM
    (the file running now) or, given the install ROOT, any shim of that install."""
    directory, name = os.path.split(link)
    real = os.path.join(directory, loc.REAL_PREFIX + name)
    try:
        st = os.stat(real)
    except OSError:
        raise ProgramNotFound(f"the real program {real} is missing",
                              hint="ask an admin to run `cudawrap doctor`") from None
    looped = False  # a hard link of the shim would not show in its path
    try:
        shim_st = os.stat(shim)
        looped = (st.st_dev, st.st_ino) == (shim_st.st_dev, shim_st.st_ino)
    except OSError:
        pass
    if looped or (root and is_shim(real, root)):
        raise ProgramNotFound(f"{real} leads back to the shim itself",
                              hint="ask an admin to run `cudawrap doctor --repair`")
    return real


def exec_program(path: str, argv: Sequence[str], env: Dict[bytes, bytes], grant: Any) -> NoReturn:
    """Become the real program: same pid, so signals and exit codes pass through; GRANT's
    lease goes along."""
    import _signal  # `signal` would pull in enum; the C module is enough here

    # Python ignores SIGPIPE and SIGXFSZ, and ignored signals survive exec: without this
    # `wrapped | head` would see EPIPE errors instead of dying quietly as it should.
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(_signal, name):
            _signal.signal(getattr(_signal, name), _signal.SIG_DFL)
    if grant.lease is not None:
        grant.lease.keep_across_exec()
    try:
        os.execve(path, list(argv), env)
    except FileNotFoundError:
        raise ProgramNotFound(f"{path}: not found") from None
    except PermissionError:
        raise CannotExecute(f"{path}: permission denied") from None
    except OSError as exc:
        raise CannotExecute(f"{path}: cannot execute: {exc.strerror}") from None


def unwrapped_meanwhile(link: str, shim: str, root: str) -> Optional[str]:
    """LINK itself if an unwrap put the real program back there while we were starting or waiting."""
    try:
        st = os.stat(link)
    except OSError:
        return None
    try:
        shim_st = os.stat(shim)
        if (st.st_dev, st.st_ino) == (shim_st.st_dev, shim_st.st_ino):
            return None
    except OSError:
        pass  # the unwrap removed the program's own shim
    return None if is_shim(link, root) else link


CVD = "CUDA_VISIBLE_DEVICES"
CVD_B = CVD.encode()


class Grant:
    """What a run got: a lease (possibly inherited) or nothing, and what to tell it."""

    def __init__(self, lease: Optional[Lease], visible: Optional[str],
                 extra: Optional[Dict[bytes, bytes]] = None) -> None:
        self.lease = lease
        self.visible = visible  # value for CUDA_VISIBLE_DEVICES; None = leave it as it is
        self.extra = extra or {}  # more variables: an MPS client's
        self.defaults: Dict[bytes, bytes] = {}  # variables set only where the caller has none
        self.drop: Tuple[bytes, ...] = ()  # variables to remove
        self.program: Optional[str] = None  # the wrapped name, for a run a shim started

    def apply(self, env: Dict[bytes, bytes]) -> Dict[bytes, bytes]:
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


def whole_devices(root: str, lease: Lease, environ: Any, extra: Optional[Dict[bytes, bytes]] = None,
                   defaults: Optional[Dict[bytes, bytes]] = None) -> Grant:
    """The Grant of LEASE with a share's variables (EXTRA, and DEFAULTS where the caller has
    none; sharing.run_env), and a shared run's MPS variables dropped for whole devices."""
    grant = Grant(lease, ",".join(lease.uuids), extra)
    if defaults is not None:
        grant.defaults = defaults
    mps_dir = loc.under(root, loc.MPS_DIR) + "/"
    if not lease.shared and environ.get("CUDA_MPS_PIPE_DIRECTORY", "").startswith(mps_dir):
        # A whole device bypasses MPS: a client of a device's daemon (a shared run's
        # environment passed on) must not be sent to a daemon of a device it does not use.
        grant.drop = (b"CUDA_MPS_PIPE_DIRECTORY", b"CUDA_MPS_LOG_DIRECTORY",
                      b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    return grant
