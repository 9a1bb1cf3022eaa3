"""Running the server: `cudawrap drain`, `resume`, `cancel` and `usage`."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from plumbum import cli

from ..base import audit
from ..policy.config import FOREVER, load_config, parse_wait
from ..errors import NoDeviceError, UsageError
from ..paths import Layout, default_layout
from ..base.users import user_name
from .app import Command


def _machine(layout: Layout) -> Tuple[Any, List[str]]:
    """The inventory (None without NVML) and the lease files' names."""
    from ..devices import nvml
    from ..errors import NvmlUnavailable

    try:
        inventory = nvml.inventory()
    except NvmlUnavailable:
        inventory = None
    names = sorted(os.listdir(layout.lease_dir)) if layout.lease_dir.is_dir() else []
    return inventory, names


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at))


def _holders_of(layout: Layout, uuids: List[str]) -> Dict[str, int]:
    from ..lease.holders import holders

    held = holders(str(layout.lease_dir))
    return {u: held[u] for u in uuids if u in held}


def _who(pid: int) -> str:
    from ..ops.status import process_info

    info = process_info(pid)
    return f"pid {pid} ({info['user']}: {info['command'][:40]})"


class DrainCommand(Command):
    """No new lease on DEVICE… (index, UUID or UUID prefix; a GPU covers its MIG instances); holders finish (root)."""

    DESCRIPTION_MORE = ("--wait returns when none of the devices is held any more (exit 0) or after SECONDS "
                        "(exit 75, naming who still holds what). `--wait 3` waits 3 s; `cudawrap drain 3 --wait` "
                        "drains GPU 3 and waits as long as it takes.")

    reason = cli.SwitchAttr(["--reason"], str, default="", argname="TEXT", help="why (shown by cudawrap status)")
    wait = cli.SwitchAttr(["--wait"], str, argname="SECONDS",
                          help="then wait until none of them is held (SECONDS optional: forever)")

    def _parse_args(self, argv):  # type: ignore[no-untyped-def]
        # --wait's SECONDS is optional: a bare --wait (last, or before a switch or device) is forever.
        argv = list(argv)
        for i, arg in enumerate(argv):
            if arg == "--":
                break
            if arg == "--wait":
                nxt = argv[i + 1] if i + 1 < len(argv) else None
                try:  # a number (even a bad one, reported as such) or "forever" is its value
                    ok = nxt is not None and (nxt.strip().lower() == "forever" or float(nxt) == float(nxt))
                except ValueError:
                    ok = False
                if not ok:
                    argv[i] = "--wait=forever"
        return super()._parse_args(argv)

    def main(self, *devices: str) -> int:
        from ..sched.drains import drain, drained, leases_covered, resolve
        from ..base.privilege import require_admin

        layout = default_layout()
        require_admin(layout, "drain devices")
        if not devices:
            raise UsageError("no device given", hint="cudawrap drain DEVICE... [--reason TEXT] [--wait [SECONDS]]")
        limit = None
        if self.wait is not None:
            try:
                limit = parse_wait(self.wait)
            except ValueError as exc:
                raise UsageError(f"--wait {self.wait[:40]!r}: {exc}") from None
        reason = "".join(c if c.isprintable() else " " for c in self.reason[:200]).strip()
        inventory, names = _machine(layout)
        root = str(layout.root)
        uuids = resolve(devices, inventory, names + list(drained(root)))
        by = _admin_name()
        drain(root, uuids, reason, by)
        audit.log("drain", devices=",".join(uuids), reason=reason or "-", by=by)
        covered = leases_covered(uuids, inventory, names)
        for uuid in uuids:
            print(f"drained {uuid}" + (f" ({reason})" if reason else ""))
        if limit is None:
            held = _holders_of(layout, covered)
            for uuid, pid in held.items():
                print(f"{uuid} is still held by {_who(pid)}: it finishes undisturbed")
            return 0
        return _wait_free(layout, covered, limit)


