"""Which devices a request may be given: model, memory, utilisation and device filters.

Pure functions over one inventory, with two kinds of reason a device fails:

* *static*: it can never satisfy the request (another model, too little memory in all,
  not among the devices chosen). The launch path drops these devices from the
  candidates, and a request that too few devices can ever satisfy fails at once.
* *waiting*: it cannot now (too little memory free, too busy) and may later, as jobs end.
  Whoever waits re-checks these with fresh readings.

Every message about filters is built here from the same reasons, so what a refusal says
is what the filters did. Imported on the shim's path: no typing, no dataclasses.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

    from ..devices.model import Device, Inventory

from ..policy.effective import FILTER_KEYS, UNFILTERED, filtered  # kept in policy: a launch without filters skips this module


class Request:
    """COUNT devices, each passing every filter; immutable (a value, like a frozen dataclass)."""

    __slots__ = ("count",) + FILTER_KEYS

    def __init__(self, count: int = 1, devices: Sequence[Any] = (), model: str = "",
                 min_memory_mib: int = 0, min_free_memory_mib: int = 0,
                 max_utilization: int = 100) -> None:
        put = object.__setattr__
        put(self, "count", count)
        put(self, "devices", tuple(devices))
        put(self, "model", model)
        put(self, "min_memory_mib", min_memory_mib)
        put(self, "min_free_memory_mib", min_free_memory_mib)
        put(self, "max_utilization", max_utilization)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any], count: Optional[int] = None) -> Request:
        """The request a run makes under VALUES (key -> value, the policy in force)."""
        kwargs = {k: values.get(k, UNFILTERED[k]) for k in FILTER_KEYS}
        return cls(values.get("gpus", 1) if count is None else count, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Request cannot be changed; make a new one")

    def _key(self) -> tuple:
        return (self.count,) + tuple(getattr(self, k) for k in FILTER_KEYS)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Request) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={getattr(self, k)!r}" for k in FILTER_KEYS
                          if getattr(self, k) != UNFILTERED[k])
        return f"Request(count={self.count}{', ' if shown else ''}{shown})"

    @property
    def filtered(self) -> bool:
        """Whether any filter is set (without one, every device passes)."""
        return filtered({k: getattr(self, k) for k in FILTER_KEYS})

    def describe(self) -> str:
        """The filters in words, for "waiting for …" lines: "model 'H100', 30000 MiB free"."""
        parts = []
        if self.devices:
            parts.append(f"one of {_devices_text(self.devices)}")
        if self.model:
            parts.append(f"model {self.model!r}")
        if self.min_memory_mib:
            parts.append(f"{self.min_memory_mib} MiB in all")
        if self.min_free_memory_mib:
            parts.append(f"{self.min_free_memory_mib} MiB free")
        if self.max_utilization < 100:
            parts.append(f"at most {self.max_utilization} % busy")
        return ", ".join(parts)


def product(device: Device, inventory: Inventory) -> str:
    """The name the model filter searches: a GPU's product name; for a MIG instance its
    GPU's name, "MIG" and its profile, as NVML names the instance itself."""
    if not device.is_mig:
        return device.name
    for gpu in inventory.gpus:
        if gpu.uuid == device.parent_uuid:
            return f"{gpu.name} MIG {device.name}"
    return device.name


def model_matches(model: str, name: str) -> bool:
    """Every word of MODEL is in NAME, ignoring case ("h100", "A100 1g.10gb")."""
    low = name.lower()
    return all(word in low for word in model.lower().split())


def chosen(entries: Sequence[Any], device: Device) -> bool:
    """Whether DEVICE is among ENTRIES: UUIDs or prefixes (a GPU's admits its MIG
    instances, as in the allow-list) and NVML indices (nvidia-smi's) of physical GPUs."""
    for entry in entries:
        if isinstance(entry, int):
            if device.gpu_index == entry:
                return True
        elif device.uuid.startswith(entry) or device.parent_uuid.startswith(entry):
            return True
    return False


def static_key(request: Request, device: Device, inventory: Inventory) -> Optional[str]:
    """The first filter DEVICE can never pass, or None."""
    if request.devices and not chosen(request.devices, device):
        return "devices"
    if request.model and not model_matches(request.model, product(device, inventory)):
        return "model"
    if device.memory_total_mib < request.min_memory_mib:
        return "min_memory_mib"
    # Free memory can never exceed the total: no wait will make such a device fit.
    if device.memory_total_mib < request.min_free_memory_mib:
        return "min_free_memory_mib"
    return None


def waiting_key(request: Request, device: Device) -> Optional[str]:
    """The first filter DEVICE fails now by its readings (free memory, utilisation), or None.

    A utilisation NVML does not report (MIG instances, GPUs in MIG mode) excludes nothing.
    """
    if device.memory_total_mib - device.memory_used_mib < request.min_free_memory_mib:
        return "min_free_memory_mib"
    utilization = device.utilization
    if utilization is not None and utilization > request.max_utilization:
        return "max_utilization"
    return None


