"""Which devices a run may use: the admin's allow-list and the caller's CUDA_VISIBLE_DEVICES.

cudawrap only ever narrows. A caller who already set CUDA_VISIBLE_DEVICES (by hand, or
Slurm inside a job) gets a device from that set or none; the allow-list narrows further.
"""
from __future__ import annotations

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Callable, Iterable, List, Optional

from ..devices.model import Device, Inventory
from ..errors import ConfigError, UsageError

PCI_ORDER = "PCI_BUS_ID"  # CUDA_DEVICE_ORDER value under which CUDA's indices are NVML's


def by_prefix(prefix: str, uuids: Iterable[str]) -> Optional[str]:
    """The one UUID starting with PREFIX, or None if none or several do (as CUDA does)."""
    matches = [u for u in uuids if u.startswith(prefix)]
    if prefix in matches:
        return prefix
    return matches[0] if len(matches) == 1 else None


def _leaves_of(gpu_uuid: str, inventory: Inventory) -> List[Device]:
    return [d for d in inventory.devices if d.parent_uuid == gpu_uuid]


def indices_are_nvml(inventory: Inventory, device_order: Optional[str]) -> bool:
    """Whether CUDA's GPU index N is NVML's (nvidia-smi's) index N under CUDA_DEVICE_ORDER=DEVICE_ORDER.

    PCI_BUS_ID is NVML's order. Anything else is CUDA's default, FASTEST_FIRST: "fastest"
    by a heuristic CUDA does not document, ties broken by PCI bus id. On a machine whose
    GPUs are all one model (one NVML name) there is nothing to rank, so it is NVML's order
    too; on a mixed machine it cannot be computed from NVML, and cudawrap does not guess.
    """
    return device_order == PCI_ORDER or len({g.name for g in inventory.gpus}) <= 1


def _refuse_index(token: str, inventory: Inventory) -> UsageError:
    models = ", ".join(sorted({g.name for g in inventory.gpus}))
    return UsageError(
        f"CUDA_VISIBLE_DEVICES names GPU {token} by index, but this machine mixes GPU models ({models}) "
        f"and CUDA's default order (FASTEST_FIRST) is not nvidia-smi's: cudawrap cannot tell which GPU CUDA "
        f"would use", hint="name GPUs by UUID (`nvidia-smi -L`), or set CUDA_DEVICE_ORDER=PCI_BUS_ID")


def _legacy_mig(token: str, resolve: Optional[Callable[[str, int, int], Optional[str]]]) -> Optional[str]:
    """The MIG UUID that MIG-GPU-<uuid>/<gi>/<ci> (the pre-R470 spelling) names, or None."""
    parts = token[len("MIG-"):].split("/")
    if resolve is None or len(parts) != 3 or not all(p.isascii() and p.isdigit() and len(p) < 10
                                                     for p in parts[1:]):
        return None
    return resolve(parts[0], int(parts[1]), int(parts[2]))


def parse_visible(value: str, inventory: Inventory, device_order: Optional[str] = PCI_ORDER,
                  resolve_mig: Optional[Callable[[str, int, int], Optional[str]]] = None) -> List[Device]:
    """The devices a CUDA_VISIBLE_DEVICES value lets a program use, in its order.

    Entries are integer GPU indices (numbered as CUDA numbers them under
    CUDA_DEVICE_ORDER=DEVICE_ORDER: see indices_are_nvml; UsageError where that is unknown),
    ``GPU-<uuid>`` or a unique prefix, ``MIG-<uuid>`` in full, and ``MIG-GPU-<uuid>/<gi>/<ci>``
    where RESOLVE_MIG (GPU UUID, GI, CI -> MIG UUID, asked only then) is given. Like the CUDA
    runtime, the first invalid or repeated entry ends the list. A GPU in MIG mode stands for
    its instances.
    """
    out: List[Device] = []
    gpu_uuids = [g.uuid for g in inventory.gpus]
    mig_uuids = [d.uuid for d in inventory.devices if d.is_mig]
    known_order = indices_are_nvml(inventory, device_order)
    for token in value.split(","):
        token = token.strip()
        if token.isascii() and token.isdigit():  # CUDA reads ASCII digits only: "²", "٣" end the list
            index = int(token) if len(token) <= 9 else -1  # int() refuses 4300+ digits; no GPU has such an index
            if not known_order:
                raise _refuse_index(token, inventory)
            found = [g.uuid for g in inventory.gpus if g.index == index]
            gpu = found[0] if found else None
            chosen = _leaves_of(gpu, inventory) if gpu else []
        elif token.startswith("GPU-") and len(token) > len("GPU-"):  # a bare "GPU-" names nothing
            gpu = by_prefix(token, gpu_uuids)
            chosen = _leaves_of(gpu, inventory) if gpu else []
        elif token.startswith("MIG-"):
            # Full UUIDs only: CUDA takes no abbreviations of MIG UUIDs, and guessing
            # one here could widen what the caller allowed.
            if token.startswith("MIG-GPU-"):
                token = _legacy_mig(token, resolve_mig) or ""
            device = inventory.by_uuid(token) if token in mig_uuids else None
            chosen = [device] if device else []
        else:
            chosen = []
        if not chosen or any(d in out for d in chosen):
            break  # invalid or repeated: CUDA stops reading the list here
        out.extend(chosen)
    return out


def allowed(devices: Iterable[Device], allow: Iterable[str]) -> List[Device]:
    """DEVICES the allow-list admits; an empty list admits all.

    An entry is a UUID or a prefix of one; a GPU entry admits that GPU's MIG instances.
    """
    allow = tuple(allow)
    if not allow:
        return list(devices)
    return [d for d in devices
            if any(d.uuid.startswith(a) or d.parent_uuid.startswith(a) for a in allow)]


def read_allow_file(path: str) -> List[str]:
    """The getgpu ids format: one UUID a line; blank lines and # comments ignored."""
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the allowed-devices file: {exc.strerror}",
                          hint="fix allow_file in the config, or create the file") from None
    out = []
    for number, line in enumerate(raw.split(b"\n"), 1):
        text = line.split(b"#", 1)[0].strip()
        if not text:
            continue
        try:
            uuid = text.decode("ascii")
        except UnicodeDecodeError:
            uuid = ""
        if not (uuid.startswith("GPU-") or uuid.startswith("MIG-")) or not all(
                c.isalnum() or c == "-" for c in uuid):
            raise ConfigError(f"{path}:{number}: not a GPU-… or MIG-… UUID: {text[:60]!r}",
                              hint="one device UUID a line, as `nvidia-smi -L` prints them")
        out.append(uuid)
    if not out:
        # An empty allow file would otherwise mean "everything", the opposite of its intent.
        raise ConfigError(f"{path}: the allowed-devices file lists no device")
    return out