def _admin_name() -> str:
    """Who drains: the admin's own account when run through sudo, else the caller."""
    sudo = os.environ.get("SUDO_UID", "")
    if os.getuid() == 0 and sudo.isascii() and sudo.isdigit() and len(sudo) <= 9:
        return user_name(int(sudo))
    return user_name(os.getuid())


def _wait_free(layout: Layout, uuids: List[str], limit: float) -> int:
    """Wait until none of UUIDS is held; 0, or 75 at LIMIT naming who still holds what."""
    deadline = time.monotonic() + limit if limit != FOREVER else None
    while True:
        held = _holders_of(layout, uuids)
        if not held:
            print("none of them is held now")
            return 0
        if deadline is not None and time.monotonic() >= deadline:
            for uuid, pid in held.items():
                print(f"{uuid} still held by {_who(pid)}", file=sys.stderr)
            print(f"cudawrap drain: {len(held)} device(s) still held after {limit:g} s", file=sys.stderr)
            return NoDeviceError.exit_code
        time.sleep(0.1)


class ResumeCommand(Command):
    """Undo `cudawrap drain`: DEVICE… may be leased again (root)."""

    def main(self, *devices: str) -> int:
        from ..sched.drains import drained, resolve, resume
        from ..errors import StateError
        from ..base.privilege import require_admin

        layout = default_layout()
        require_admin(layout, "resume devices")
        if not devices:
            raise UsageError("no device given", hint="cudawrap resume DEVICE... (`cudawrap status` lists drains)")
        root = str(layout.root)
        inventory, names = _machine(layout)
        current = drained(root)
        uuids = resolve(devices, inventory, names + list(current))
        parents = {d.uuid: d.parent_uuid for d in inventory.devices} if inventory is not None else {}
        for uuid in uuids:
            if uuid not in current and parents.get(uuid) in current:
                raise StateError(f"{uuid} is drained through its GPU {parents[uuid]}, not on its own",
                                 hint=f"resume the GPU: cudawrap resume {parents[uuid]}")
        resume(root, uuids)
        audit.log("resume", devices=",".join(uuids))
        for uuid in uuids:
            print(f"resumed {uuid}" if uuid in current else f"{uuid} was not drained")
        return 0


class RevokeCommand(Command):
    """Take DEVICE's lease from its holder now (root): its lease file is replaced, its run killed."""

    DESCRIPTION_MORE = ("For a lease whose holder cannot be found or stopped otherwise (its descriptor passed "
                        "into a socket or mapped, the run that took it gone): a fresh lease file replaces the old "
                        "one, so whatever still holds the old one guards nothing, and the next run may take the "
                        "device. The grant's run (through the service) and every process holding the old file "
                        "locked are killed; the ledger records the lease as revoked. A GPU covers its MIG "
                        "instances.")

    def main(self, *devices: str) -> int:
        from ..sched.drains import drained, leases_covered, resolve
        from ..base.privilege import require_admin
        from ..service.revoke import revoke

        layout = default_layout()
        require_admin(layout, "revoke a lease")
        if not devices:
            raise UsageError("no device given", hint="cudawrap revoke DEVICE... (`cudawrap status` lists the devices)")
        inventory, names = _machine(layout)
        uuids = leases_covered(resolve(devices, inventory, names + list(drained(str(layout.root)))), inventory, names)
        if not uuids:
            raise UsageError(f"{' '.join(devices)[:60]}: no lease file for that device here",
                             hint="`cudawrap status` lists the devices that are leased; `cudawrap sync` makes their files")
        by = _admin_name()
        for line in revoke(layout, uuids, by):
            print(line)
        audit.log("revoke", devices=",".join(uuids), by=by)
        return 0


