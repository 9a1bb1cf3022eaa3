"""Narrowing by CUDA_VISIBLE_DEVICES and the allow-list, and placement, on known inventories."""
import pytest

from cudawrap.devices.model import Device, Gpu, Inventory
from cudawrap.sched.selection import allowed, parse_visible

G0, G1, G2 = "GPU-aaaa0000", "GPU-aaaa1111", "GPU-bbbb2222"
M20, M21 = "MIG-cccc0000", "MIG-cccc1111"


def inventory() -> Inventory:
    gpus = [Gpu(G0, 0, "H100", False), Gpu(G1, 1, "H100", False), Gpu(G2, 2, "A100", True)]
    devices = [
        Device(G0, "H100", G0, 0, None, 80000, 0, ()),
        Device(G1, "H100", G1, 1, None, 80000, 0, ()),
        Device(M20, "3g.40gb", G2, 2, 0, 40000, 0, ()),
        Device(M21, "3g.40gb", G2, 2, 2, 40000, 0, ()),
    ]
    return Inventory("570.86.10", gpus, devices)


@pytest.mark.parametrize("value, expected", [
    ("", []),
    ("0", [G0]),
    ("1,0", [G1, G0]),
    ("2", [M20, M21]),               # a MIG-mode GPU stands for its instances
    (G2, [M20, M21]),
    ("GPU-bbbb", [M20, M21]),        # unique prefix
    ("GPU-aaaa", []),                # ambiguous prefix ends the list at once
    (f"{M21}", [M21]),
    ("MIG-cccc1", []),               # MIG UUIDs only in full, as CUDA
    (f"0,bogus,{G1}", [G0]),         # the first invalid entry ends the list
    ("0,7,1", [G0]),                 # as does an index out of range
    ("0,0,1", [G0]),                 # and a repeated device
    (" 1 , 0 ", [G1, G0]),
    ("-1", []),
], ids=["empty", "index", "indices", "mig-index", "mig-parent", "prefix", "ambiguous",
        "mig-uuid", "mig-prefix", "invalid-stops", "out-of-range", "repeat", "blanks", "negative"])
def test_parse_visible(value, expected):
    assert [d.uuid for d in parse_visible(value, inventory())] == expected


@pytest.mark.parametrize("allow, expected", [
    ((), [G0, G1, M20, M21]),
    ((G1,), [G1]),
    ((G2,), [M20, M21]),             # a GPU entry admits its instances
    ((M21, "GPU-aaaa0"), [G0, M21]),
], ids=["empty-admits-all", "one-gpu", "gpu-admits-migs", "mixed"])
def test_allow_list(allow, expected):
    assert [d.uuid for d in allowed(inventory().devices, allow)] == expected
