"""`cudawrap run --substitute`: the leased devices written into a command's arguments.

For programs that take a device on their command line (`-p 0:{index}`) instead of, or
besides, reading CUDA_VISIBLE_DEVICES. The lease is taken first and the arguments filled
in after, so no other run can be given the device in between.

Two numberings exist and they differ: CUDA's (the order of CUDA_VISIBLE_DEVICES, or by
default fastest first) and NVML's (nvidia-smi's, PCI bus order). cudawrap sets
CUDA_VISIBLE_DEVICES to the leased UUIDs, which no ordering can misread, so a program that
honours it numbers the leased devices 0..n-1 in lease order: that is ``{index}``. A tool
that enumerates every GPU regardless (nvidia-smi, NVML-based tools, an OpenCL platform
that ignores the variable) needs ``{nvml_index}``, the GPU's NVML index.
"""
from __future__ import annotations

import re
from typing import Callable, List, Optional, Sequence, Tuple

from ..errors import UsageError

# placeholder -> what it gives, for --help and messages.
PLACEHOLDERS = {
    "{index}": "the CUDA index the program sees (0: CUDA_VISIBLE_DEVICES holds the lease)",
    "{indices}": "the CUDA indices of all leased devices, comma-separated (0,1,…)",
    "{uuid}": "the leased device's UUID",
    "{uuids}": "all leased UUIDs, comma-separated",
    "{nvml_index}": "the GPU's NVML index (nvidia-smi -i), for tools that ignore CUDA_VISIBLE_DEVICES",
    "{nvml_indices}": "the NVML indices of all leased GPUs, comma-separated",
}
_SINGLE = {"{index}": "{indices}", "{uuid}": "{uuids}", "{nvml_index}": "{nvml_indices}"}
_LOOKS_LIKE = re.compile(r"\{[a-z_]+\}")


def substitute(args: Sequence[str], uuids: Sequence[str],
               nvml_index: Callable[[str], Optional[int]]) -> Tuple[List[str], List[str]]:
    """(ARGS with the placeholders filled in for the leased UUIDS, warnings).

    NVML_INDEX(uuid) is the NVML index of a whole GPU, None for a MIG instance (which has
    none of its own); it is called only when an NVML placeholder is used. Raises
    UsageError for a placeholder that cannot be filled.
    """
    text = " ".join(args)
    for one, many in _SINGLE.items():
        if one in text and len(uuids) != 1:
            raise UsageError(f"--substitute: {one} names one device, but {len(uuids)} are leased",
                             hint=f"use {many} for a comma-separated list")
    values = {
        "{indices}": ",".join(str(i) for i in range(len(uuids))),
        "{uuids}": ",".join(uuids),
    }
    values["{index}"] = values["{indices}"]
    values["{uuid}"] = values["{uuids}"]
    if "{nvml_" in text:
        numbers = []
        for uuid in uuids:
            number = nvml_index(uuid)
            if number is None:
                raise UsageError(f"--substitute: {uuid} is a MIG instance, which has no NVML index",
                                 hint="use {uuid} (or {index}, for a program that reads CUDA_VISIBLE_DEVICES)")
            numbers.append(str(number))
        values["{nvml_indices}"] = values["{nvml_index}"] = ",".join(numbers)
    warnings = sorted({f"{found} is not a placeholder and is passed as it is (known: "
                       f"{', '.join(PLACEHOLDERS)})"
                       for arg in args for found in _LOOKS_LIKE.findall(arg) if found not in PLACEHOLDERS})
    pattern = re.compile("|".join(re.escape(p) for p in sorted(values, key=len, reverse=True)))
    return [pattern.sub(lambda m: values[m.group(0)], arg) for arg in args], warnings
