"""The configuration's values: one parser per kind of value, each returning the value or
raising ValueError with a one-line reason (the caller adds the file, line and key).

Shared by the TOML file (config.py), the registry, the CLI's switches and the environment.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, List, Tuple

FOREVER = math.inf

# The longest wait anyone can ask for in seconds; beyond it "forever" is the honest word
# (and setitimer overflows somewhere above 2**31).
MAX_WAIT_S = 10 * 365 * 86400
MAX_GPUS = 64


def shown(value: Any) -> str:
    """VALUE for a one-line message: its repr, cut short (it may be 100 kB of environment)."""
    try:
        text = repr(value)
    except ValueError:  # an integer of more digits than Python will print
        return "a number that long"
    return text if len(text) <= 40 else text[:36] + "..."


def parse_wait(value: Any) -> float:
    """A wait limit: seconds (int, float or numeric string) >= 0, or "forever"."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("forever", "inf", "infinity", "none"):
            return FOREVER
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{shown(value)} is not a number of seconds or 'forever'") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{shown(value)} is not a number of seconds or 'forever'")
    # Not math.isnan(value) on an int: TOML integers are unbounded and float() overflows.
    if (isinstance(value, float) and math.isnan(value)) or value < 0:
        raise ValueError(f"{shown(value)} is not a number of seconds >= 0")
    if value > MAX_WAIT_S:
        return FOREVER
    return float(value)


def parse_gpus(value: Any) -> int:
    """A device count per run: an integer from 1 to MAX_GPUS."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{shown(value)} is not a whole number of devices")
    if not 1 <= value <= MAX_GPUS:
        raise ValueError(f"{shown(value)} is not between 1 and {MAX_GPUS}")
    return value


def choice(choices: Tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{shown(value)} is not one of {', '.join(choices)}")
        return value

    parse.choices = choices  # type: ignore[attr-defined]  # for shell completion
    return parse


def non_negative_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{shown(value)} is not a whole number >= 0")
    return value


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{shown(value)} is not true or false")
    return value


def uuid_list(value: Any) -> Tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError("expected a list of device UUID strings")
    bad = [v for v in value if not re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", v.strip())]
    if bad:
        raise ValueError(f"{shown(bad[0])} is not a GPU-… or MIG-… UUID (or prefix)")
    return tuple(v.strip() for v in value)


def whole_number(low: int, high: int, what: str) -> Callable[[Any], int]:
    """A parser of whole numbers from LOW to HIGH; WHAT says what one is, for its message."""
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{shown(value)} is not {what}")
        return value
    return parse


# The most runs one device can be shared by: MPS serves at most 48 clients per device on
# Volta and later, and time slices thinner than that leave each run next to nothing.
MAX_SLOTS = 48

percent = whole_number(0, 100, "a whole percentage from 0 to 100")
share_percentage = whole_number(1, 100, "a whole percentage from 1 to 100")
mib = whole_number(1, 1 << 20, f"a whole number of MiB from 1 to {1 << 20}")
memory_limit = whole_number(0, 1 << 24, f"a whole number of MiB from 0 (no limit) to {1 << 24}")
connections = whole_number(1, 1 << 16, f"a whole number from 1 to {1 << 16}")
slots = whole_number(1, MAX_SLOTS, f"a whole number of slots from 1 (no sharing) to {MAX_SLOTS}")


def parse_model(value: Any) -> str:
    """A model filter: words each found, case-insensitively, in the product name ("" = any)."""
    if not isinstance(value, str) or len(value) > 200 or not value.isprintable():
        raise ValueError(f"{shown(value)} is not a model name such as \"H100\" or \"A100 1g.10gb\"")
    return " ".join(value.split())


def parse_devices(value: Any) -> Tuple[Any, ...]:
    """Devices to choose among: GPU-/MIG- UUIDs or prefixes, and NVML indices (nvidia-smi's)."""
    if isinstance(value, str):  # the environment's and the switches' comma list
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list):
        raise ValueError(f"{shown(value)} is not a list of device UUIDs and indices")
    out: List[Any] = []
    for item in value:
        if isinstance(item, str) and item.isascii() and item.isdigit() and len(item) <= 4:
            item = int(item)
        if isinstance(item, int) and not isinstance(item, bool) and 0 <= item <= 9999:
            out.append(item)
        elif isinstance(item, str) and re.fullmatch(r"(GPU|MIG)-[0-9A-Za-z-]+", item.strip()):
            out.append(item.strip())
        else:
            raise ValueError(f"{shown(item)} is not a GPU-… or MIG-… UUID (or prefix) or an index")
    return tuple(out)


def path_or_empty(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{shown(value)} is not a path string")
    if value and not value.startswith("/"):
        raise ValueError(f"{shown(value)} is not an absolute path")
    return value


def absolute_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"{shown(value)} is not an absolute path")
    return value


# POSIX's portable user names (and the dollar of Samba's machine accounts), as useradd takes them.
_ACCOUNT = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?")


def account_list(value: Any) -> Tuple[str, ...]:
    """Account names; whether each exists is asked where they are used (they may come later)."""
    if not isinstance(value, list):
        raise ValueError(f"{shown(value)} is not a list of account names")
    for item in value:
        if not isinstance(item, str) or not _ACCOUNT.fullmatch(item):
            raise ValueError(f"{shown(item)} is not an account name")
    return tuple(value)


def fraction(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{shown(value)} is not a fraction of a device above 0 and at most 1")
    return float(value)


def seconds(zero_ok: bool) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not (number and (0 <= value if zero_ok else 0 < value) and value <= 86400):  # NaN fails too
            raise ValueError(f"{shown(value)} is not a number of seconds {'from 0' if zero_ok else 'above 0'} "
                             f"to 86400")
        return float(value)
    return parse


def format_wait(value: float) -> str:
    return "forever" if value == FOREVER else f"{value:g}"
