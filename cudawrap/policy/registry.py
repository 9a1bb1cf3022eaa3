"""The registry of wrapped programs: one versioned JSON document, replaced atomically.

On disk (``layout.registry_file``, root-owned, mode 0644)::

    {"version": 1, "entries": [{"link": "/opt/app/bin/recon", "real": ".../CUDAWRAP_recon",
      "sha256": "…", "mode": "0755", "uid": 0, "gid": 0, "symlink": null,
      "package": null, "diversion": null, "policy": {"gpus": 2, "wait": "forever"},
      "wrapped_by": "alice", "wrapped_at": "2024-05-01T12:00:00Z",
      "cudawrap_version": "0.1.0", "phase": "wrapped", "stat": [ino, size, mtime_ns, ctime_ns]}]}

The shim calls :func:`read_policy` on every launch, so this module's top imports only
``json`` and ``os`` (``dataclasses`` alone costs ~11 ms, ``typing`` ~4 ms): entries are
small immutable ``__slots__`` classes, and ``filelock`` is imported by the writers only.
Readers never lock: writers replace the file with ``rename``, so a reader sees the old
document or the new one, never half of either.
"""
from __future__ import annotations

import json
import os

from ..errors import DataError, StateError
# The phases are named here too, by the registry's users (`cudawrap create`, unwrap, doctor).
from .entry import PHASES, UNWRAPPING, WRAPPED, WRAPPING, Entry  # noqa: F401

TYPE_CHECKING = False  # `import typing` costs ~4 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

    from ..paths import Layout

VERSION = 1

# How to bring an older document up to the next version: {old version: converter}.
# Version 1 is the first released format, so nothing needs converting yet; a future
# version 2 adds ``1: _v1_to_v2`` here and readers keep accepting version 1 files.
_UPGRADES: Dict[int, Callable[[Dict[str, Any]], Dict[str, Any]]] = {}


def _bad(path: str, problem: str) -> DataError:
    """The one-line error for a registry cudawrap cannot use: what, where, how to recover."""
    bak = path + ".bak"
    return DataError(
        f"{path}: {problem}; it was left untouched: restore the copy saved at the last change "
        f"with 'cp {bak} {path}', or move the file aside and run 'cudawrap doctor --repair' "
        "to re-register the wrapped programs"
    )


