"""Laying out an install root: directories with their modes, the runtime area, the shim.

install.sh calls this (through the CLI) for a system install and for ``--prefix``; the
test suite calls it on a temporary root. One code path for all three.
"""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from .. import __version__
from ..paths import Layout

SHIM_TEMPLATE = "cudawrap-shim.in"
SHIM_STAMP = "# cudawrap shim, version "


# The wrapped programs' shims, rewritten: yields one line per program (cudawrap.admin.wrap.refresh_shims).
Refresh = Callable[[Layout], Iterable[str]]


def _template() -> str:
    # shims/ ships as the package cudawrap.shims (see pyproject.toml), installed or editable;
    # run straight from a source checkout (PYTHONPATH), it is shims/ beside the package.
    try:
        from .. import shims
    except ImportError:
        where = Path(__file__).resolve().parents[2] / "shims"  # cudawrap/install/ -> the checkout
    else:
        where = Path(shims.__file__).parent
    return (where / SHIM_TEMPLATE).read_text(encoding="utf-8")


def _import_dirs() -> List[str]:
    """sys.path entries the shim needs: where cudawrap and pynvml are importable from."""
    import pynvml

    dirs = []
    # cudawrap/install/installation.py -> the directory that holds the package cudawrap
    for module_dir in (str(Path(__file__).resolve().parents[2]), str(Path(pynvml.__file__).resolve().parent)):
        if module_dir not in dirs:
            dirs.append(module_dir)
    return dirs


def render_shim(layout: Layout, python: str = sys.executable, link: Optional[str] = None) -> str:
    """The shim prototype, or with LINK the own shim of the program wrapped there."""
    text = _template()
    for key, value in (("@PYTHON@", python), ("@VERSION@", __version__),
                       ("@SYSPATH@", repr(_import_dirs())), ("@ROOT@", repr(str(layout.root))),
                       ("@LINK@", repr(link))):
        text = text.replace(key, value)
    return text


