"""Which free devices a run gets, by the placement policy: spread, pack or random.

Its own module, small, because a launch nobody waits before (the usual case) needs only
this of the scheduler (cudawrap.sched.schedule), and the shim pays for every module it imports.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Dict, List, Mapping, Sequence, Set, Tuple


def place(eligible: Sequence[str], count: int, placement: str, parents: Mapping[str, str],
          busy: Set[str], seed: str = "") -> List[str]:
    """COUNT devices of ELIGIBLE (in the machine's order) by the placement policy.

    spread: on the physical GPUs with the smallest share of busy devices; pack: the largest;
    random: a shuffle seeded by SEED, so every process that computes this decision agrees.
    """
    if placement == "random":
        import random  # only here: ~3 ms of imports nobody else needs

        pool = list(eligible)
        random.Random(seed).shuffle(pool)
        return pool[:count]
    total: Dict[str, int] = {}
    taken: Dict[str, int] = {}
    for uuid, parent in parents.items():
        total[parent] = total.get(parent, 0) + 1
        if uuid in busy:
            taken[parent] = taken.get(parent, 0) + 1
    rank = {uuid: i for i, uuid in enumerate(eligible)}
    sign = -1 if placement == "pack" else 1
    chosen: List[str] = []
    pool = list(eligible)
    while len(chosen) < count:
        def key(u: str) -> Tuple[float, int]:
            parent = parents.get(u, u)
            return (sign * taken.get(parent, 0) / total.get(parent, 1), rank[u])

        best = min(pool, key=key)
        pool.remove(best)
        chosen.append(best)
        parent = parents.get(best, best)
        taken[parent] = taken.get(parent, 0) + 1
    return chosen
