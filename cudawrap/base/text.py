"""Text from users made safe to show an admin or to log: one helper for every place.

Program names, file names found in directories, command lines and queue entries are chosen
by users. Printed raw, a control character can move the cursor, clear the screen, fake a
line of `cudawrap doctor` or of the audit log, or reverse the text after it (U+202E).
Imported by the shim (through audit), so it imports nothing.
"""

_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str, limit: int = 0) -> str:
    """TEXT with every unprintable character written as a visible escape (``\\n``, ``\\x1b``,
    ``\\u202e``), cut to LIMIT characters of input when LIMIT is given.

    A byte that was not valid UTF-8 (a file name, decoded with surrogateescape) shows as
    the ``\\xNN`` it was on disk. Printable text, spaces and non-ASCII letters included,
    is left exactly as it is.
    """
    if limit:
        text = text[:limit]
    if text.isprintable():
        return text
    out = []
    for c in text:
        if c.isprintable():
            out.append(c)
            continue
        code = ord(c)
        if c in _SHORT:
            out.append(_SHORT[c])
        elif 0xDC80 <= code <= 0xDCFF:  # surrogateescape: the raw byte
            out.append(f"\\x{code - 0xDC00:02x}")
        elif code < 0x100:
            out.append(f"\\x{code:02x}")
        elif code < 0x10000:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    return "".join(out)