def _parse(path: str, data: bytes) -> Dict[str, Any]:
    """The document in DATA (the bytes of PATH) at the current version, or DataError."""
    try:
        doc = json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise _bad(path, f"not valid JSON ({exc})") from None
    except RecursionError:
        raise _bad(path, "not valid JSON (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise _bad(path, "not a cudawrap registry (expected a JSON object)")
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise _bad(path, f"not a cudawrap registry (bad or missing \"version\": {version!r})")
    if version > VERSION:
        raise DataError(
            f"{path}: registry version {version} was written by a newer cudawrap "
            f"(this one reads up to version {VERSION}); upgrade cudawrap to use it"
        )
    while version < VERSION:
        doc = _UPGRADES[version](doc)
        version = doc["version"]
    if not isinstance(doc.get("entries"), list):
        raise _bad(path, "\"entries\" is missing or not a list")
    return doc


def _read_document(path: str) -> Optional[Dict[str, Any]]:
    """The parsed document at PATH, or None when there is no registry yet."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DataError(f"{path}: cannot read the registry: {exc.strerror}") from None
    return _parse(path, data)


def _canonical(link: str) -> str:
    """LINK with its directory resolved: /bin/x and /usr/bin/x are one program on merged-/usr."""
    head, tail = os.path.split(link)
    return os.path.join(os.path.realpath(head), tail)


def read_policy_at(registry_file: str, link: str) -> Dict[str, Any]:
    """The raw policy recorded for LINK in REGISTRY_FILE; {} if none or no registry.

    For a shim that knows only the install root (``locations.under(root, REGISTRY_FILE)``).
    Only LINK's own entry is checked beyond the document's shape, so a hand-edit mistake
    in one entry does not stop every other wrapped program from starting.
    """
    doc = _read_document(registry_file)
    if doc is None:
        return {}
    link = os.path.normpath(link)
    candidates = [e for e in doc["entries"] if isinstance(e, dict)]
    found = [e for e in candidates if e.get("link") == link]
    if not found:
        # Rare (an alias of the directory, such as /bin on merged-/usr): pay for realpath
        # only when the exact match missed.
        wanted = _canonical(link)
        found = [e for e in candidates if isinstance(e.get("link"), str) and _canonical(e["link"]) == wanted]
    if not found:
        return {}
    policy = found[0].get("policy", {})
    if not isinstance(policy, dict):
        raise _bad(registry_file, f"the \"policy\" of {link} is not a JSON object")
    return dict(policy)


def read_policy(layout: Layout, link: str) -> Dict[str, Any]:
    """The raw per-program policy of the wrap whose link path is LINK ({} if none).

    LINK is the absolute path of the wrapped name as invoked, not symlink-resolved.
    Raises DataError, naming the file and how to recover, if the registry is corrupt.
    """
    return read_policy_at(os.fspath(layout.registry_file), link)


class Registry:
    """Every entry of one registry document, immutable; changes make a new Registry."""

    __slots__ = ("entries",)

    entries: Tuple[Entry, ...]

    def __init__(self, entries: Tuple[Entry, ...] = ()) -> None:
        object.__setattr__(self, "entries", tuple(entries))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Registry is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Registry) and self.entries == other.entries

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def find(self, path: str) -> Optional[Entry]:
        """The entry whose link (or real program) is PATH."""
        path = os.path.normpath(path)
        for entry in self.entries:
            if path in (entry.link, entry.real):
                return entry
        return None

    def put(self, entry: Entry) -> Registry:
        """A registry with ENTRY added, or replacing the entry with the same link."""
        others = [e for e in self.entries if e.link != entry.link]
        if len(others) == len(self.entries):
            return Registry(tuple(others) + (entry,))
        return Registry(tuple(entry if e.link == entry.link else e for e in self.entries))

    def drop(self, link: str) -> Registry:
        return Registry(tuple(e for e in self.entries if e.link != link))

    def to_raw(self) -> Dict[str, Any]:
        return {"version": VERSION, "entries": [e.to_raw() for e in self.entries]}

    @classmethod
    def from_document(cls, path: str, doc: Dict[str, Any]) -> Registry:
        entries: List[Entry] = []
        links = set()
        for number, raw in enumerate(doc["entries"]):
            where = f"entry {number + 1}"
            if isinstance(raw, dict) and isinstance(raw.get("link"), str):
                where += f" ({raw['link']})"
            try:
                entry = Entry.from_raw(raw)
            except ValueError as exc:
                raise _bad(path, f"{where}: {exc}") from None
            if entry.link in links:
                raise _bad(path, f"{entry.link} is listed twice")
            links.add(entry.link)
            entries.append(entry)
        return cls(tuple(entries))


def load_path(path: str) -> Registry:
    """The registry document at PATH (empty if there is none); DataError if it is unusable."""
    doc = _read_document(path)
    return Registry() if doc is None else Registry.from_document(path, doc)


def load(layout: Layout) -> Registry:
    """The registry of LAYOUT (empty if there is none yet); DataError if it is unusable."""
    return load_path(os.fspath(layout.registry_file))


def _write_file(path: str, data: bytes) -> None:
    """Write DATA to PATH + ".tmp", fsync it, and rename it over PATH."""
    tmp = path + ".tmp"
    # O_NOFOLLOW: never write through a planted symlink. The fixed temporary name is safe
    # because every writer holds the registry lock, and it leaves no litter after kill -9.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)  # world-readable whatever the umask: every shim reads it
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(layout: Layout, registry: Registry) -> None:
    """Replace LAYOUT's registry with REGISTRY atomically. The caller holds :func:`lock`.

    A crash or kill -9 at any moment leaves the old document or the new one. The same
    bytes then go to ``registry.json.bak`` (a separate file, not a hard link, so an
    editor writing the registry in place cannot damage both): if the registry is later
    hand-edited into nonsense or damaged, the copy is what cudawrap last wrote.
    """
    path = os.fspath(layout.registry_file)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise StateError(f"{directory} does not exist: cudawrap is not installed under {layout.root}; "
                         "run install.sh first")
    data = (json.dumps(registry.to_raw(), indent=2) + "\n").encode("ascii")
    try:
        _write_file(path, data)
        fsync_dir(directory)
    except OSError as exc:
        _discard(path + ".tmp")
        raise StateError(f"{path}: cannot write the registry: {exc.strerror or exc}") from None
    try:
        _write_file(path + ".bak", data)
    except OSError as exc:
        # The registry itself is written; a stale copy only matters after a later accident.
        import logging

        _discard(path + ".bak.tmp")
        logging.getLogger(__name__).warning("%s.bak: the recovery copy was not updated: %s",
                                            path, exc.strerror or exc)


def _discard(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


_locks: Dict[str, Any] = {}


def lock(layout: Layout, timeout: float = 60.0) -> _RegistryLock:
    """The registry lock as a context manager; re-entrant within one process.

    Every writer holds it from reading the registry to writing it back. Users never need
    it: readers rely on the atomic replace.
    """
    import filelock

    path = os.fspath(layout.registry_lock)
    found = _locks.get(path)
    if found is None:
        found = _locks[path] = _RegistryLock(filelock.FileLock(path, timeout=timeout, mode=0o644), path)
    return found


class _RegistryLock:
    """A FileLock whose timeout is a one-line StateError instead of filelock.Timeout."""

    def __init__(self, file_lock: Any, path: str) -> None:
        self._lock = file_lock
        self._path = path

    def __enter__(self) -> _RegistryLock:
        import filelock

        try:
            self._lock.acquire()
        except filelock.Timeout:
            raise StateError(
                f"another cudawrap command is changing wrapped programs (it holds {self._path}); "
                "try again when it has finished"
            ) from None
        except PermissionError:
            raise StateError(f"{self._path}: cannot take the registry lock (permission denied)") from None
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()


def update(layout: Layout, change: Callable[[Registry], Registry]) -> Registry:
    """Load, apply CHANGE, save, under the lock; returns the new registry."""
    with lock(layout):
        new = change(load(layout))
        save(layout, new)
        return new
