"""How devices are shared by shared runs: slots per device, the mode, what a share costs.

A device with N slots (``[sharing] slots``, ``[sharing.devices."UUID or prefix"]``) takes
up to N shared runs at once, or one exclusive run. A share is held with two flocks, both
released by the kernel like a whole lease: a shared lock on the device's lease file (so an
exclusive run, which needs the exclusive lock, cannot start there) and the exclusive lock on
one of the device's N slot files (so there are never more than N sharers). Root creates the
slot files with the lease files (``cudawrap sync``).

Imported on the launch path: no imports beyond the standard library's cheapest.
"""

TYPE_CHECKING = False  # `import typing` costs ~10 ms on the shim's path
if TYPE_CHECKING:
    from typing import Any, Dict, Mapping, Optional, Tuple

from .. import locations as loc

TIME_SLICING = "time-slicing"
MPS = "mps"
MPS_PID_FILE = "nvidia-cuda-mps-control.pid"  # the control daemon's, in its pipe directory
MPS_COMM = b"nvidia-cuda-mps"  # /proc/PID/comm of nvidia-cuda-mps-control (cut at 15 bytes)


def slot_path(root: str, uuid: str, slot: int) -> str:
    return f"{loc.under(root, loc.SHARE_DIR)}/{uuid}.{slot}"


def mps_pipe_dir(root: str, uuid: str) -> str:
    """The pipe directory of the MPS control daemon for UUID: one daemon per device, so MPS's
    one-user-at-a-time rule is per device, as cudawrap schedules it."""
    return f"{loc.under(root, loc.MPS_DIR)}/{uuid}"


def mps_daemon(root: str, uuid: str, owner: int) -> "Optional[int]":
    """The pid of the MPS control daemon `cudawrap mps start` runs for UUID, or None.

    Named by the pid file the daemon writes in UUID's pipe directory (OWNER's: the install's
    owner); it counts only if that process is OWNER's too and runs nvidia-cuda-mps-control.
    NVIDIA's daemon makes the file writable by everyone (`cudawrap mps start` takes that
    away), and a daemon that died leaves it behind, its pid free for anyone's process: a pid
    a user wrote there, or reused, names none of OWNER's MPS control daemons, whose only
    children are their MPS servers. A process's name is believed only for OWNER's processes:
    no one else can start those."""
    import posix

    try:
        fd = posix.open(f"{mps_pipe_dir(root, uuid)}/{MPS_PID_FILE}", posix.O_RDONLY | posix.O_NOFOLLOW | posix.O_CLOEXEC)
    except OSError:
        return None
    try:
        owned = posix.fstat(fd).st_uid == owner
        text = posix.read(fd, 32).strip()
    except OSError:
        return None
    finally:
        posix.close(fd)
    if not (owned and text.isdigit()):
        return None
    try:
        with open(f"/proc/{int(text)}/status", "rb") as f:
            fields = dict(line.partition(b":")[::2] for line in f.read(2048).splitlines())
    except OSError:
        return None
    # The real and effective uids (status's): a process that made itself non-dumpable has
    # its /proc/PID owned by root.
    uids = fields.get(b"Uid", b"").split()[:2]
    ours = fields.get(b"Name", b"").strip().startswith(MPS_COMM) and uids == [str(owner).encode()] * 2
    return int(text) if ours else None


def mps_log_dir(root: str, uuid: str) -> str:
    return f"{loc.under(root, loc.MPS_LOG_DIR)}/{uuid}"


def settings(root: str) -> "Mapping[str, Any]":
    """The [sharing] table the policy compiled for the install at ROOT (key -> (value, source)).

    For root's commands (sync, the monitor's ledger, doctor, status, mps); a run takes it from
    its own policy. Raises ConfigError for a broken config.
    """
    from ..policy.effective import effective

    return effective(root, None, environ={}).sharing


def configured(root: str) -> "Sharing":
    return Sharing(settings(root))


