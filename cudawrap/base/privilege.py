"""Who may change wrapped programs: root, or for a prefix install the install's owner."""
from __future__ import annotations

import os

from ..errors import NotPermitted, StateError
from ..paths import Layout
from .users import either, user_name


def is_admin(layout: Layout) -> bool:
    """Whether this process may change LAYOUT's wrapped programs (see require_admin)."""
    euid = os.geteuid()
    if euid == 0:
        return True
    if layout.is_system:
        return False
    try:
        return os.stat(layout.state_dir).st_uid == euid
    except OSError:
        return False


def require_admin(layout: Layout, action: str = "change wrapped programs") -> None:
    """Raise NotPermitted unless this process may ACTION in LAYOUT.

    A system install (root ``/``) needs euid 0: its shims and registry are trusted by
    every user. A prefix install also admits the owner of its state directory, who
    installed it and could change every file in it anyway.
    """
    if is_admin(layout):
        return
    me = user_name(os.geteuid())
    if layout.is_system:
        raise NotPermitted(f"only root may {action}; you are {me}: run it with sudo")
    try:
        owner = os.stat(layout.state_dir).st_uid
    except FileNotFoundError:
        raise StateError(
            f"{layout.state_dir} does not exist: cudawrap is not installed under {layout.root}; "
            f"run install.sh --prefix {layout.root} first"
        ) from None
    except OSError as exc:
        raise NotPermitted(f"cannot check who owns {layout.state_dir}: {exc.strerror}") from None
    if owner == 0:  # a prefix install root made: its owner adds no one
        raise NotPermitted(f"only root may {action}; you are {me}: run it with sudo")
    raise NotPermitted(
        f"only {either(0, owner)} (owner of {layout.state_dir}) may {action}; you are {me}"
    )
