"""What a run asks for, as one value from its settings to its queue entry and back, and
where the devices it is given go (place(): its placement, spread, pack or random).

The launch makes it from the run's Settings (and the devices the filters left), the
acquirer decides on it, the queue entry is named after it and read back into it, and the
service makes the same from what a client asks: never taken apart into arguments on the
way. Imported on the shim's path: no typing, no dataclasses; and all a launch nobody waits
before (the usual case) needs of the scheduler, in one module (the shim pays ~0.1 ms for each).
"""

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Set, Tuple


class Request:
    """COUNT devices (a slot on each if SHARE) among CANDIDATES (None: any), preferred by
    PLACEMENT, kept for this run once it has waited RESERVE_AFTER s, each with at least
    MIN_FREE_MIB free and at most MAX_UTIL % busy (the filters on what changes as jobs come
    and go; the others narrowed CANDIDATES already). FOREIGN: the run's own rule for work
    cudawrap did not start, (foreign, busy_memory_mib) of its program's settings; None: the
    deciding view's (a queue entry's name does not carry it). Immutable: replace() makes another."""

    __slots__ = ("count", "candidates", "placement", "reserve_after", "min_free_mib", "max_util", "share",
                 "foreign")

    def __init__(self, count: int = 1, candidates: "Optional[FrozenSet[str]]" = None, placement: str = "spread",
                 reserve_after: float = 300.0, min_free_mib: int = 0, max_util: int = 100,
                 share: bool = False, foreign: "Optional[Tuple[str, int]]" = None) -> None:
        put = object.__setattr__
        put(self, "count", count)
        put(self, "candidates", None if candidates is None else frozenset(candidates))
        put(self, "placement", placement)
        put(self, "reserve_after", reserve_after)
        put(self, "min_free_mib", min_free_mib)
        put(self, "max_util", max_util)
        put(self, "share", share)
        put(self, "foreign", foreign)

    @classmethod
    def of(cls, values: "Any", count: int, share: bool) -> "Request":
        """The request of a run under VALUES (key -> value: Settings.values()) for COUNT devices."""
        return cls(count, None, values.get("placement", "spread"), float(values.get("reserve_after", 300.0)),
                   values.get("min_free_memory_mib", 0), values.get("max_utilization", 100), share,
                   (values.get("foreign", "avoid"), values.get("busy_memory_mib", 1024)))

    def replace(self, **changes: "Any") -> "Request":
        fields = {k: getattr(self, k) for k in self.__slots__}
        fields.update(changes)
        return Request(**fields)

    @property
    def dynamic(self) -> bool:
        """Whether a device that passes now may fail later, or the reverse (memory, load)."""
        return self.min_free_mib > 0 or self.max_util < 100

    def __setattr__(self, name: str, value: "Any") -> None:
        raise AttributeError("a Request cannot be changed; make a new one with replace()")

    def _key(self) -> tuple:
        return tuple(getattr(self, k) for k in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Request) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "Request(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


def place(eligible: "Sequence[str]", count: int, placement: str, parents: "Mapping[str, str]",
          busy: "Set[str]", seed: str = "") -> "List[str]":
    """COUNT devices of ELIGIBLE (in the machine's order) by the placement policy.

    spread: on the physical GPUs with the smallest share of busy devices; pack: the largest;
    random: a shuffle seeded by SEED, so every process that computes this decision agrees.
    """
    if placement == "random":
        import random  # only here: ~3 ms of imports nobody else needs

        pool = list(eligible)
        random.Random(seed).shuffle(pool)
        return pool[:count]
    total: "Dict[str, int]" = {}
    taken: "Dict[str, int]" = {}
    for uuid, parent in parents.items():
        total[parent] = total.get(parent, 0) + 1
        if uuid in busy:
            taken[parent] = taken.get(parent, 0) + 1
    sign = -1 if placement == "pack" else 1
    chosen: "List[str]" = []
    pool = list(eligible)
    while len(chosen) < count:
        # Each physical GPU's share of busy devices (signed); min() keeps the first of equals,
        # and POOL is in the machine's order.
        share = {parent: sign * taken.get(parent, 0) / n for parent, n in total.items()}
        best = min(pool, key=lambda u: share.get(parents.get(u, u), 0.0))
        pool.remove(best)
        chosen.append(best)
        parent = parents.get(best, best)
        taken[parent] = taken.get(parent, 0) + 1
    return chosen