class Sharing:
    """The [sharing] settings of one run (from the policy: key -> (value, source))."""

    def __init__(self, data: "Optional[Mapping[str, Any]]" = None) -> None:
        data = data or {}

        def value(key: str, default: "Any") -> "Any":
            return data[key][0] if key in data else default

        self.slots: int = value("slots", 1)
        self.mode: str = value("mode", TIME_SLICING)
        self.thread_percentage: "Optional[int]" = value("thread_percentage", None)
        self.memory_limit_mib: "Optional[int]" = value("memory_limit_mib", None)
        self.counts_as: "Optional[float]" = value("counts_as", None)
        # Longest prefix first: the most specific entry wins.
        self.devices: "Tuple[Tuple[str, int], ...]" = tuple(sorted(
            ((name, v[0]) for name, v in (data.get("devices") or {}).items()),
            key=lambda item: -len(item[0])))
        # [sharing.devices."UUID"] memory keys, longest prefix first (plain values).
        self.device_memory: "Tuple[Tuple[str, Mapping[str, Any]], ...]" = tuple(sorted(
            value("device_memory", {}).items(), key=lambda item: -len(item[0])))

    def slots_for(self, uuid: str, parent: "Optional[str]" = None) -> int:
        """Slots of the device UUID (a MIG instance also matches by its GPU's UUID)."""
        for name, slots in self.devices:
            if uuid.startswith(name) or (parent and parent.startswith(name)):
                return slots
        return self.slots

    @property
    def anywhere(self) -> bool:
        """Whether any device can be shared at all."""
        return self.slots > 1 or any(slots > 1 for _name, slots in self.devices)

    def cost(self, slots: int) -> float:
        """What one share of a device with SLOTS slots counts as towards a user's limit."""
        if slots <= 1:
            return 1.0
        return self.counts_as if self.counts_as is not None else 1.0 / slots

    def limit_mib(self, uuid: str, parent: "Optional[str]", slots: int, memory_total_mib: "Optional[int]",
                  program_limit: "Optional[int]" = None) -> int:
        """The memory one share of UUID may use, MiB (0: no limit): the program's
        memory_limit_mib, else its device's ([sharing.devices], longest prefix), else
        [sharing]'s, else the device's memory over its SLOTS. The monitor enforces the same."""
        if program_limit is not None:
            return program_limit
        for name, table in self.device_memory:
            if "memory_limit_mib" in table and (uuid.startswith(name) or (parent and parent.startswith(name))):
                return table["memory_limit_mib"]
        if self.memory_limit_mib is not None:
            return self.memory_limit_mib
        return memory_total_mib // slots if memory_total_mib else 0

    def mps_env(self, root: str, uuid: str, slots: int, memory_total_mib: "Optional[int]",
                limit: "Optional[int]" = None) -> "Dict[bytes, bytes]":
        """The variables that make a shared run an MPS client of its device's daemon, with
        its share of the SMs and of the memory (LIMIT MiB, by default limit_mib's). The run
        sees one device, CUDA's device 0."""
        env = {b"CUDA_MPS_PIPE_DIRECTORY": mps_pipe_dir(root, uuid).encode(),
               b"CUDA_MPS_LOG_DIRECTORY": mps_log_dir(root, uuid).encode()}
        percentage = self.thread_percentage or max(1, 100 // slots)
        env[b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percentage).encode()
        if limit is None:
            limit = self.limit_mib(uuid, None, slots, memory_total_mib)
        if limit:
            env[b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={limit}M".encode()
        return env


    def run_env(self, root: str, shared: "Any", current: "Mapping[str, Any]", slots: "Mapping[str, int]",
                asked_mib: "Optional[int]") -> "Tuple[Dict[bytes, bytes], Optional[Dict[bytes, bytes]]]":
        """A run sharing the devices SHARED (CURRENT: uuid -> Device; SLOTS: uuid -> its
        slots; ASKED_MIB: the run's memory_limit_mib): (MPS's variables, the frameworks'
        memory defaults, or None when no device's memory is limited)."""
        extra: "Dict[bytes, bytes]" = {}
        fractions = []
        for uuid in shared:
            device = current[uuid]
            total = device.memory_total_mib or None
            limit = self.limit_mib(uuid, device.parent_uuid, slots[uuid], total, asked_mib)
            if limit and total:
                fractions.append(min(limit / total, 1.0))
            if self.mode == MPS:
                extra = self.mps_env(root, uuid, slots[uuid], total, limit)
        return extra, framework_env(min(fractions)) if fractions else None


def of_run(value: "Mapping[str, Any]", count: int) -> "Tuple[Sharing, bool]":
    """(the sharing policy in VALUE, the run's settings; whether this run of COUNT devices shares)."""
    sharing = Sharing(value.get("sharing"))
    share = bool(value.get("share")) and sharing.anywhere
    if share and sharing.mode == MPS and count > 1:
        from ..errors import NoDeviceError

        raise NoDeviceError(f"{count} devices asked for as a shared run, but an MPS client uses one device",
                            hint="ask for one device (CUDAWRAP_GPUS=1), or run without sharing")
    return sharing, share


def framework_env(fraction: float) -> "Dict[bytes, bytes]":
    """What tells the frameworks a shared run's allowance, FRACTION of its device's memory: JAX
    preallocates that much instead of 75 %, TensorFlow grows as it needs instead of taking all.
    Defaults only: a value the user set wins (Grant.defaults)."""
    # Rounded down: a fraction a hair above the share would be ended for its last megabytes.
    return {b"XLA_PYTHON_CLIENT_MEM_FRACTION": f"{int(fraction * 100) / 100:.2f}".encode(),
            b"TF_FORCE_GPU_ALLOW_GROWTH": b"true"}
