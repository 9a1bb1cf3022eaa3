"""Which character devices a confined run may not open: the one rule both cgroup mechanisms apply.

A rule is data, pure and small: character-device ranges refused whole by major (the GPU
nodes, major 195 minors 0-253; every capability of the dynamic nvidia-caps major), and the
(major, minor) pairs let through nonetheless (the run's own GPUs and MIG capabilities, the
MIG config and monitor capabilities). Refusing by range, not by listing today's nodes, keeps
a GPU or MIG instance made later refused too. Everything else (block devices, nvidiactl at
195:255, nvidia-modeset at 195:254, nvidia-uvm, InfiniBand) stays as it was.
"""
from __future__ import annotations

from typing import FrozenSet, NamedTuple, Optional, Tuple

GPU_MAJOR = 195  # the NVIDIA driver's fixed major (its nodes /dev/nvidiaN, nvidiactl, nvidia-modeset)
GPU_MINORS = (0, 253)  # /dev/nvidiaN; 254 is nvidia-modeset and 255 nvidiactl, which every CUDA program opens
MINOR_MAX = (1 << 20) - 1  # the kernel's MINORBITS


class Span(NamedTuple):
    """Character devices MAJOR:LOW..HIGH (inclusive)."""
    major: int
    low: int
    high: int


class Rule(NamedTuple):
    refused: Tuple[Span, ...]
    allowed: FrozenSet[Tuple[int, int]]

    def refuses(self, major: int, minor: int) -> bool:
        """Whether a character device MAJOR:MINOR is refused (the reference both mechanisms follow)."""
        if (major, minor) in self.allowed:
            return False
        return any(s.major == major and s.low <= minor <= s.high for s in self.refused)


def gpu_rule(own_gpu_minors: FrozenSet[int], caps_major: Optional[int] = None,
             own_caps_minors: FrozenSet[int] = frozenset(), caps_high: int = MINOR_MAX) -> Rule:
    """Refuse every GPU node but OWN_GPU_MINORS and, where the driver has an nvidia-caps major,
    every capability node but OWN_CAPS_MINORS (which should name the config and monitor
    capabilities too: a MIG program opens them). CAPS_HIGH bounds the capability span: the
    highest minor of the driver's table (/proc/driver/nvidia-caps/mig-minors, which lists every
    capability any GPU can have), which the v1 controller needs to refuse it minor by minor."""
    refused = [Span(GPU_MAJOR, *GPU_MINORS)]
    allowed = {(GPU_MAJOR, m) for m in own_gpu_minors}
    if caps_major is not None:
        refused.append(Span(caps_major, 0, caps_high))
        allowed |= {(caps_major, m) for m in own_caps_minors}
    return Rule(tuple(refused), frozenset(allowed))
