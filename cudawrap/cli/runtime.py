"""`cudawrap sync`, `cudawrap status` and `cudawrap run`: the commands about devices and leases."""
from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, List, Optional

from plumbum import cli

from .. import launch, original_environ
from ..launch import CVD, Grant, exec_program
from ..policy import effective as policy
from ..policy.config import parse_gpus, parse_wait
from ..errors import NvmlUnavailable, ProgramNotFound, UsageError
from ..paths import Layout, default_layout
from ..ops.status import machine_status
from .app import Command, require_install
from .filterswitches import FilterSwitches


class SyncCommand(Command):
    """Create the runtime directory, a lease file per current device, and the launch cache (root)."""

    quiet = cli.Flag(["-q", "--quiet"], help="print nothing when there is nothing to say")

    def main(self) -> int:
        from ..base.privilege import require_admin
        from ..ops.sync import sync

        layout = default_layout()
        require_admin(layout, "create lease files")
        report = sync(layout)
        _record(layout, "cudawrap sync")
        for line in report.lines:
            if not self.quiet or line.startswith("warning"):
                print(line)
        return os.EX_UNAVAILABLE if report.nvml_error else 0


class MonitorCommand(Command):
    """Keep the launch snapshot fresh so launches skip NVML (root; the cudawrap-monitor service)."""

    once = cli.Flag(["--once"], help="write one snapshot and exit")
    period = cli.SwitchAttr(["--period"], float, default=0.5, help="seconds between snapshots")
    daemon = cli.Flag(["--daemon"], excludes=["--once"],
                      help="run in the background (installs without systemd); pid file and log "
                           "in the runtime directory; stop it with kill")

    def main(self) -> int:
        from ..monitor.loop import refresh_once, run
        from ..base.privilege import require_admin

        layout = default_layout()
        require_admin(layout, "run the monitor")
        if not 0.05 <= self.period <= 60:
            raise UsageError(f"--period {self.period}: choose between 0.05 and 60 seconds")
        if not self.once:
            from ..monitor.metrics import refuse_unsafe_textfile

            refuse_unsafe_textfile(layout)
        if self.daemon:
            self._detach(layout)
        elif self.once:
            error = refresh_once(layout)
            if error:
                print(f"cudawrap monitor: {error}", file=sys.stderr)
                return os.EX_UNAVAILABLE
            return 0
        run(layout, self.period)
        return 0

    @staticmethod
    def _detach(layout: Layout) -> None:
        """Go to the background (only the daemon returns); refuse a second monitor."""
        from .. import locations as loc
        from ..base.daemon import AlreadyRunning, detach
        from ..errors import SetupError
        from ..lease.files import SYNC_HINT

        root = str(layout.root)
        if not layout.runtime_dir.is_dir():
            raise SetupError(f"the runtime directory {layout.runtime_dir} is missing", hint=SYNC_HINT)
        pid_file = loc.under(root, loc.MONITOR_PID)
        try:
            detach(pid_file, loc.under(root, loc.MONITOR_LOG))
        except AlreadyRunning as exc:
            raise UsageError(f"a monitor is already running (pid {exc.pid}, pid file {pid_file})",
                           hint=f"stop it with: kill $(cat {pid_file})") from None


class StatusCommand(Command):
    """Every device with its lease holder, other processes and memory; then who is waiting."""

    USAGE = "    {progname} [--json] [--watch [SECONDS] [--count N]]\n"

    as_json = cli.Flag(["--json"], help="machine-readable output (with --watch: one line per refresh)")
    watch = cli.Flag(["-w", "--watch"], help="refresh every SECONDS (default 2) until Ctrl-C")
    count = cli.SwitchAttr(["--count"], str, argname="N", help="with --watch: stop after N refreshes")
    terminal: Optional[bool] = None  # whether the output goes to a terminal (--watch draws into a buffer)

    def main(self, *seconds: str) -> int:
        if not self.watch:
            if seconds or self.count is not None:
                raise UsageError(f"{_shown(seconds[0]) if seconds else '--count'}: only with --watch",
                                 hint="cudawrap status --watch [SECONDS] [--count N]")
            return self.show()
        from ..ops.status import parse_watch

        try:
            period, count = parse_watch(seconds, self.count)
        except ValueError as exc:
            raise UsageError(f"--watch: {exc}", hint="cudawrap status --watch [SECONDS] [--count N]") from None
        return _watch(self, period, count)

    def show(self) -> int:
        from ..ops.status import render

        layout = default_layout()
        require_install(layout)
        _record(layout, "cudawrap status")
        status = machine_status(layout)
        if self.as_json:
            print(json.dumps(status, indent=None if self.watch else 2))  # nvml_error says when there is no driver
            _config_usable(layout)
            return 0
        for line in render(status, cut=sys.stdout.isatty() if self.terminal is None else self.terminal):
            print(line)
        _config_usable(layout)
        if status["nvml_error"]:
            # The devices are unknown: the table shows at most the lease files of the last sync.
            raise NvmlUnavailable(f"cannot list the devices: {status['nvml_error']}",
                                  "install or load the NVIDIA driver (`nvidia-smi` should work), then run "
                                  "`cudawrap sync`")
        return 0


