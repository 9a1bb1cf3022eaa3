"""The wrapped program itself: the name it was reached by, the real program beside it, and
becoming it (exec, same pid).

On the shim's path: only os and the C modules it needs.
"""
from __future__ import annotations

import os

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, NoReturn, Optional, Sequence

from .. import locations as loc
from ..errors import CannotExecute, ProgramNotFound, UsageError
from .posixio import original_environ, say  # noqa: F401 - the launch's and `cudawrap run`'s


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
    lease (lease.grant.Grant: a layer above this one) goes along."""
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
