"""The [health] table: which XIDs drain a device, when it comes back, and what is done about
leftover processes and idle leases (docs/admin/health.md).

Kept apart from config.py so the XID catalog lives in one place; config.py only lists the table.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

# NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors): the XIDs whose recommended action
# is a GPU reset or a reboot (the device is unusable or untrustworthy until then) ...
DRAIN_XIDS: Tuple[int, ...] = (48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140)
# ... and those that are one application's fault (its own bad access, its own timeout):
# the device is fine for the next run.
IGNORE_XIDS: Tuple[int, ...] = (13, 31, 43, 45, 68, 69)

XID_NAMES: Dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup, due to previous errors",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure",
    68: "video processor exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
}

UNKNOWN_XID_RULES = ("drain", "ignore")
LEFTOVER_ACTIONS = ("report", "kill")
IDLE_ACTIONS = ("report", "notify")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:36] + "..."


def _xids(value: Any) -> Tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1000
                                              for v in value):
        raise ValueError(f"{_shown(value)} is not a list of XID numbers (1 to 999), e.g. [48, 79]")
    return tuple(sorted(set(value)))


def _seconds(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 30 * 86400:
        raise ValueError(f"{_shown(value)} is not a number of seconds from 0 to {30 * 86400}")
    return float(value)


def _minutes(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 7 * 1440:
        raise ValueError(f"{_shown(value)} is not a number of minutes above 0, at most {7 * 1440}")
    return float(value)


def health_keys(choice: Callable[[Tuple[str, ...]], Callable[[Any], str]]) -> Dict[str, Callable[[Any], Any]]:
    """The [health] keys and their parsers; CHOICE makes a one-of parser (config.py's)."""
    return {
        "drain_xids": _xids,
        "ignore_xids": _xids,
        "unknown_xid": choice(UNKNOWN_XID_RULES),
        "recover_after_s": _seconds,
        "leftover_action": choice(LEFTOVER_ACTIONS),
        "leftover_grace_s": _seconds,
        "idle_after_min": _minutes,
        "idle_action": choice(IDLE_ACTIONS),
    }

HEALTH_DEFAULTS: Dict[str, Any] = {
    "drain_xids": DRAIN_XIDS,
    "ignore_xids": IGNORE_XIDS,
    "unknown_xid": "drain",
    "recover_after_s": 300.0,
    "leftover_action": "report",
    "leftover_grace_s": 60.0,
    "idle_after_min": 30.0,
    "idle_action": "report",
}

HEALTH_DESCRIPTIONS: Dict[str, str] = {
    "drain_xids": "XIDs that drain their GPU until it is healthy again (NVIDIA's catalog: reset or reboot needed)",
    "ignore_xids": "XIDs that change nothing (an application's own error)",
    "unknown_xid": "an XID in neither list: drain or ignore (it is logged either way)",
    "recover_after_s": "seconds a health-drained GPU must stay clear of its condition before it is resumed",
    "leftover_action": "a leftover process of an ended run on a GPU: report, or kill it after leftover_grace_s",
    "leftover_grace_s": "seconds a leftover process may live before leftover_action = \"kill\" ends it",
    "idle_after_min": "minutes of 0 % utilisation and unchanged memory before a lease is shown IDLE",
    "idle_action": "an idle lease: report (status, metrics), or notify (an audit line naming its holder and a line on its terminal) too",
}
