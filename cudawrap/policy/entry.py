"""One wrapped program's entry in the registry (registry.py): its fields, each checked, as
an immutable value, and the phases an entry goes through.

Apart from the registry's document (reading, writing, the lock) because an entry is what
wrap, unwrap and doctor work with, and its checks are the longest part of reading one.
Not a ``@dataclass``: the shim reads the registry on launches (``dataclasses`` alone costs
~11 ms, ``typing`` ~4 ms).
"""
from __future__ import annotations

import os

from ..locations import REAL_PREFIX

TYPE_CHECKING = False  # `import typing` costs ~4 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, Mapping, Optional, Tuple

# Phases of an entry. An entry is written with "wrapping" BEFORE the first change on disk
# and with "unwrapping" before an unwrap starts, so an interrupted create or unwrap always
# leaves a record that `cudawrap doctor --repair` can finish from.
WRAPPING = "wrapping"
WRAPPED = "wrapped"
UNWRAPPING = "unwrapping"
PHASES = (WRAPPING, WRAPPED, UNWRAPPING)


_FIELDS = (
    "link", "real", "sha256", "mode", "uid", "gid", "symlink", "package", "diversion",
    "policy", "wrapped_by", "wrapped_at", "cudawrap_version", "phase", "stat",
)


def _possible_path(path: str) -> bool:
    """Whether PATH could name a file: absolute, normalised, encodable, without NUL, and
    within the kernel's length limits."""
    if not os.path.isabs(path) or os.path.normpath(path) != path or "\0" in path:
        return False
    try:
        encoded = os.fsencode(path)
    except UnicodeError:
        return False
    return len(encoded) < 4096 and all(len(part) <= 255 for part in encoded.split(b"/"))


def _check_fields(raw: Dict[str, Any]) -> None:
    """Raise ValueError naming the first field of RAW that has the wrong type."""

    def need(key: str, ok: bool, what: str) -> None:
        if not ok:
            raise ValueError(f"\"{key}\" must be {what}, not {raw.get(key)!r}")

    def text(key: str) -> bool:
        return isinstance(raw.get(key), str) and bool(raw[key])

    def optional_text(key: str) -> bool:
        return raw.get(key) is None or text(key)

    def whole(key: str) -> bool:
        return isinstance(raw.get(key), int) and not isinstance(raw[key], bool) and raw[key] >= 0

    need("link", text("link") and _possible_path(raw["link"]), "an absolute, normalised path that can exist")
    link = raw["link"]
    head, tail = os.path.split(link)
    # Anything else would let a hand-edit make unwrap move an unrelated file.
    need("real", raw.get("real") == os.path.join(head, REAL_PREFIX + tail), f"{REAL_PREFIX}<name> beside the link")
    sha = raw.get("sha256")
    need("sha256", isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha),
         "a sha256 hex digest")
    mode = raw.get("mode")
    need("mode", isinstance(mode, str) and 1 <= len(mode) <= 5 and all(c in "01234567" for c in mode),
         "an octal permission string such as \"0755\"")
    need("uid", whole("uid"), "a user id")
    need("gid", whole("gid"), "a group id")
    for key in ("symlink", "package", "diversion"):
        need(key, optional_text(key), "a string or null")
    need("policy", isinstance(raw.get("policy"), dict), "a JSON object")
    for key in ("wrapped_by", "wrapped_at", "cudawrap_version"):
        need(key, isinstance(raw.get(key), str), "a string")
    need("phase", raw.get("phase") in PHASES, "one of " + ", ".join(PHASES))
    st = raw.get("stat")
    need("stat", st is None or (isinstance(st, list) and len(st) == 4
                                and all(isinstance(v, int) and not isinstance(v, bool) for v in st)),
         "null or [inode, size, mtime_ns, ctime_ns]")


class Entry:
    """One wrapped program, immutable (a frozen value object).

    Not a ``@dataclass``: the shim imports this module on every launch. ``mode`` is the
    permission bits of the real program (of its target, when the original was a symlink),
    ``symlink`` the link text when the original name was a symlink, ``package`` the dpkg
    package that owned it and ``diversion`` the path dpkg-divert diverts (as dpkg names
    it), ``stat`` the real file's (inode, size, mtime_ns, ctime_ns) after wrapping, so
    ``cudawrap list`` need not re-hash big binaries that have not changed.
    """

    __slots__ = _FIELDS

    link: str
    real: str
    sha256: str
    mode: int
    uid: int
    gid: int
    symlink: Optional[str]
    package: Optional[str]
    diversion: Optional[str]
    policy: Mapping[str, Any]
    wrapped_by: str
    wrapped_at: str
    cudawrap_version: str
    phase: str
    stat: Optional[Tuple[int, int, int, int]]

    def __init__(
        self,
        *,
        link: str,
        real: str,
        sha256: str,
        mode: int,
        uid: int,
        gid: int,
        policy: Mapping[str, Any],
        wrapped_by: str,
        wrapped_at: str,
        cudawrap_version: str,
        phase: str = WRAPPED,
        symlink: Optional[str] = None,
        package: Optional[str] = None,
        diversion: Optional[str] = None,
        stat: Optional[Tuple[int, int, int, int]] = None,
    ) -> None:
        import types

        values = dict(
            link=link, real=real, sha256=sha256, mode=mode, uid=uid, gid=gid, symlink=symlink,
            package=package, diversion=diversion, policy=types.MappingProxyType(dict(policy)),
            wrapped_by=wrapped_by, wrapped_at=wrapped_at, cudawrap_version=cudawrap_version,
            phase=phase, stat=tuple(stat) if stat is not None else None,
        )
        for key, value in values.items():
            object.__setattr__(self, key, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Entry is immutable; use replace(..., {name}=...)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Entry is immutable")

    def _values(self) -> Tuple[Any, ...]:
        return tuple(dict(v) if k == "policy" else v for k, v in ((k, getattr(self, k)) for k in _FIELDS))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Entry) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash((self.link, self.real, self.sha256, self.phase))

    def __repr__(self) -> str:
        return f"Entry(link={self.link!r}, real={self.real!r}, phase={self.phase!r})"

    def replace(self, **changes: Any) -> Entry:
        values = {k: getattr(self, k) for k in _FIELDS}
        values.update(changes)
        return Entry(**values)

    @property
    def diverted(self) -> bool:
        return self.diversion is not None

    def to_raw(self) -> Dict[str, Any]:
        raw = {k: getattr(self, k) for k in _FIELDS}
        raw["mode"] = f"{self.mode:04o}"
        raw["policy"] = dict(self.policy)
        raw["stat"] = list(self.stat) if self.stat is not None else None
        return raw

    @classmethod
    def from_raw(cls, raw: Any) -> Entry:
        """Check RAW (one element of "entries") and build the Entry; ValueError says what is wrong."""
        if not isinstance(raw, dict):
            raise ValueError("expected a JSON object")
        unknown = sorted(set(raw) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown key \"{unknown[0]}\"")
        missing = [k for k in _FIELDS if k not in raw]
        if missing:
            raise ValueError(f"missing key \"{missing[0]}\"")
        _check_fields(raw)
        values = dict(raw)
        values["mode"] = int(raw["mode"], 8)
        return cls(**values)
