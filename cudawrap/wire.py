"""What travels between the cudawrap service and its clients: small, versioned, plain bytes.

A message is a header line ``cudawrap/1 VERB`` followed by ``key=value`` lines and an
empty line::

    cudawrap/1 request\\ncount=1\\nwait=30\\n\\n

Keys are lower-case ASCII words; a value is any text without NUL, a newline written ``\\n``
and a backslash ``\\\\``. A message is at most MAX_MESSAGE bytes. That is all the parsing
there is, so the shim's side needs neither ``json`` nor ``re`` (the launch pays for every
module it imports). A leaf: nothing here imports the rest of cudawrap.

Descriptors travel beside a ``grant`` message as SCM_RIGHTS, one for each entry of its
``fds`` field, in that order: ``lease:UUID:ex`` (a whole device: the exclusive lock on its
lease file), or ``lease:UUID:sh`` followed by ``slot:UUID:ex`` (a share: the shared lock on
the lease file, the exclusive lock on one of its slot files). Its ``env`` and ``defaults``
(``pairs``) are the variables the run gets, as a run that decides for itself sets them.

A ``grant`` to a run that was told it waits carries ``text=``, the line its client shows
once the locks are taken (``got DEVICES after N s``), as a run deciding for itself says it.

A ``wait`` message may carry ``ticket=`` (a waiter's place in line, signed by the service:
service/tickets.py); a client whose connection ends before its grant sends it back as
``ticket=`` of its next ``request``. Both fields are optional: a peer without them is
answered as before, so the version stays 1.
"""
# No `from __future__ import annotations` here (nor in locations.py): at run time it imports
# the module __future__, ~0.1 ms of every launch. Annotations naming typing's names are strings.
import sys

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, List, Optional, Tuple

VERSION = 1
MAGIC = b"cudawrap/%d " % VERSION
MAX_MESSAGE = 16 << 10
# The service's answer to a question (status: every device and waiter, as JSON) may be larger;
# only clients read it, from the service, so the bound protects no one from anyone.
MAX_ANSWER = 8 << 20
# The most descriptors one message carries (lease and slot files of one grant).
MAX_FDS = 64
FD_BYTES = 4  # each, an int in SCM_RIGHTS
END = b"\n\n"

# Client -> service.
REQUEST = "request"  # ask for devices (share=1: a share of each; ticket=: the place in line a restart took)
# A shim's run (its fast path, cudawrap/__init__.py): the service reads the settings of the program the kernel
# says the client runs, with asks= (its CUDAWRAP_* variables, ``pairs``) as the run's
# environment; visible=, order= and ticket= as in a request. A service that does not know it
# answers an error of code 76 (EX_PROTOCOL), and the shim asks again the general way.
RUN = "run"
HELD = "held"  # the grant's locks are taken (a run granted whole devices may close instead: checked alike)
LOST = "lost"  # a lock of the grant was taken by someone else first
STATUS = "status"  # anyone's question: who holds and who waits (answer: json=)
CANCEL = "cancel"  # pids=: end those waiting runs (their owner's or root's word, by the kernel)
REVOKE = "revoke"  # devices=, by=: root's `cudawrap revoke` (answer: revoked=, holders=)
# Service -> client.
WAIT = "wait"  # a line to show while waiting (text=), and/or a reconnect ticket (ticket=)
GRANT = "grant"  # descriptors attached (fds= says which is which), env=, defaults=; text= a line to show
DONE = "done"  # the grant counts as held; anything to add to the environment
ERROR = "error"  # code= (an exit status), text=, hint=; the connection closes after it
ANSWER = "answer"  # the reply to a question


# What a descriptor of a grant is, and the lock its client takes on it (the ``fds`` field).
LEASE, SLOT = "lease", "slot"
EXCLUSIVE, SHARED = "ex", "sh"

# How a run takes a lease's lock, granted or chosen by itself (Acquirer._lock): tried this
# many times, this far apart, before it counts the lease taken, since a probe (the service's,
# a waiting run's) holds the lock for microseconds.
LOCK_TRIES = 4
LOCK_GAP_S = 0.0003


def pairs(variables: "Dict[bytes, bytes]") -> str:
    """VARIABLES as one field's value: ``NAME=VALUE`` lines."""
    return "\n".join(f"{k.decode('utf-8', 'surrogateescape')}={v.decode('utf-8', 'surrogateescape')}"
                     for k, v in variables.items())


def unpairs(text: str) -> "Dict[bytes, bytes]":
    """The variables of a ``pairs`` value (lines without ``=`` are no variable)."""
    out: Dict[bytes, bytes] = {}
    for line in text.split("\n"):
        name, sep, value = line.partition("=")
        if sep and name:
            out[name.encode("utf-8", "surrogateescape")] = value.encode("utf-8", "surrogateescape")
    return out


