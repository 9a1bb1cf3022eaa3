"""POSIX access ACLs as the kernel reads and writes them: the "system.posix_acl_access" xattr.

The format is the kernel's (include/uapi/linux/posix_acl_xattr.h): a little-endian u32
version (2), then one 8-byte entry per line of the ACL, each (u16 tag, u16 permissions,
u32 id), sorted by tag, then by id; the id means something only for USER and GROUP entries
(others carry -1). An ACL with named entries needs a MASK: it caps what they get (and is
what `ls -l` shows as the group bits). Bytes in, bytes out: nothing here touches a file.
"""
from __future__ import annotations

import struct
from typing import Iterable, List, NamedTuple

XATTR = "system.posix_acl_access"
VERSION = 2
USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
READ, WRITE, EXECUTE = 4, 2, 1
RWX = READ | WRITE | EXECUTE
UNDEFINED_ID = 0xFFFFFFFF
_HEADER = struct.Struct("<I")
_ENTRY = struct.Struct("<HHI")
_TAGS = (USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER)


class Entry(NamedTuple):
    tag: int
    perm: int
    id: int = UNDEFINED_ID


def encode(entries: Iterable[Entry]) -> bytes:
    """The xattr value of ENTRIES, in the kernel's order (it refuses any other)."""
    ordered = sorted(entries, key=lambda e: (e.tag, e.id))
    return _HEADER.pack(VERSION) + b"".join(_ENTRY.pack(*e) for e in ordered)


def decode(data: bytes) -> List[Entry]:
    """The entries of an xattr value; ValueError for anything not a version 2 ACL."""
    if len(data) < _HEADER.size or (len(data) - _HEADER.size) % _ENTRY.size:
        raise ValueError(f"a POSIX ACL of {len(data)} bytes: not a 4-byte header and 8-byte entries")
    (version,) = _HEADER.unpack_from(data)
    if version != VERSION:
        raise ValueError(f"a POSIX ACL of version {version}, not {VERSION}")
    entries = [Entry(*_ENTRY.unpack_from(data, offset)) for offset in range(_HEADER.size, len(data), _ENTRY.size)]
    if any(e.tag not in _TAGS for e in entries):
        raise ValueError(f"a POSIX ACL with an unknown tag: {entries}")
    return entries


def owner_and_users(owner_perm: int, uids: Iterable[int], perm: int = RWX) -> bytes:
    """The ACL that gives the file's owner OWNER_PERM, each of UIDS PERM, and nobody else
    (owning group, others) anything: with no UIDS, that of mode OWNER_PERM << 6."""
    named = [Entry(USER, perm, uid) for uid in sorted(set(uids))]
    base = [Entry(USER_OBJ, owner_perm), Entry(GROUP_OBJ, 0), Entry(OTHER, 0)]
    return encode(base + named + ([Entry(MASK, perm)] if named else []))


def users(data: bytes) -> List[int]:
    """The uids named in an ACL (its USER entries), whatever they may do."""
    return [e.id for e in decode(data) if e.tag == USER]
