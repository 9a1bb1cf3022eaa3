"""The wrapped name through which a shim was reached, from the chain of symlinks it was invoked by.

Needed by the shared shim of older installs (a program's own shim has its name baked in),
`cudawrap config` asked about a program by any of its names, and the service naming a peer
that runs the shared shim. Apart from general.py because a usual launch never needs it: each
module on the shim's path costs a launch ~0.1 ms.
"""
from __future__ import annotations

import os

from .. import locations as loc
from ..errors import UsageError


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