def shim_version(path: Path) -> str:
    """The version stamped into an installed shim, or "" if it is not one of ours."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(400)
    except OSError:
        return ""
    for line in head.splitlines():
        if line.startswith(SHIM_STAMP):
            return line[len(SHIM_STAMP):].split(". ", 1)[0].rstrip(".")
    return ""


def _write_shim(path: Path, text: str) -> bool:
    """Write a shim atomically if it differs; True if it changed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except (OSError, UnicodeDecodeError):
        pass
    tmp = path.with_name(f".new.{os.getpid()}.{path.name[-16:]}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)  # a running launch keeps the old file; a new one gets the new
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return True


def install_shim(layout: Layout, python: str = sys.executable) -> bool:
    """Write the shim prototype if it differs; True if it changed."""
    return _write_shim(layout.shim, render_shim(layout, python))


def shim_python(layout: Layout) -> str:
    """The interpreter install.sh baked into the prototype (this one if there is none)."""
    try:
        with open(layout.shim, "rb") as f:
            first = f.readline(4096).decode("utf-8", "surrogateescape")
    except OSError:
        return sys.executable
    words = first[2:].split() if first.startswith("#!") and shim_version(layout.shim) else []
    return words[0] if words else sys.executable


def install_program_shim(layout: Layout, link: str) -> bool:
    """Write the own shim of the program wrapped at LINK (its interpreter: the prototype's)."""
    layout.shim_dir.mkdir(parents=True, exist_ok=True)
    return _write_shim(layout.program_shim(link), render_shim(layout, shim_python(layout), link))


def _dir(path: Path, mode: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def prepare_runtime(layout: Layout) -> None:
    """The tmpfs part (/run/cudawrap): lease, slot and queue directories and the queue lock."""
    _dir(layout.runtime_dir, 0o755)
    _dir(layout.lease_dir, 0o755)
    _dir(layout.share_dir, 0o755)
    # Sticky and world-writable like /tmp: everyone may queue, nobody may unqueue others.
    _dir(layout.queue_dir, 0o1777)
    fd = os.open(layout.queue_lock, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    os.fchmod(fd, 0o644)
    os.close(fd)


def prepare(layout: Layout, python: str = sys.executable) -> None:
    """Every directory of an install root, the runtime area and the shim."""
    _dir(layout.etc_dir, 0o755)
    _dir(layout.state_dir, 0o755)
    prepare_runtime(layout)
    install_shim(layout, python)
    _dir(layout.shim_dir, 0o755)


def prepare_package(layout: Layout, python: str, refresh: Refresh) -> None:
    """The .deb's postinst: prepare, then the wrapped programs' own shims (an upgrade, or
    programs handed over by `install.sh --uninstall --keep-wraps`)."""
    prepare(layout, python)
    refresh_program_shims(layout, _package_say, refresh)


def _package_say(line: str) -> None:
    """A step or warning of the .deb's maintainer scripts, which speak as `cudawrap:`."""
    if line.startswith("==> "):
        print(f"cudawrap: {line[4:]}", flush=True)
    else:
        print(line.replace(f"{PROG}: ", "cudawrap: ", 1), file=sys.stderr, flush=True)


# --- install.sh's second half -----------------------------------------------------------
#
# install.sh makes the virtual environment and pip-installs the package into it, then runs
# ``python -m cudawrap.install.installation install`` from that environment for everything else,
# and ``... uninstall`` to take it all away again. Everything created is recorded in a
# manifest in the state directory, so an uninstall removes exactly what an install made.

MANIFEST_NAME = "install-manifest.json"
MANIFEST_VERSION = 1
UNIT_NAME = "cudawrap-sync.service"
MONITOR_UNIT = "cudawrap-monitor.service"
MPS_UNIT = "cudawrap-mps.service"
SERVICE_UNIT = "cudawrap.service"
COMPLETION_SOURCE = "packaging/cudawrap.bash-completion"
COMMANDS = ("cudawrap", "create-cudawrap")
PROG = "install.sh"

# Kinds of manifest entry and what an uninstall does with each.
DIR = "dir"  # removed when empty
TREE = "tree"  # removed with everything in it (venv, state and runtime directories only)
FILE = "file"  # removed
LINK = "link"  # removed while it still points where we pointed it
CONFFILE = "conffile"  # removed unless edited since (its sha256 differs), like dpkg's conffiles


def _say(line: str) -> None:
    """One step on stdout (a warning on stderr), flushed to stay in order with the commands run."""
    print(line, file=sys.stderr if line.startswith(f"{PROG}: ") else sys.stdout, flush=True)


class InstallError(Exception):
    """One line for install.sh to print; the exit code it should return."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def manifest_file(layout: Layout) -> Path:
    return layout.state_dir / MANIFEST_NAME


def tmpfiles_file(layout: Layout) -> Path:
    return layout.root / "etc" / "tmpfiles.d" / "cudawrap.conf"


def unit_file(layout: Layout, name: str = UNIT_NAME) -> Path:
    return layout.root / "etc" / "systemd" / "system" / name


def unit_wants_link(layout: Layout, name: str = UNIT_NAME) -> Path:
    return layout.root / "etc" / "systemd" / "system" / "multi-user.target.wants" / name


def wheel_dir(layout: Layout) -> Path:
    """Where the client wheel lies for users to pip-install (root/opt/cudawrap/wheels)."""
    return layout.lib_dir / "wheels"


def completion_file(layout: Layout) -> Path:
    return layout.root / "etc" / "bash_completion.d" / "cudawrap"


def command_links(layout: Layout) -> Dict[Path, Path]:
    """bin_dir/NAME -> the venv's console script, for each command put on PATH."""
    return {layout.bin_dir / name: layout.venv_dir / "bin" / name for name in COMMANDS}


def sha256_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


class Manifest:
    """What install.sh created under one root, in creation order (paths are absolute)."""

    def __init__(self, root: Path, entries: Optional[List[Dict[str, str]]] = None) -> None:
        self.root = root
        self.entries: List[Dict[str, str]] = list(entries or [])

    def get(self, path: Path) -> Optional[Dict[str, str]]:
        for entry in self.entries:
            if entry["path"] == str(path):
                return entry
        return None

    def add(self, kind: str, path: Path, **extra: str) -> None:
        """Record PATH (the first record of a path wins: it says what was there before us)."""
        if self.get(path) is None:
            self.entries.append({"kind": kind, "path": str(path), **extra})

    def replace(self, kind: str, path: Path, **extra: str) -> None:
        """Record PATH anew (a file written again, whose old record is out of date)."""
        self.entries = [e for e in self.entries if e["path"] != str(path)]
        self.add(kind, path, **extra)

    @classmethod
    def load(cls, layout: Layout) -> Optional["Manifest"]:
        import json

        path = manifest_file(layout)
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise InstallError(f"{path}: cannot read the install manifest ({exc}); remove what "
                               f"cudawrap installed by hand") from None
        if not isinstance(doc, dict) or doc.get("version") != MANIFEST_VERSION or \
                not isinstance(doc.get("entries"), list):
            raise InstallError(f"{path}: not an install manifest this install.sh can read")
        if doc.get("root") != str(layout.root):
            raise InstallError(f"{path}: it records an install into {doc.get('root')}, not {layout.root}")
        return cls(layout.root, [e for e in doc["entries"] if isinstance(e, dict) and "path" in e])

    def save(self, layout: Layout) -> None:
        import json

        path = manifest_file(layout)
        doc = {"version": MANIFEST_VERSION, "root": str(self.root), "cudawrap_version": __version__,
               "entries": self.entries}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)


def missing_dirs(path: Path) -> List[Path]:
    """PATH and those of its ancestors that do not exist yet, outermost first."""
    out: List[Path] = []
    while not os.path.lexists(path) and path != path.parent:
        out.append(path)
        path = path.parent
    return out[::-1]


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
Nice=5

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
    """`cudawrap serve`: the broker that grants leases by descriptor (README "The cudawrap service")."""
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


def _write_text(path: Path, text: str, mode: int = 0o644) -> bool:
    """Write PATH atomically if its text differs; True if it changed."""
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.chmod(tmp, mode)
    os.replace(tmp, path)
    return True


def systemd_running(layout: Layout) -> bool:
    return layout.is_system and os.path.isdir("/run/systemd/system")


def _systemctl(*args: str) -> Optional[str]:
    """Run systemctl; None when it worked, else its complaint in one line."""
    import shutil
    import subprocess

    exe = shutil.which("systemctl")
    if exe is None:
        return "systemctl not found"
    done = subprocess.run([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        return " ".join(done.stdout.split())[:300] or f"exit {done.returncode}"
    return None


def check_command_links(layout: Layout) -> None:
    for link, target in command_links(layout).items():
        if os.path.lexists(link) and not (link.is_symlink() and os.readlink(link) == str(target)):
            raise InstallError(f"{link} exists and is not cudawrap's link to {target}: move it "
                               f"aside, then run install.sh again", 73)


def install(layout: Layout, python: str, source: Optional[Path], created: List[Path],
            say: Callable[[str], None] = _say, wheel: Optional[Path] = None, build: str = "", *,
            man_pages: Mapping[Path, str], refresh: Refresh) -> None:
    """Everything after pip: the install root, config, boot files, commands on PATH.

    CREATED are the directories install.sh made for the virtual environment. MAN_PAGES
    (path -> text) and REFRESH (the wrapped programs' shims, rewritten) come from the
    layers above, which own the CLI definitions and the wraps. Idempotent:
    a re-run (an upgrade) refreshes the shim and the boot files and keeps the config.
    """
    check_command_links(layout)
    manifest = Manifest.load(layout) or Manifest(layout.root)
    upgrade = bool(manifest.entries)
    for path in created:
        if path != layout.venv_dir:
            manifest.add(DIR, path)
    manifest.add(TREE, layout.venv_dir)
    try:
        _install(layout, python, source, manifest, say, man_pages, refresh)
        if build:
            write_build(layout, build)
            say(f"==> build: {build} (`cudawrap --version` and `cudawrap doctor` show it)")
        if wheel is not None:
            _install_wheel(layout, wheel, manifest, say)
    finally:
        if layout.state_dir.is_dir():
            manifest.save(layout)
    say(f"==> {'upgraded' if upgrade else 'installed'} cudawrap {__version__} in {layout.root}")


def refresh_program_shims(layout: Layout, say: Callable[[str], None], refresh: Refresh) -> None:
    """An upgrade: each wrapped program's own shim, rewritten for this version by REFRESH."""
    from ..errors import CudawrapError

    try:
        for done in refresh(layout):
            say(f"==> {done}")
    except (CudawrapError, OSError) as exc:
        why = exc.message if isinstance(exc, CudawrapError) else exc.strerror
        say(f"{PROG}: warning: the wrapped programs' shims were not refreshed ({why}); "
            "run `cudawrap doctor --repair` once that is fixed")


def write_build(layout: Layout, build: str) -> None:
    """Record which build this install is (the source's commit, the date) in its venv."""
    from ..paths import BUILD_MARKER

    _write_text(layout.venv_dir / BUILD_MARKER, build.strip() + "\n")


def _install(layout: Layout, python: str, source: Optional[Path], manifest: Manifest,
             say: Callable[[str], None], man_pages: Mapping[Path, str], refresh: Refresh) -> None:
    from ..policy.defaults import render_config
    from ..paths import ROOT_MARKER

    (layout.venv_dir / ROOT_MARKER).write_text(f"{layout.root}\n", encoding="utf-8")
    trees = (layout.state_dir, layout.runtime_dir)
    for target in (layout.etc_dir, layout.state_dir, layout.runtime_dir, layout.shim.parent, layout.shim_dir):
        for path in missing_dirs(target):
            manifest.add(TREE if path in trees else DIR, path)
    shim_existed = layout.shim.exists()
    prepare(layout, python)
    if not shim_existed:
        manifest.add(FILE, layout.shim)
    say(f"==> shim {layout.shim} (interpreter {python}, version {shim_version(layout.shim)})")
    refresh_program_shims(layout, say, refresh)

    config = layout.config_file
    if os.path.lexists(config):
        say(f"==> kept the configuration {config}")
    else:
        _write_text(config, render_config())
        manifest.replace(CONFFILE, config, sha256=sha256_of(config))
        say(f"==> wrote the default configuration {config} (every setting, commented out)")

    files: List[Tuple[Path, str, str]] = [
        (tmpfiles_file(layout), render_tmpfiles(layout), "runtime directory at boot (systemd-tmpfiles)"),
    ] + [(unit_file(layout, name), render(layout), f"unit {name}") for name, render in UNITS.items()]
    files += [(path, text, f"man page {path.name}") for path, text in man_pages.items()]
    completion = source / COMPLETION_SOURCE if source else None
    if completion is not None and completion.is_file():
        files.append((completion_file(layout), completion.read_text(encoding="utf-8"), "bash completion"))
    else:
        say(f"install.sh: warning: no {COMPLETION_SOURCE} in the source; bash completion not installed")
    for path, text, what in files:
        for parent in missing_dirs(path.parent):
            manifest.add(DIR, parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(path):
            manifest.add(FILE, path)
        _write_text(path, text)
        say(f"==> {what}: {path}")

    for parent in missing_dirs(layout.bin_dir):
        manifest.add(DIR, parent)
    layout.bin_dir.mkdir(parents=True, exist_ok=True)
    for link, target in command_links(layout).items():
        if not os.path.lexists(link):
            link.symlink_to(target)
            manifest.add(LINK, link, target=str(target))
        say(f"==> command {link} -> {target}")

    mps = mps_mode(layout)
    if systemd_running(layout):
        enable = [(UNIT_NAME, "`cudawrap sync` runs at every boot"),
                  (MONITOR_UNIT, "`cudawrap monitor` keeps launches off NVML")]
        if mps:
            enable.append((MPS_UNIT, "an MPS control daemon runs for each shared device"))
        elif unit_wants_link(layout, MPS_UNIT).is_symlink():
            say(f"{PROG}: warning: {MPS_UNIT} is enabled but [sharing] mode is not \"mps\": "
                f"`systemctl disable --now {MPS_UNIT}` stops its daemons")
        else:
            say(f"==> {MPS_UNIT} not enabled: [sharing] mode is not \"mps\" (once it is: "
                f"`systemctl enable --now {MPS_UNIT}`)")
        say(f"==> {SERVICE_UNIT} not enabled (optional, README \"The cudawrap service\"): "
            f"`systemctl enable --now {SERVICE_UNIT}` starts it")
        for name, started in enable:
            # Not the MPS unit --now: its daemons are for the lease files, which the `cudawrap sync`
            # after this makes; install.sh starts the unit after that.
            now = ["--now"] if name == MONITOR_UNIT else []
            problem = _systemctl("daemon-reload") or _systemctl("enable", *now, name)
            if name == MONITOR_UNIT and not problem:
                problem = _systemctl("restart", name)  # an upgrade must run the new code
            if problem:
                say(f"install.sh: warning: could not enable {name}: {problem}")
                continue
            if unit_wants_link(layout, name).is_symlink():
                manifest.add(LINK, unit_wants_link(layout, name),
                             target=os.readlink(unit_wants_link(layout, name)))
            say(f"==> enabled {name}: {started}")
    elif layout.is_system:
        say(f"==> {UNIT_NAME} not enabled: systemd is not running here; run `cudawrap sync` "
            f"after every boot (the runtime directory is on /run)")
        say(f"==> {MONITOR_UNIT} not enabled: systemd is not running here; start `cudawrap monitor` "
            f"some other way if launches should skip NVML")
        if mps:
            say(f"==> {MPS_UNIT} not enabled: systemd is not running here; run `cudawrap mps start` "
                f"after every boot")
    else:
        say(f"==> {UNIT_NAME} not enabled (a --prefix install); run `cudawrap sync` after a reboot "
            f"or a MIG change")
        say(f"==> {MONITOR_UNIT} not enabled (a --prefix install); run `cudawrap monitor` yourself "
            f"if launches should skip NVML")
        if mps:
            say(f"==> {MPS_UNIT} not enabled (a --prefix install); run `cudawrap mps start` yourself")


def _install_wheel(layout: Layout, wheel: Path, manifest: Manifest, say: Callable[[str], None]) -> None:
    """Put WHEEL in wheel_dir, in place of the wheels of earlier versions."""
    import shutil

    target = wheel_dir(layout)
    for parent in missing_dirs(target):
        manifest.add(DIR, parent)
    _dir(target, 0o755)
    for old in target.glob("cudawrap-*.whl"):
        if old.name != wheel.name:
            old.unlink()
            manifest.entries = [e for e in manifest.entries if e["path"] != str(old)]
    dest = target / wheel.name
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    shutil.copyfile(wheel, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, dest)
    manifest.add(FILE, dest)
    say(f"==> client wheel for users' own environments: {dest} (pip install it; see README)")


def _wrapped(layout: Layout, environ: Dict[str, str]) -> List[str]:
    """The links of the wrapped programs, as `cudawrap list --json` reports them."""
    import json
    import subprocess

    done = subprocess.run([str(layout.venv_dir / "bin" / "cudawrap"), "list", "--json"], env=environ,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise InstallError(f"cannot list the wrapped programs: {last}", done.returncode or 1)
    return [row["link"] for row in json.loads(done.stdout)]


def stop_monitor(layout: Layout, say: Callable[[str], None] = _say, why: str = "") -> None:
    """Stop a `cudawrap monitor --daemon` and a `cudawrap serve --daemon` of LAYOUT (the monitor
    would recreate the runtime area, the service keep its socket there), and say so."""
    from .. import locations as loc
    from ..base.daemon import stop

    for command, where in (("monitor", loc.MONITOR_PID), ("serve", loc.SERVICE_PID)):
        pid_file = loc.under(str(layout.root), where)
        try:
            pid = stop(pid_file)
        except OSError as exc:  # it will not exit, its pid is unreadable, or it is not ours to signal
            raise InstallError(f"cannot stop `cudawrap {command} --daemon` ({pid_file}): {exc.strerror or exc}; "
                               f"stop it yourself, then run this again", 75) from None
        if pid is not None:
            say(f"==> stopped `cudawrap {command} --daemon` (pid {pid}){why}")


# What --keep-wraps leaves for the Debian package, which takes over the same layout.
def _handed_over(layout: Layout) -> List[Path]:
    return [layout.state_dir, layout.runtime_dir, layout.config_file, layout.shim]


def uninstall(layout: Layout, unwrap_all: bool, say: Callable[[str], None] = _say,
              keep_wraps: bool = False) -> None:
    """Remove what the manifest records; refuse while programs are wrapped (unless UNWRAP_ALL).

    KEEP_WRAPS is the move to the Debian package: the wrapped programs, their shims, the
    registry and state, the configuration and the runtime area (the leases of running
    programs) stay for the package, which installs the same layout.
    """
    import shutil
    import subprocess

    manifest = Manifest.load(layout)
    if manifest is None:
        raise InstallError(f"no install manifest {manifest_file(layout)}: cudawrap was not installed "
                           f"in {layout.root} by install.sh", 66)
    environ = dict(os.environ, CUDAWRAP_ROOT=str(layout.root))
    wrapped = _wrapped(layout, environ)
    if wrapped and not (unwrap_all or keep_wraps):
        raise InstallError(
            f"{len(wrapped)} program(s) still wrapped: {', '.join(wrapped)}; unwrap them with install.sh "
            f"--uninstall --unwrap-all, or, moving to the Debian package, keep them for it with "
            f"install.sh --uninstall --keep-wraps", 65)
    # Before anything is removed, so that a monitor that will not stop leaves all as it was.
    stop_monitor(layout, say, " (once the package is installed, start it again where systemd does not run)"
                 if keep_wraps else "")
    if wrapped and unwrap_all:
        say(f"==> unwrapping {len(wrapped)} program(s)")
        done = subprocess.run([str(layout.venv_dir / "bin" / "cudawrap"), "unwrap", "--all"], env=environ)
        left = _wrapped(layout, environ)
        if done.returncode != 0 or left:
            raise InstallError(f"`cudawrap unwrap --all` failed (exit {done.returncode}); nothing else was "
                               f"removed: fix what it says, or `cudawrap unwrap --force` what is left",
                               done.returncode or 65)

    for name in UNITS:
        if unit_file(layout, name).exists() and systemd_running(layout):
            problem = _systemctl("disable", "--now", name)
            if problem:
                say(f"install.sh: warning: could not disable {name}: {problem}")
            else:
                say(f"==> disabled {name}")
    if layout.mps_dir.is_dir() and os.listdir(layout.mps_dir):
        # Daemons started by hand, or without systemd: their pipe directories are about to go.
        done = subprocess.run([str(layout.venv_dir / "bin" / "cudawrap"), "mps", "stop"], env=environ)
        if done.returncode != 0:
            say(f"install.sh: warning: `cudawrap mps stop` failed (exit {done.returncode}); "
                f"MPS control daemons may still run")

    allowed_trees = {str(layout.venv_dir), str(layout.state_dir), str(layout.runtime_dir)}
    root = str(layout.root).rstrip("/") + "/"
    kept = {str(p) for p in _handed_over(layout)} if keep_wraps else set()

    def remove(entry: Dict[str, str]) -> None:
        kind, path = entry.get("kind"), Path(entry["path"])
        if str(path) in kept:
            return
        if not (str(path).startswith(root) or str(path) == str(layout.root)):
            say(f"install.sh: warning: {path} is outside {layout.root}; left alone")
            return
        if kind == TREE and str(path) in allowed_trees:
            if path.is_symlink() or path.is_file():
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
            else:
                return
            say(f"==> removed {path}/")
        elif kind == LINK:
            if path.is_symlink() and os.readlink(path) == entry.get("target"):
                path.unlink()
                say(f"==> removed {path}")
        elif kind == CONFFILE:
            if not os.path.lexists(path):
                return
            if path.is_file() and not path.is_symlink() and sha256_of(path) == entry.get("sha256"):
                path.unlink()
                say(f"==> removed {path}")
            else:
                say(f"==> kept {path}: it was edited after install (remove it yourself if it is no "
                    f"longer needed)")
        elif kind == FILE:
            if os.path.lexists(path) and not path.is_dir():
                path.unlink()
                say(f"==> removed {path}")
        elif kind == DIR:
            try:
                path.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                if path != layout.root:
                    say(f"==> kept {path}/: not empty")

    entries = manifest.entries
    dirs = sorted((e for e in entries if e.get("kind") == DIR), key=lambda e: -e["path"].count("/"))
    others = [e for e in entries if e.get("kind") != DIR]
    # The venv goes last: this very interpreter runs from it.
    others.sort(key=lambda e: e["path"] == str(layout.venv_dir))
    for entry in others:
        remove(entry)
    if os.path.lexists(manifest_file(layout)):
        manifest_file(layout).unlink()
    for entry in dirs:
        remove(entry)
    if systemd_running(layout):
        _systemctl("daemon-reload")
    if not keep_wraps:
        say(f"==> removed cudawrap from {layout.root}")
        return
    say(f"==> removed install.sh's cudawrap from {layout.root}, keeping for the Debian package: the wrapped "
        f"programs and their shims ({layout.shim_dir}), {layout.state_dir} (registry, drains, ledger), "
        f"{layout.config_file} and {layout.runtime_dir} (the leases of running programs)")
    say("==> wrapped programs cannot start until the package is installed: now run "
        "`sudo apt-get install ./cudawrap_VERSION_all.deb` (or `sudo ./install.sh` to go back)")