def static_reason(request: Request, device: Device, inventory: Inventory) -> Optional[str]:
    """Why DEVICE can never satisfy REQUEST, in words; None if it may."""
    key = static_key(request, device, inventory)
    return None if key is None else _reason(key, request, device, inventory, static=True)


def waiting_reason(request: Request, device: Device, inventory: Inventory) -> Optional[str]:
    """Why DEVICE cannot satisfy REQUEST now, in words; None if it can."""
    key = waiting_key(request, device)
    return None if key is None else _reason(key, request, device, inventory, static=False)


def passes(request: Request, device: Device, inventory: Inventory) -> Optional[str]:
    """None if DEVICE satisfies every filter of REQUEST now; otherwise why not, in words."""
    return static_reason(request, device, inventory) or waiting_reason(request, device, inventory)


def label(device: Device, inventory: Inventory) -> str:
    """A short name for people: "H100 80GB HBM3", "A100-SXM4-80GB MIG 1g.10gb"."""
    name = product(device, inventory)
    return name[len("NVIDIA "):] if name.startswith("NVIDIA ") else name


def _devices_text(entries: Sequence[Any]) -> str:
    return "[" + ", ".join(str(e) for e in entries) + "]"


def _reason(key: str, request: Request, device: Device, inventory: Inventory, static: bool) -> str:
    if key == "devices":
        return f"not among devices {_devices_text(request.devices)}"
    if key == "model":
        return f"model {request.model!r} does not match {product(device, inventory)}"
    total = device.memory_total_mib
    if key == "min_memory_mib":
        return f"{total} MiB in all, below min_memory_mib = {request.min_memory_mib}"
    if key == "min_free_memory_mib" and static:
        return f"{total} MiB in all can never leave min_free_memory_mib = {request.min_free_memory_mib} free"
    if key == "min_free_memory_mib":
        free = total - device.memory_used_mib
        return f"{free} MiB free, below min_free_memory_mib = {request.min_free_memory_mib}"
    return f"{device.utilization} % busy, above max_utilization = {request.max_utilization}"


def _grouped(devices: Sequence[Device], inventory: Inventory) -> str:
    """"H100 80GB HBM3 ×2, A100-SXM4-80GB MIG 1g.10gb ×7", in order of first appearance."""
    counts: Dict[str, int] = {}
    for device in devices:
        name = label(device, inventory)
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(name if n == 1 else f"{name} ×{n}" for name, n in counts.items())


def _clause(key: str, request: Request, excluded: List[Device], everything: bool,
            inventory: Inventory) -> str:
    what = _grouped(excluded, inventory)
    if key == "devices":
        return f"devices {_devices_text(request.devices)} leave out {what}"
    if key == "model":
        verb = "matches none of" if everything else "leaves out"
        return f"model {request.model!r} {verb} {what}"
    sizes = sorted({d.memory_total_mib for d in excluded})
    size = f"{sizes[0]} MiB" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} MiB"
    if key == "min_memory_mib":
        return f"min_memory_mib = {request.min_memory_mib} leaves out {what} ({size} in all)"
    return f"min_free_memory_mib = {request.min_free_memory_mib} leaves out {what} ({size} in all)"


def explain(request: Request, considered: Sequence[Device], inventory: Inventory) -> str:
    """One line saying why fewer than REQUEST.count of CONSIDERED can ever satisfy REQUEST:

    "no device here can ever satisfy this request: model 'A6000' matches none of
    H100 80GB HBM3 ×2, A100-SXM4-80GB MIG 1g.10gb ×7".
    """
    by_key: Dict[str, List[Device]] = {}
    fit = 0
    for device in considered:
        key = static_key(request, device, inventory)
        if key is None:
            fit += 1
        else:
            by_key.setdefault(key, []).append(device)
    clauses = [_clause(k, request, by_key[k], len(by_key[k]) == len(considered), inventory)
               for k in FILTER_KEYS if k in by_key]
    if fit == 0:
        head = "no device here can ever satisfy this request"
    else:
        asked = f"{request.count} devices" if request.count > 1 else "1 device"
        head = f"{asked} asked for, but only {fit} can ever satisfy the filters"
    return head + (": " + "; ".join(clauses) if clauses else "")


def split(request: Request, devices: Sequence[Device],
          inventory: Inventory) -> Tuple[List[Device], Dict[str, str]]:
    """(the DEVICES that may ever satisfy REQUEST, uuid -> why not for the others)."""
    kept: List[Device] = []
    why: Dict[str, str] = {}
    for device in devices:
        reason = static_reason(request, device, inventory)
        if reason is None:
            kept.append(device)
        else:
            why[device.uuid] = reason
    return kept, why