class CancelCommand(Command):
    """Cancel waiting runs by pid: your own, or anyone's as root; the run exits 75 saying who cancelled it."""

    def main(self, *pids: str) -> int:
        from ..ops.cancel import cancel, parse_pids

        layout = default_layout()
        chosen = cancel(layout, parse_pids(pids))
        for waiter in chosen:
            audit.log("cancel", target=waiter.pid, owner=user_name(waiter.uid))
            print(f"cancelled pid {waiter.pid} ({user_name(waiter.uid)})")
        return 0


class UsageCommand(Command):
    """Device time, runs and waits per user, program, device or day, from the ledger."""

    DESCRIPTION_MORE = ("Root sees everyone; a user sees their own finished runs. Times are local; --since "
                        "defaults to the start of this month. Device-hours count each device of a run; IDLE: "
                        "device-hours held idle ([health] idle_after_min), each spell counted whole once flagged.")

    since = cli.SwitchAttr(["--since"], str, argname="WHEN", help="7d, 12h, a date (2026-11-01[T08:00]) or month (2026-11)")
    until = cli.SwitchAttr(["--until"], str, argname="WHEN", help="the same forms; default now")
    by = cli.SwitchAttr(["--by"], cli.Set("user", "program", "device", "day"), default="user", help="group rows by")
    as_json = cli.Flag(["--json"], help="an array of objects for scripts")
    plot_file = cli.SwitchAttr(["--plot"], str, argname="FILE.png", help="also draw device-hours per user per day")

    def main(self) -> int:
        from ..ops.usage import load_all, month_start, parse_when, plot, summarize, user_day_hours

        layout = default_layout()
        now = time.time()
        since = parse_when(self.since, now, "--since") if self.since else month_start(now)
        until = parse_when(self.until, now, "--until") if self.until else now
        if since >= until:
            raise UsageError(f"--since {_when(since)} is not before --until {_when(until)}")
        if self.plot_file is not None and not self.plot_file.strip():
            raise UsageError("--plot: empty file name")
        keep = _keep(layout)
        problems: List[str] = []
        items, idle = load_all(layout, keep, problems, now)
        for problem in problems[:20]:
            print(f"cudawrap usage: warning: {problem}", file=sys.stderr)
        if len(problems) > 20:
            print(f"cudawrap usage: warning: {len(problems) - 20} more problems", file=sys.stderr)
        rows = summarize(items, self.by, since, until, idle)
        if self.plot_file:
            per_user, days = user_day_hours(items, since, until)
            plot(per_user, days, self.plot_file, f"device-hours per user per day, {_when(since)} to {_when(until)}")
        if self.as_json:
            print(json.dumps(rows, indent=2))
            return 0
        print(f"# {_when(since)} to {_when(until)}" + ("" if os.geteuid() == 0 else f", runs of {user_name(os.getuid())}"))
        table = [(self.by.upper(), "DEVICE-HOURS", "IDLE", "RUNS", "MEAN WAIT", "P95 WAIT", "GIB-HOURS", "PEAK GIB")]
        for row in rows:
            table.append((str(row[self.by]), f"{row['device_hours']:.2f}", f"{row['idle_device_hours']:.2f}",
                          str(row["runs"]), _secs(row["wait_mean_s"]), _secs(row["wait_p95_s"]),
                          _num(row["memory_gib_hours"], ".2f"), _num(row["memory_peak_gib"], ".1f")))
        table.append(("total", f"{sum(r['device_seconds'] for r in rows) / 3600:.2f}",
                      f"{sum(r['idle_device_hours'] for r in rows):.2f}", str(sum(r["runs"] for r in rows)),
                      "", "", "", ""))
        widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
        for row in table:
            print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        return 0


def _num(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _secs(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.1f} s"


def _keep(layout: Layout) -> int:
    try:
        return int(load_config(layout.config_file)["keep"])
    except Exception:  # a broken config is reported by every other command; usage still reads
        from ..policy.config import DEFAULTS

        return int(DEFAULTS["keep"])
