"""cudawrap: every run of a CUDA program gets its own free GPU or MIG instance.

Kept tiny on purpose: the shim imports ``cudawrap.launch`` on every launch, and
importing the package runs this file first.
"""
from __future__ import annotations

TYPE_CHECKING = False  # the shim imports this package; `import typing` costs ~10 ms
if TYPE_CHECKING:
    from typing import Any, List

__version__ = "0.1.0"

__all__ = ["__version__", "acquire"]


def acquire(count: int = 1, wait: Any = None, **kwargs: Any) -> List[str]:
    """Lease COUNT free devices for the life of this process and set CUDA_VISIBLE_DEVICES.

    Call it before anything initialises CUDA. Returns the leased UUIDs. See
    :func:`cudawrap.api.acquire` for the full signature.
    """
    from .api import acquire as _acquire

    return _acquire(count=count, wait=wait, **kwargs)
