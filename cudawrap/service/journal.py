"""The service's own account of what it did: a line for the journal (or the --daemon log).

Apart because the service's start, its loop's parts and its grants (MPS's ACLs, [confine])
all write these lines, and none of them may import the others to do so."""
from __future__ import annotations


def say(line: str) -> None:
    """A line for the journal (or the --daemon log): the service's own account of what it did."""
    print(f"cudawrap serve: {line}", flush=True)
