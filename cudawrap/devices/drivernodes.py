"""Which device nodes are a device's own, from where the NVIDIA driver publishes their numbers.

- A GPU's node /dev/nvidiaN is character major 195 (the driver's fixed major), minor N =
  NVML's ``nvmlDeviceGetMinorNumber`` (``nvml.node_ids``), not its NVML index.
- The nvidia-caps major is dynamic: its line in /proc/devices ("Character devices:").
- Each MIG capability's minor is in /proc/driver/nvidia-caps/mig-minors, one "NAME MINOR" a
  line: "config 1", "monitor 2", "gpu0/gi1/access 3", "gpu0/gi1/ci0/access 4", ... where gpuN
  is the GPU's node minor. The table lists every capability any GPU can have, made or not.
A MIG instance's own nodes are its parent GPU's node and its GPU and compute instances'
access capabilities; config and monitor are left open to every run (as the issue asks: a
MIG program reads them, and they let nobody use a GPU).

PROC is the proc filesystem to read ("/proc"): ``[confine] proc`` in the root-owned config.
"""
from __future__ import annotations

import os
from typing import Dict, FrozenSet, Iterable, Optional, Tuple

from ..base.devrule import MINOR_MAX, Rule, gpu_rule

CAPS_NAME = "nvidia-caps"
MIG_MINORS = "driver/nvidia-caps/mig-minors"
OPEN_CAPS = ("config", "monitor")

# (node minor of the GPU, GPU instance id, compute instance id): None ids for a whole GPU.
NodeIds = Tuple[int, Optional[int], Optional[int]]


def char_major(name: str, proc: str = "/proc") -> Optional[int]:
    """The character major the driver NAME registered (/proc/devices), or None."""
    try:
        with open(os.path.join(proc, "devices")) as f:
            text = f.read()
    except OSError:
        return None
    chars = text.split("Block devices:", 1)[0]
    for line in chars.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == name and parts[0].isdigit():
            return int(parts[0])
    return None


def mig_minors(proc: str = "/proc") -> Dict[str, int]:
    """The driver's capability table, name -> minor; empty where there is none (no MIG support)."""
    table: Dict[str, int] = {}
    try:
        with open(os.path.join(proc, MIG_MINORS)) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1].isdigit():
                    table[parts[0]] = int(parts[1])
    except OSError:
        pass
    return table


def own_caps(ids: NodeIds) -> Tuple[str, ...]:
    """The capability names that are a MIG instance's own (none for a whole GPU)."""
    minor, gi, ci = ids
    if gi is None:
        return ()
    return (f"gpu{minor}/gi{gi}/access",) + (() if ci is None else (f"gpu{minor}/gi{gi}/ci{ci}/access",))


# What rule() reads of the driver: (its nvidia-caps major, its capability table).
Published = Tuple[Optional[int], Dict[str, int]]


def published(proc: str = "/proc") -> Published:
    """What the driver publishes of its capability nodes now (~0.1 ms: /proc/devices is made
    at each read). Fixed while the driver is loaded, and it cannot be unloaded while anyone has
    it open: a run holding a GPU, or the service itself (its NVML stays initialised)."""
    return char_major(CAPS_NAME, proc), mig_minors(proc)


def rule(owned: Iterable[NodeIds], proc: str = "/proc", driver: Optional[Published] = None) -> Rule:
    """The rule that lets a run open the nodes of the devices it holds (OWNED) and no other GPU
    or MIG instance's; DRIVER: what published() said, else read now."""
    owned = list(owned)
    caps_major, table = driver if driver is not None else published(proc)
    gpu_minors: FrozenSet[int] = frozenset(ids[0] for ids in owned)
    if caps_major is None:
        return gpu_rule(gpu_minors)
    names = [n for ids in owned for n in own_caps(ids)] + list(OPEN_CAPS)
    caps = frozenset(table[n] for n in names if n in table)
    return gpu_rule(gpu_minors, caps_major, caps, caps_high=max(table.values()) if table else MINOR_MAX)