def described(reply: "Dict[str, str]") -> "Optional[List[Tuple[str, str, bool]]]":
    """(uuid, LEASE or SLOT, exclusive) of each descriptor of a GRANT, in the order they came;
    None for a grant that names no lease file, or names them wrongly."""
    devices = [u for u in reply.get("devices", "").split(",") if u]
    if "fds" not in reply:  # a service that grants whole devices only
        return [(u, LEASE, True) for u in devices] or None
    out = []
    for item in reply["fds"].split(","):
        what, _, rest = item.partition(":")
        uuid, _, kind = rest.rpartition(":")
        if what not in (LEASE, SLOT) or uuid not in devices or kind not in (EXCLUSIVE, SHARED):
            return None
        out.append((uuid, what, kind == EXCLUSIVE))
    return out if any(what == LEASE for _uuid, what, _ex in out) else None


def received_fds(ancillary: "List[Tuple[int, int, bytes]]") -> "List[int]":
    """The descriptors that came with a message (SCM_RIGHTS), from recvmsg's ancillary data."""
    import _socket

    return [int.from_bytes(payload[i:i + FD_BYTES], sys.byteorder, signed=True)
            for level, kind, payload in ancillary if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS
            for i in range(0, len(payload) - len(payload) % FD_BYTES, FD_BYTES)]


def lock_granted(fds: "List[int]", described: "List[Tuple[str, str, bool]]"
                 ) -> "Optional[Tuple[Dict[str, int], Dict[str, int]]]":
    """Each descriptor's lock, taken without blocking as a run deciding for itself takes it
    (a share: the lease file's shared lock, then its slot's exclusive one), DESCRIBED by its
    GRANT (described): (uuid -> lease descriptor, uuid -> slot descriptor), or None if one
    was taken past the service (by a run deciding for itself). Closes nothing."""
    import fcntl

    leases: Dict[str, int] = {}
    slots: Dict[str, int] = {}
    for fd, (uuid, what, exclusive) in zip(fds, described):
        how = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        for attempt in range(LOCK_TRIES):  # as a run deciding for itself: see LOCK_TRIES
            if attempt:
                import time

                time.sleep(LOCK_GAP_S)
            try:
                fcntl.flock(fd, how)
                break
            except OSError:
                continue
        else:
            return None
        (leases if what == LEASE else slots)[uuid] = fd
    return leases, slots


def exit_status(error: "Dict[str, str]", otherwise: int) -> int:
    """The exit status an ERROR names (its code), or OTHERWISE when it names none that is one."""
    code = error.get("code", "")
    return int(code) if code.isascii() and code.isdigit() and 0 < int(code) < 256 else otherwise


class WireError(ValueError):
    """A message that breaks the format: the peer gets one error and the connection closes."""


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    out = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            out.append("\n" if nxt == "n" else nxt)
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _key_ok(key: str) -> bool:
    return 0 < len(key) <= 32 and key.isascii() and key.replace("_", "a").isalnum() and key.islower()


def encode(verb: str, fields: "Dict[str, str]") -> bytes:
    """One message; ValueError for a key or size outside the format (a bug of ours)."""
    parts = [MAGIC, verb.encode("ascii"), b"\n"]
    for key, value in fields.items():
        if not _key_ok(key) or "\0" in value:
            raise ValueError(f"cannot send {key!r}")
        parts.append(f"{key}={_escape(value)}\n".encode("utf-8", "surrogateescape"))
    parts.append(b"\n")
    data = b"".join(parts)
    limit = MAX_ANSWER if verb == ANSWER else MAX_MESSAGE
    if len(data) > limit:
        raise ValueError(f"a {verb} message of {len(data)} bytes is over {limit}")
    return data


def decode(frame: bytes) -> "Tuple[str, Dict[str, str]]":
    """(verb, fields) of one message without its final empty line; WireError if malformed."""
    if not frame.startswith(MAGIC):
        raise WireError("not a cudawrap/%d message" % VERSION)
    if b"\0" in frame:
        raise WireError("a NUL byte in a message")
    try:
        text = frame[len(MAGIC):].decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("a message that is not UTF-8") from None
    lines = text.split("\n")
    verb = lines[0]
    if not _key_ok(verb):
        raise WireError("a message without a verb")
    fields: Dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        key, sep, value = line.partition("=")
        if not sep or not _key_ok(key) or key in fields:
            raise WireError("a malformed line in a message")
        fields[key] = _unescape(value)
    return verb, fields


class Reader:
    """Cuts a byte stream into messages; WireError once it is oversized or malformed."""

    def __init__(self, limit: int = MAX_MESSAGE) -> None:
        self.buffer = b""
        self.limit = limit

    def feed(self, data: bytes) -> "List[Tuple[str, Dict[str, str]]]":
        self.buffer += data
        out = []
        while True:
            end = self.buffer.find(END)
            if end < 0:
                if len(self.buffer) > self.limit:
                    raise WireError(f"a message over {self.limit} bytes")
                return out
            if end + len(END) > self.limit:
                raise WireError(f"a message over {self.limit} bytes")
            frame, self.buffer = self.buffer[:end], self.buffer[end + len(END):]
            out.append(decode(frame))
