"""Where things live below the install root, as plain relative strings.

The shim runs on every launch and cannot afford pathlib or dataclasses (together ~30 ms
of imports), so the relative layout is kept here with no imports at all; ``paths.Layout``
builds its ``Path`` properties from the same table so the two can never disagree.
"""

# Prefix of the real program's new name, as in the original seed scripts.
REAL_PREFIX = "CUDAWRAP_"

# Not files but where a run finds its lease: the marker a granted program inherits, so a
# wrapped program that starts another wrapped program reuses its lease instead of deadlocking
# on its own lock ("fd:uuid,fd:uuid:slotfd"); and beside it the wrapped name the shim ran the
# program as, which survives the program's own execs (`exec python3 worker.py`), so status
# and the ledger name the run as users know it.
LEASE_ENV = "CUDAWRAP_LEASE"
PROGRAM_ENV = "CUDAWRAP_PROGRAM"

CONFIG_FILE = "etc/cudawrap/config.toml"
STATE_DIR = "var/lib/cudawrap"
REGISTRY_FILE = STATE_DIR + "/registry.json"
REGISTRY_LOCK = STATE_DIR + "/registry.lock"
# Which way this install runs, "service" or "daemonless" (paths.recorded_way): root's, written
# by install.sh, the .deb and `cudawrap way`; read by sync, the general launch and doctor.
WAY_FILE = STATE_DIR + "/way"
# `cudawrap drain` (drains.py); the shim checks it exists before importing drains.
DRAINS = STATE_DIR + "/drains"
RUNTIME_DIR = "run/cudawrap"
LEASE_DIR = RUNTIME_DIR + "/leases"
QUEUE_DIR = RUNTIME_DIR + "/queue"
QUEUE_LOCK = RUNTIME_DIR + "/queue.lock"
# Slot files of shared devices, <uuid>.<k> (sharing.py); MPS daemons' pipe directories.
SHARE_DIR = RUNTIME_DIR + "/shares"
MPS_DIR = RUNTIME_DIR + "/mps"
LOG_DIR = "var/log/cudawrap"
MPS_LOG_DIR = LOG_DIR + "/mps"
# Derived state written by root (sync, wrap, unwrap, the monitor) for the shim's fast path.
LAUNCH_CACHE = RUNTIME_DIR + "/launch.cache"
USAGE_SNAPSHOT = RUNTIME_DIR + "/usage.snapshot"
INVENTORY_CACHE = RUNTIME_DIR + "/inventory.cache"
# `cudawrap monitor --daemon` (installs without systemd): its flock-held pid file and log.
MONITOR_PID = RUNTIME_DIR + "/monitor.pid"
MONITOR_LOG = RUNTIME_DIR + "/monitor.log"
# Held by whichever monitor loop runs (the service's, the cudawrap-monitor unit's, --daemon):
# one at a time, the next takes over when it stops.
MONITOR_LOCK = RUNTIME_DIR + "/monitor.lock"
# `cudawrap serve`: the service's socket (every user connects), pid file and log (--daemon).
SERVICE_SOCKET = RUNTIME_DIR + "/cudawrap.sock"
SERVICE_PID = RUNTIME_DIR + "/service.pid"
SERVICE_LOG = RUNTIME_DIR + "/service.log"
# Held by the live service: while it is, the ledger's grants of seen_by "service" are its own
# to end (a look by the monitor or a root command leaves them open).
SERVICE_LOCK = RUNTIME_DIR + "/service.lock"
# Its key for reconnect tickets (root's, 0600) and how many runs waited in it (service/tickets.py).
SERVICE_KEY = STATE_DIR + "/service.key"
SERVICE_WAITERS = RUNTIME_DIR + "/service.waiters"
LIB_DIR = "opt/cudawrap"
# The shim prototype: install.sh bakes the interpreter into it, and links made by cudawrap
# before each program had its own shim still lead to it.
SHIM = LIB_DIR + "/bin/cudawrap-shim"
# Where a shim's run waits for the service without its interpreter (shims/cudawrap-wait.c),
# built at install where a C compiler is found; without it the shim waits itself.
WAITER = LIB_DIR + "/bin/cudawrap-wait"
# One shim file per wrapped program (as pyenv gives each name its own): a deploy that copies
# a new build through one program's link overwrites that program's shim and no other.
SHIM_DIR = LIB_DIR + "/shims"


# Machine-wide, not below an install root: which install manages each device (claims.py).
CLAIMS_DIR = "/run/cudawrap-devices"


def under(root: str, rel: str) -> str:
    """ROOT joined with a relative location from this module."""
    return root.rstrip("/") + "/" + rel


# The two ways an install runs (docs/admin/ways.md): its service grants every lease, or
# each run decides for itself.
SERVICE, DAEMONLESS = "service", "daemonless"
WAYS = (SERVICE, DAEMONLESS)


def recorded_way(root: str) -> "str | None":
    """The way the install at ROOT runs, as its WAY_FILE says; None where none is recorded
    (an install from before the file, until an upgrade or `cudawrap sync` records it). It
    lies in the state directory, which only the install's owner writes. One open and one
    read (posix, loaded already: no import): the general launch asks this of each run."""
    import posix

    try:
        fd = posix.open(under(root, WAY_FILE), posix.O_RDONLY | posix.O_NOFOLLOW | posix.O_CLOEXEC)
    except OSError:
        return None
    try:
        text = posix.read(fd, 64).decode("ascii", "replace").strip()
    finally:
        posix.close(fd)
    return text if text in WAYS else None
