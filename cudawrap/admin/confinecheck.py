"""What doctor says of [confine]: the mechanism that would confine runs here (or what is
missing), how a run's leftovers would be ended, Slurm's own confinement, and what the NVIDIA
driver publishes (its node parameters, whether MIG capabilities are device nodes at all).

Each finding is (level, message), for doctor's "confine" subject. The host check itself is
base/cgroup.usable, the one the service runs before it starts with runs = true.
"""
from __future__ import annotations

import os
from typing import Any, List, Mapping, Optional, Tuple

from ..base import cgroup
from ..devices import drivernodes
from ..confine.nodes import MODPROBE_LINE, driver_params, params_problem

NOT_SERVED = "no `cudawrap serve` runs for this install: [confine] does nothing here (only the service confines)"
NODE_PARAMS = ("DeviceFileUID", "DeviceFileGID", "DeviceFileMode", "ModifyDeviceFiles")

Finding = Tuple[str, str]


def slurm_constrains(environ: Mapping[str, str]) -> Optional[bool]:
    """Whether Slurm's cgroup.conf (beside $SLURM_CONF, else /etc/slurm) sets ConstrainDevices=yes;
    None where there is no cgroup.conf (no Slurm here)."""
    conf = os.path.join(os.path.dirname(environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")), "cgroup.conf")
    try:
        with open(conf) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    value = "no"
    for line in lines:
        key, _, rest = line.split("#", 1)[0].partition("=")
        if key.strip().lower() == "constraindevices":
            value = rest.strip().lower()
    return value in ("yes", "true", "1")


def _mechanism(config: Mapping[str, Any], served: bool) -> List[Finding]:
    runs = bool(config["runs"])
    try:
        mech = cgroup.usable(config["cgroup"])
    except OSError as e:
        why = f"cgroup = \"{config['cgroup']}\": runs cannot be confined here: {e.strerror or e}"
        return [("error" if runs else "note", why)]
    if isinstance(mech, cgroup.V2):
        how = f"cgroup v2 at {mech.mount}, a BPF device program on each run's cgroup"
        ends = ("cgroup.kill" if cgroup.kernel() >= cgroup.KILL_KERNEL else
                f"cgroup.freeze and a kill of each process (kernel {os.uname().release} has no cgroup.kill, 5.14)")
    else:
        how = f"cgroup v1 devices controller at {mech.devices}"
        ends = f"the v1 freezer at {mech.freezer} and a kill of each process"
    state = ("runs are confined" if runs and served else "runs = true: the service confines runs" if runs
             else "runs = false: runs would be confined")
    out = [("ok", f"{state} by the {how}; a run's leftovers are ended through {ends}")]
    if runs and cgroup.kernel() >= (6, 0) and not cgroup.favors_dynmods():
        out.append(("note", "moving a run into its cgroup can wait for an RCU grace period on each launch "
                            "(bench/RESULTS.md, cgroupmove): " + favor_dynmods_hint()))
    return out


def favor_dynmods_hint(mountinfo: str = cgroup.MOUNTINFO) -> str:
    """How to make the kernel favor cgroup moves (6.0+: the flag holds for every hierarchy). The
    v1 hierarchies refuse it at a remount; a cgroup2 mount (a hybrid host's too) takes it, until
    the next boot; the boot parameter (6.7+) keeps it."""
    unified = cgroup.mounts(mountinfo).get("unified")
    now = f"`mount -o remount,favordynmods {unified}` now, and " if unified else ""
    return f"{now}cgroup_favordynmods=true on the kernel command line (6.7 and newer) to keep it across boots"


def _driver(proc: str, leased: bool) -> List[Finding]:
    params = driver_params(proc)
    if params is None:
        return [("warning" if leased else "note",
                 f"no NVIDIA driver loaded (no {os.path.join(proc, 'driver/nvidia/params')}): its node parameters "
                 "not checked" + ("; nodes = \"leased\" closes the nodes there are, and must be checked again "
                                  "once the driver is loaded" if leased else ""))]
    shown = ", ".join(f"{k}={params[k]}" for k in NODE_PARAMS if k in params)
    problem = params_problem(params) if leased else None
    out = [("error", f"nodes = \"leased\", but {problem}: the service will not start; add `{MODPROBE_LINE}` "
                     "to /etc/modprobe.d/nvidia.conf and reload the driver") if problem else
           ("ok", f"the driver makes its nodes with {shown or 'no node parameters listed'}")]
    if drivernodes.mig_minors(proc) and drivernodes.char_major(drivernodes.CAPS_NAME, proc) is None:
        out.append(("warning", "MIG capabilities are exposed through /proc, not device nodes "
                               "(nv_cap_enable_devfs=0): no device filter can confine a MIG instance; load "
                               "nvidia with nv_cap_enable_devfs=1"))
    return out


def findings(config: Mapping[str, Any], served: bool, environ: Mapping[str, str]) -> List[Finding]:
    out: List[Finding] = [] if served else [("note", NOT_SERVED)]
    out += _mechanism(config, served)
    slurm = slurm_constrains(environ)
    if slurm is not None:
        out.append(("ok" if slurm else "warning",
                    "Slurm's ConstrainDevices=yes: Slurm confines its jobs' GPUs, and cudawrap leaves its "
                    "cgroups as Slurm made them" if slurm else
                    "Slurm's ConstrainDevices is off: Slurm jobs are not confined to their GPUs (cudawrap leaves "
                    "Slurm's cgroups as Slurm made them); set ConstrainDevices=yes in cgroup.conf"))
    if config["nodes"] == "leased":
        out.append(("note", "nodes = \"leased\": GPU nodes are root:root 0660, opened to each lessee by a POSIX "
                            "ACL entry while the service runs; while it is down, no user opens a GPU ("
                            + (", ".join(config["allow_users"]) + " and root excepted)" if config["allow_users"]
                               else "root excepted)")))
    return out + _driver(config["proc"], config["nodes"] == "leased")
