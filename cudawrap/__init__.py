"""cudawrap: every run of a CUDA program gets its own free GPU or MIG instance.

Kept tiny on purpose: the shim imports ``cudawrap.launch`` on every launch, and
importing the package runs this file first.
"""
from __future__ import annotations

TYPE_CHECKING = False  # the shim imports this package; `import typing` costs ~10 ms
if TYPE_CHECKING:
    from typing import Any, List

import sys

__version__ = "0.1.0"

__all__ = ["__version__", "acquire"]


def acquire(count: int = 1, wait: Any = None, **kwargs: Any) -> List[str]:
    """Lease COUNT free devices for the life of this process and set CUDA_VISIBLE_DEVICES.

    Call it before anything initialises CUDA. Returns the leased UUIDs. See
    :func:`cudawrap.api.acquire` for the full signature.
    """
    from .api import acquire as _acquire

    return _acquire(count=count, wait=wait, **kwargs)


class _Package(type(sys)):  # type: ignore[misc]
    """This package, keeping `acquire` the function.

    Importing the submodule cudawrap.acquire (the launch path does) makes the import system
    set the package's attribute `acquire` to that module, which would turn a second
    `cudawrap.acquire()` (a re-run notebook cell) into a TypeError. The submodule stays
    reachable through sys.modules and `from cudawrap.acquire import ...`.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "acquire" and isinstance(value, type(sys)):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
