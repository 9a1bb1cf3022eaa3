"""The devices a run may be given before it waits, and the bounds it waits under.

Narrowed once per launch (the allow-list, CUDA_VISIBLE_DEVICES, the filters that never
change, the lease files sync made) and checked against the admin's drains and the caller's
[limits]; what changes while a run waits (usage, drains, others' leases) the acquirer
judges at every decision. On the shim's path: each rule's module is imported only when
that rule is set.
"""


TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, List, Optional

    from ..lease.files import LeaseFiles

from .. import locations as loc
from ..base.posixos import exists
from ..errors import NoDeviceError


def allow_list(value: "Dict[str, Any]") -> "List[str]":
    """The allow-list of VALUE, the run's settings: its entries and its allow_file's."""
    allow = list(value["allow"])
    if value["allow_file"]:
        from .selection import read_allow_file

        allow += read_allow_file(value["allow_file"])
    return allow


def usable(inventory: "Any", value: "Dict[str, Any]", allow: "List[str]", preset: "Optional[str]",
          count: int, order: "Optional[str]" = None) -> "List[Any]":
    """The devices of INVENTORY this run may be given; NoDeviceError if fewer than COUNT.

    Narrowed by the allow-list, CUDA_VISIBLE_DEVICES (read in ORDER, as CUDA will) and the
    filters that can never change (model, memory in all); free memory and utilisation
    change as jobs end, and the scheduler judges them at every decision.
    """
    from ..policy.effective import filtered

    candidates = list(inventory.devices)
    if allow:
        from .selection import allowed

        candidates = allowed(candidates, allow)
    if preset is not None:
        from ..devices import nvml
        from .selection import parse_visible

        visible = parse_visible(preset, inventory, order, nvml.mig_by_ids)
        candidates = [d for d in candidates if d in visible]
    why = " (narrowed by CUDA_VISIBLE_DEVICES)" if preset is not None else (
        " (narrowed by the allow-list)" if allow else "")
    if filtered(value) and candidates:
        from .filters import Request, explain, split

        request = Request.from_settings(value, count)
        kept, _why_not = split(request, candidates, inventory)
        if len(kept) < count:
            raise NoDeviceError(explain(request, candidates, inventory),
                                hint="`cudawrap status` lists the devices; `cudawrap config` the filters")
        candidates = kept
    if count > 1 and not inventory.multi_mig and any(d.is_mig for d in candidates):
        if value["multi_mig"] == "refuse":
            raise NoDeviceError(
                f"{count} devices asked for, but with driver {inventory.driver_version} a process "
                f"can use only one MIG instance",
                hint="ask for one device, or an admin may set multi_mig = \"whole-gpus\"")
        candidates = [d for d in candidates if not d.is_mig]
    if len(candidates) < count:
        raise NoDeviceError(
            f"{count} device{'s' if count > 1 else ''} asked for, but only "
            f"{len(candidates)} can be used here{why}",
            hint="`cudawrap status` lists the devices")
    return candidates


def drains(root: str) -> "Dict[str, Any]":
    """The admin's drains (uuid -> Drain); drains.py is imported only when there are some."""
    if not exists(loc.under(root, loc.DRAINS)):
        return {}
    from .drains import drained

    return drained(root)


def check_drained(root: str, candidates: "List[Any]", count: int) -> None:
    """NoDeviceError (at once, naming the drains and their reasons) where fewer than COUNT of
    CANDIDATES are left undrained by an admin (`cudawrap drain`). The drained ones stay
    candidates: the acquirer leaves them out at every decision, re-reading the drains, so a
    `cudawrap resume` while the run waits gives it the device resumed."""
    admin = drains(root)
    if not admin:
        return
    from .drains import covering, undrained

    kept = undrained(candidates, admin)
    if len(kept) >= count:
        return
    out = [d for d in candidates if d not in kept]
    # Each drain's reason once (a GPU's covers its MIG instances), as `status` shows it.
    reasons = list(dict.fromkeys(admin[covering(admin, d.uuid, d.parent_uuid) or d.uuid].reason for d in out))
    why = f" ({'; '.join(r for r in reasons if r)})" if any(reasons) else ""
    raise NoDeviceError(f"{count} device{'s' if count > 1 else ''} asked for, but "
                        f"{', '.join(d.uuid for d in out)} {'is' if len(out) == 1 else 'are'} drained by an "
                        f"admin{why} and only {len(kept)} can be used now",
                        hint="`cudawrap status` says why and since when; try again after `cudawrap resume`")


def limits_of(value: "Dict[str, Any]", count: int, uid: int) -> "Dict[str, Any]":
    """The [limits] table, or {} when none is configured (limits.py is not imported then);
    NoDeviceError if COUNT is over UID's own limit."""
    limits = value.get("limits") or {}
    if not (limits.get("users") or limits.get("groups") or limits.get("default", (0, ""))[0]):
        return {}
    from ..policy.limits import limit_for

    my_limit = limit_for(uid, limits)
    if my_limit and count > my_limit:
        raise NoDeviceError(f"{count} devices asked for, but your limit is {my_limit} at once",
                            hint="ask for fewer devices, or ask an admin (`cudawrap config` shows the limits)")
    return limits


def synced(candidates: "List[Any]", leases: "LeaseFiles", lease_dir: str, count: int) -> "List[Any]":
    """CANDIDATES that have a lease file.

    A device without one (appeared since the last sync) can never be leased: left out rather
    than waited for forever. One listing: the files are opened only as their devices are tried."""
    present = leases.names()
    unsynced = [d for d in candidates if d.uuid not in present]
    if len(candidates) - len(unsynced) < count:
        from ..errors import SetupError
        from ..lease.files import SYNC_HINT

        raise SetupError(f"{len(unsynced)} of the usable devices have no lease file in {lease_dir}",
                         hint=SYNC_HINT)
    return [d for d in candidates if d not in unsynced]


def drained_now(root: str, inventory: "Any") -> "Any":
    """The acquirer's view of the drains, re-read at every decision: a drain made while runs wait."""
    def now() -> "Any":
        admin = drains(root)
        if not admin:
            return ()
        from .drains import covering

        return {d.uuid for d in inventory.devices if covering(admin, d.uuid, d.parent_uuid)}
    return now
