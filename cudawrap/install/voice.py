"""How install.sh's Python half and the .deb's maintainer scripts speak: each step on stdout,
each warning on stderr, flushed to stay in order with the commands they run."""
from __future__ import annotations

import sys

PROG = "install.sh"


def installer_say(line: str) -> None:
    """One step on stdout (a warning on stderr), flushed to stay in order with the commands run."""
    print(line, file=sys.stderr if line.startswith(f"{PROG}: ") else sys.stdout, flush=True)


def package_say(line: str) -> None:
    """A step or warning of the .deb's maintainer scripts, which speak as `cudawrap:`."""
    if line.startswith("==> "):
        print(f"cudawrap: {line[4:]}", flush=True)
    else:
        print(line.replace(f"{PROG}: ", "cudawrap: ", 1), file=sys.stderr, flush=True)
