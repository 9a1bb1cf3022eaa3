"""systemd units and the tmpfiles.d lines of an install, rendered from its layout."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, Tuple

from ..paths import Layout

# The monitor's loop runs below the grant path, in its own unit and inside the service alike:
# a hand-over (the service's decision, the run's exec) takes the CPU from one of its passes.
MONITOR_NICE = 5

UNIT_NAME = "cudawrap-sync.service"
MONITOR_UNIT = "cudawrap-monitor.service"
MPS_UNIT = "cudawrap-mps.service"
SERVICE_UNIT = "cudawrap.service"


def tmpfiles_file(layout: Layout) -> Path:
    return layout.root / "etc" / "tmpfiles.d" / "cudawrap.conf"


def unit_file(layout: Layout, name: str = UNIT_NAME) -> Path:
    return layout.root / "etc" / "systemd" / "system" / name


def unit_wants_link(layout: Layout, name: str = UNIT_NAME) -> Path:
    return layout.root / "etc" / "systemd" / "system" / "multi-user.target.wants" / name


def render_tmpfiles(layout: Layout) -> str:
    """systemd-tmpfiles lines recreating what ``prepare_runtime`` makes, at every boot."""
    owner = "root root" if layout.is_system else "- -"
    return (
        "# cudawrap's runtime area on /run (a tmpfs): recreated at every boot.\n"
        "# Written by cudawrap's install.sh; the modes match cudawrap.install.installation.prepare_runtime.\n"
        f"d {layout.runtime_dir} 0755 {owner} -\n"
        f"d {layout.lease_dir} 0755 {owner} -\n"
        f"d {layout.share_dir} 0755 {owner} -\n"
        "# sticky and world-writable like /tmp: everyone may queue, nobody may unqueue others\n"
        f"d {layout.queue_dir} 1777 {owner} -\n"
        f"f {layout.queue_lock} 0644 {owner} -\n"
    )


def _unit_command(layout: Layout) -> Tuple[str, str]:
    """The install's cudawrap command: its path, and as a unit's Exec line takes it."""
    cudawrap = str(layout.venv_dir / "bin" / "cudawrap")
    return cudawrap, f'"{cudawrap}"' if " " in cudawrap else cudawrap


def render_unit(layout: Layout) -> str:
    """The oneshot unit that runs ``cudawrap sync`` at boot, once the NVIDIA driver is up."""
    cudawrap, command = _unit_command(layout)
    return f"""\
# Written by cudawrap's install.sh (re-running it rewrites this file).
[Unit]
Description=cudawrap: lease files for the GPUs and MIG instances present at boot
# Ordering only, no Wants=: where nvidia-persistenced runs, sync after it has initialised
# the GPUs; where it does not, NVML loads the driver itself. Pulling the daemon in would
# start something the admin chose not to run.
After=nvidia-persistenced.service systemd-modules-load.service systemd-tmpfiles-setup.service
ConditionPathExists={cudawrap}

[Service]
Type=oneshot
RemainAfterExit=yes
# The install root is recorded in the virtual environment: no CUDAWRAP_ROOT needed.
ExecStart={command} sync
# 69: no NVIDIA driver. Wrapped programs then behave as the no_driver setting says; the
# warning is in the journal, and the boot is not marked as failed.
SuccessExitStatus=69

[Install]
WantedBy=multi-user.target
"""


def render_monitor_unit(layout: Layout) -> str:
    """The service that keeps the launch snapshot fresh, so launches need not load NVML."""
    cudawrap, command = _unit_command(layout)
    return f"""\
# Written by cudawrap's install.sh (re-running it rewrites this file).
[Unit]
Description=cudawrap: keep the launch snapshot fresh (launches skip NVML while it runs)
# Optional: without it every launch asks NVML itself, correctly but slower.
After={UNIT_NAME}
ConditionPathExists={cudawrap}

[Service]
ExecStart={command} monitor
Restart=always
RestartSec=5
Nice={MONITOR_NICE}

[Install]
WantedBy=multi-user.target
"""


def render_mps_unit(layout: Layout) -> str:
    """The oneshot unit that keeps an MPS control daemon per shared device ([sharing] mode = "mps")."""
    cudawrap, command = _unit_command(layout)
    return f"""\
# Written by cudawrap's install.sh (re-running it rewrites this file). install.sh enables it
# when the configuration says [sharing] mode = "mps"; otherwise it stays disabled.
[Unit]
Description=cudawrap: an NVIDIA MPS control daemon for each device shared through MPS
# The daemons are for the devices that have lease files, which sync makes.
After={UNIT_NAME}
ConditionPathExists={cudawrap}

[Service]
Type=oneshot
RemainAfterExit=yes
# The daemons stay in this unit's cgroup: stopping the unit ends whatever quit left.
ExecStart={command} mps start
# Each daemon refuses new clients and exits once its running clients are done.
ExecStop={command} mps stop

[Install]
WantedBy=multi-user.target
"""

def render_service_unit(layout: Layout) -> str:
    """`cudawrap serve`: the broker that grants leases by descriptor (docs/admin/service.md)."""
    cudawrap, command = _unit_command(layout)
    return f"""\
# Written by cudawrap's install.sh (re-running it rewrites this file).
[Unit]
Description=cudawrap: grant GPU leases through one socket (runs decide for themselves without it)
After={UNIT_NAME}
ConditionPathExists={cudawrap}

[Service]
ExecStart={command} serve
# Held leases survive a restart (their locks are the runs'); waiting runs decide for themselves
# until the socket answers again.
Restart=on-failure
RestartSec=1

[Install]
WantedBy=multi-user.target
"""


UNITS: Dict[str, Callable[[Layout], str]] = {UNIT_NAME: render_unit, MONITOR_UNIT: render_monitor_unit,
                                             MPS_UNIT: render_mps_unit, SERVICE_UNIT: render_service_unit}


def mps_mode(layout: Layout) -> bool:
    """Whether LAYOUT's configuration says [sharing] mode = "mps" (a broken one does not)."""
    from ..policy.config import load_config
    from ..errors import ConfigError

    try:
        return load_config(layout.config_file).sharing["mode"].value == "mps"
    except ConfigError:
        return False
