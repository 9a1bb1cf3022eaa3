"""The configuration's schema: every table, its keys and each key's parser (values.py), the
defaults and the one-line descriptions that `cudawrap config`, the default file and the man
page show.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Mapping

from .healthconf import HEALTH_DEFAULTS, HEALTH_DESCRIPTIONS, health_keys
from .values import (FOREVER, MAX_GPUS, absolute_path, account_list, boolean, choice, connections, fraction,
                     memory_limit, mib, non_negative_int, parse_devices, parse_gpus, parse_model, parse_wait,
                     path_or_empty, percent, seconds, share_percentage, slots, uuid_list)

PLACEMENTS = ("spread", "pack", "random")
FOREIGN_RULES = ("avoid", "ignore")
NO_DRIVER_RULES = ("run", "fail")
MULTI_MIG_RULES = ("refuse", "whole-gpus")
NODE_RULES = ("open", "leased")
CGROUP_VERSIONS = ("auto", "v1", "v2")


# Settings a single program may override, by [programs."NAME"] in the config or by
# create-cudawrap's flags (kept in the registry).
POLICY_KEYS: Dict[str, Callable[[Any], Any]] = {
    "gpus": parse_gpus,
    "wait": parse_wait,
    "placement": choice(PLACEMENTS),
    "foreign": choice(FOREIGN_RULES),
    "busy_memory_mib": non_negative_int,
    "no_driver": choice(NO_DRIVER_RULES),
    "multi_mig": choice(MULTI_MIG_RULES),
    "reserve_after": parse_wait,
    "max_gpus": parse_gpus,
    "model": parse_model,
    "min_memory_mib": non_negative_int,
    "min_free_memory_mib": non_negative_int,
    "max_utilization": percent,
    "devices": parse_devices,
    "share": boolean,
}

DEVICE_KEYS: Dict[str, Callable[[Any], Any]] = {
    "allow": uuid_list,
    "allow_file": path_or_empty,
}

# The monitor's accounting and metrics, the service's bounds: root's settings, not a run's.
# Section -> its keys.
OPS_SECTIONS: Dict[str, Dict[str, Callable[[Any], Any]]] = {
    "metrics": {"textfile": path_or_empty},
    "ledger": {"max_mib": mib, "keep": non_negative_int},
    "service": {"private_status": boolean, "max_connections_per_uid": connections, "enforce": boolean,
                "connect_retry_s": seconds(zero_ok=True)},
    "health": health_keys(choice),
    # What the kernel enforces of the service's grants (docs/admin/confinement.md); only the
    # service applies it.
    "confine": {"runs": boolean, "nodes": choice(NODE_RULES), "cgroup": choice(CGROUP_VERSIONS),
                "allow_users": account_list, "proc": absolute_path, "dev": absolute_path},
}

DEFAULTS: Dict[str, Any] = {
    "gpus": 1,
    "wait": FOREVER,
    "placement": "spread",
    "foreign": "avoid",
    "busy_memory_mib": 1024,
    "no_driver": "run",
    "multi_mig": "refuse",
    "reserve_after": 300.0,
    "max_gpus": MAX_GPUS,
    "model": "",
    "min_memory_mib": 0,
    "min_free_memory_mib": 0,
    "max_utilization": 100,
    "devices": (),
    "share": False,
    "allow": (),
    "allow_file": "",
    "textfile": "",
    "max_mib": 64,
    "keep": 4,
    "private_status": False,
    "max_connections_per_uid": 1000,
    "enforce": False,
    "connect_retry_s": 10.0,
    **HEALTH_DEFAULTS,
    "runs": False,
    "nodes": "open",
    "cgroup": "auto",
    "allow_users": (),
    "proc": "/proc",
    "dev": "/dev",
}

DESCRIPTIONS: Dict[str, str] = {
    "gpus": "devices given to each run",
    "wait": "seconds to wait for a free device, or \"forever\"; 0 = do not wait",
    "placement": "spread (across physical GPUs), pack (fill one GPU first) or random",
    "foreign": "avoid or ignore devices running processes cudawrap did not start",
    "busy_memory_mib": "where process lists are hidden, more memory used than this is busy",
    "no_driver": "without an NVIDIA driver or NVML: run the program (leased by its lease file where one exists), or fail",
    "multi_mig": "more than one MIG instance on a driver before R570: refuse, or whole-gpus",
    "reserve_after": "seconds a run waits before free devices are kept for it until it has enough, or \"forever\"",
    "max_gpus": "the most devices one run may ask for (CUDAWRAP_GPUS, run -n, acquire(N))",
    "model": "only devices whose product name holds these words, e.g. \"H100\", \"A100 1g.10gb\"",
    "min_memory_mib": "only devices with at least this much memory in all (MiB)",
    "min_free_memory_mib": "only devices with at least this much memory free (MiB)",
    "max_utilization": "only devices busy at most this % (MIG: not reported, never excluded)",
    "devices": "only these devices: UUIDs, prefixes, NVML indices; empty = all",
    "share": "runs share a device with other shared runs ([sharing] slots per device) instead of taking it whole",
    "allow": "device UUIDs (or prefixes) cudawrap may hand out; empty = all",
    "allow_file": "file with one allowed UUID a line (the getgpu ids format), or \"\"",
    "textfile": "Prometheus text file the monitor rewrites every cycle (node_exporter's textfile "
                "directory, *.prom), or \"\" for none",
    "max_mib": "size at which the ledger of leases is rotated (MiB)",
    "keep": "rotated ledger files kept (ledger.1 is the newest)",
    "private_status": "with or without `cudawrap serve`: a user sees others' runs and processes only as busy "
                      "devices and counts (status, why, health, mps status, the monitor's files; root sees all)",
    "max_connections_per_uid": "with `cudawrap serve`: the most connections one user may keep open to it, "
                               "so runs waiting at once (root is not limited)",
    "enforce": "retired: it no longer does anything (RETIRED)",
    "connect_retry_s": "where the service arbitrates: how long a user's run tries to reach it (a restart) "
                       "before it exits 69",
    **HEALTH_DESCRIPTIONS,
    "runs": "with `cudawrap serve`: each granted run (and every process it starts) is put in a cgroup of "
            "its own that can open its own GPUs' and MIG instances' nodes and no other",
    "nodes": "open: GPU nodes keep the modes the driver gave them; leased (with `cudawrap serve`): GPU and "
             "MIG instance nodes root:root 0660, opened by a POSIX ACL entry to each user holding a lease on "
             "the device now and to allow_users",
    "cgroup": "the cgroup mechanism for runs: auto (what the host's init uses; v1 on a hybrid host), v1 "
              "(devices controller) or v2 (a BPF device program)",
    "allow_users": "accounts that may open every GPU node at all times (nvidia-persistenced, DCGM, "
                   "exporters), for node rules that close them",
    "proc": "where the driver's numbers are read: PROC/devices, PROC/driver/nvidia-caps/mig-minors, "
            "PROC/driver/nvidia/params",
    "dev": "where the device nodes are that nodes = \"leased\" closes: DEV/nvidiaN, DEV/nvidia-caps/nvidia-capN",
}


# What `cudawrap config` adds below the table when a setting is in force.
# Keys that still parse (an older config keeps working) and do nothing: said in one line by
# `cudawrap config`, sync and doctor wherever a config sets one (config.retired_notes).
RETIRED: Dict[str, str] = {
    "enforce": "[service] enforce no longer does anything: wherever the cudawrap service runs it is "
               "the only arbiter, and `cudawrap way` says (and switches) which way this install runs; "
               "remove the line",
}

NOTES: Dict[str, str] = {
    "max_utilization": "NVML reports no utilisation for MIG instances (nor for a GPU in MIG mode), "
                       "so max_utilization never excludes them; it applies to whole GPUs only",
}


LIMIT_KEYS: Dict[str, Callable[[Any], Any]] = {"max_devices_per_user": non_negative_int}
LIMIT_ENTRY_KEYS: Dict[str, Callable[[Any], Any]] = {"max_devices": non_negative_int}
LIMIT_DESCRIPTIONS: Dict[str, str] = {
    "max_devices_per_user": "most devices one user may hold at once; 0 = no limit",
    "max_devices": "in [limits.users.\"NAME\"] or [limits.groups.\"GROUP\"]: that user's or group's limit",
}


SHARING_MODES = ("time-slicing", "mps")



# A shared run's memory limit and what exceeding it does (docs/admin/memory.md); also
# per device ([sharing.devices."UUID"]) and per program ([programs."NAME"]).
MEMORY_KEYS: Dict[str, Callable[[Any], Any]] = {
    "memory_limit_mib": memory_limit,
    "memory_action": choice(("warn", "terminate")),
    "grace_s": seconds(False),
    "kill_after_s": seconds(True),
}

# [sharing]: how shared runs share a device (docs/admin/sharing.md). Absent optional keys
# mean "derived from slots" (thread share, memory limit, what a share counts as).
SHARING_KEYS: Dict[str, Callable[[Any], Any]] = {
    "slots": slots,
    "mode": choice(SHARING_MODES),
    "thread_percentage": share_percentage,
    "counts_as": fraction,
    **MEMORY_KEYS,
}
SHARING_DEVICE_KEYS: Dict[str, Callable[[Any], Any]] = {"slots": slots, **MEMORY_KEYS}
SHARING_DESCRIPTIONS: Dict[str, str] = {
    "slots": "shared runs one device takes at once; 1 = no sharing",
    "mode": "time-slicing (CUDA's own) or mps (NVIDIA MPS; `cudawrap mps start`)",
    "thread_percentage": "MPS: % of the device's SMs one shared run may use (default 100/slots)",
    "memory_limit_mib": "device memory one shared run may use, MiB (MPS pins it); 0 = none (default memory/slots)",
    "counts_as": "what one share counts as towards a user's device limit (default 1/slots)",
    "memory_action": "a time-slicing share over memory_limit_mib: warn (default) or terminate",
    "grace_s": "seconds a share may stay over its memory limit before memory_action (default 5)",
    "kill_after_s": "seconds from SIGTERM to SIGKILL for a share ended for its memory (default 10)",
}


# Every table the file may hold and its keys; "*" is a name the admin chooses. The default
# file (cudawrap.policy.defaults) shows each of them.
SCHEMA: Dict[str, Mapping[str, Callable[[Any], Any]]] = {
    "devices": DEVICE_KEYS, "policy": POLICY_KEYS, "limits": LIMIT_KEYS,
    "limits.users.*": LIMIT_ENTRY_KEYS, "limits.groups.*": LIMIT_ENTRY_KEYS,
    "sharing": SHARING_KEYS, "sharing.devices.*": SHARING_DEVICE_KEYS,
    "programs.*": {**POLICY_KEYS, **MEMORY_KEYS},
    **OPS_SECTIONS,
}