def _config_usable(layout: Layout) -> None:
    """ConfigError (78) where the config cannot be used: every run exits 78 on it, so status,
    having shown the leases (the locks stand whatever the config says), does not exit 0."""
    from ..policy.config import load_config

    load_config(layout.config_file)


def _watch(command: StatusCommand, period: float, count: Optional[int]) -> int:
    """Show the status every PERIOD seconds, COUNT times (None: until Ctrl-C).

    On a terminal each refresh is drawn over the last (cursor home, clear to the end);
    otherwise, and with --json, refreshes follow one another, as `watch` would log them.
    """
    import io
    import time
    from contextlib import redirect_stdout

    command.terminal = sys.stdout.isatty()
    in_place = command.terminal and not command.as_json
    shown = 0
    try:
        while True:
            frame = io.StringIO()
            with redirect_stdout(frame):
                command.show()
            text = frame.getvalue()
            if in_place:
                head = f"every {period:g} s, {time.strftime('%H:%M:%S')}; Ctrl-C to stop"
                lines = [head, ""] + text.splitlines()
                sys.stdout.write("\x1b[H" + "".join(line + "\x1b[K\n" for line in lines) + "\x1b[J")
            else:
                sys.stdout.write(text if command.as_json or shown == 0 else "\n" + text)
            sys.stdout.flush()
            shown += 1
            if count is not None and shown >= count:
                return 0
            time.sleep(period)
    except KeyboardInterrupt:  # the way out of a watch, not a failure
        return 0


def _record(layout, seen_by: str) -> None:  # type: ignore[no-untyped-def]
    """As root, record in the ledger what changed since the last look (the monitor may not run)."""
    from ..ledger.looks import look

    obs = look(layout, seen_by)
    if obs is not None and obs.error:
        print(f"warning: {obs.error}", file=sys.stderr)


def _shown(value: str) -> str:
    """A switch's value for a one-line message: control characters replaced, cut short."""
    from ..base.text import printable

    text = printable(value, 40)
    return text + ("..." if len(value) > 40 else "")


class RunCommand(FilterSwitches, Command):
    """Run any command on free device(s), as a wrapped program would: cudawrap run [-n N] -- CMD ARGS…"""

    gpus = cli.SwitchAttr(["-n", "--gpus"], str, argname="N", help="devices to lease (default: the config's gpus)")
    wait = cli.SwitchAttr(["--wait"], str, argname="SECONDS|forever", help="seconds to wait for a free device, or 'forever'")
    substitute = cli.Flag(["--substitute"], help="replace {index}, {indices}, {uuid}, {uuids}, {nvml_index}, "
                                                 "{nvml_indices} in CMD's arguments with the leased devices")

    def main(self, *command: str) -> int:
        if not command:
            raise UsageError("no command given", hint="cudawrap run [-n N] [--wait S] -- CMD ARGS…")
        layout = default_layout()
        settings = policy.effective(str(layout.root), None)
        count: Optional[int] = None
        if self.gpus is not None:
            try:
                count = parse_gpus(self.gpus)
            except ValueError as exc:
                raise UsageError(f"--gpus {_shown(self.gpus)}: {exc}") from None
        if self.wait is not None:
            try:
                settings.set("wait", parse_wait(self.wait), "--wait")
            except ValueError as exc:
                raise UsageError(f"--wait {_shown(self.wait)}: {exc}") from None
        for key, raw in self.filter_asks().items():
            if raw is not None:
                switch = "--" + key.replace("_", "-")
                policy.ask(settings, key, raw, switch, f"{switch} {_shown(raw)}")
        if self.share:
            policy.ask_share(settings, True, "--share", "--share")
        path = command[0] if "/" in command[0] else shutil.which(command[0])
        if not path or not os.path.exists(path):
            raise ProgramNotFound(f"{command[0]}: command not found")
        prog = os.path.basename(command[0])
        grant = launch.obtain(str(layout.root), prog, settings, os.environ, count=count)
        argv = list(command)
        if self.substitute:
            argv = argv[:1] + _substituted(str(layout.root), argv[1:], grant)
        exec_program(path, argv, grant.apply(original_environ()), grant)
        return 0  # not reached: exec_program replaces this process


def _substituted(root: str, args: List[str], grant: Grant) -> List[str]:
    """ARGS with the placeholders filled in from GRANT (held already: no race)."""
    from ..errors import NvmlUnavailable
    from ..sched.substitute import substitute

    if grant.visible is None or grant.lease is None:
        if os.environ.get(CVD, None) is not None and not os.environ[CVD].strip():
            raise UsageError("--substitute: CUDA_VISIBLE_DEVICES is empty, so no device was leased",
                             hint="unset CUDA_VISIBLE_DEVICES, or drop --substitute")
        raise NvmlUnavailable("--substitute: no device was leased (no NVIDIA driver)")
    uuids = grant.visible.split(",")

    def nvml_index(uuid: str) -> Optional[int]:
        from ..devices import nvml
        from ..devices.snapshot import read_fresh

        if not seen:
            seen.append(read_fresh(root) or nvml.inventory())
        device = seen[0].by_uuid(uuid)
        return None if device is None or device.is_mig else device.gpu_index

    seen: List[Any] = []

    args, warnings = substitute(args, uuids, nvml_index)
    for warning in warnings:
        print(f"cudawrap: warning: {warning}", file=sys.stderr)
    return args
