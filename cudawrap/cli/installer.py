"""``python -m cudawrap.cli.installer``: install.sh's Python half, the .deb's scripts and `make packaging`.

Here, above the install layer, because the man pages and bash completion are rendered from
the CLI's definitions and an upgrade refreshes the wraps' shims: cudawrap.install receives
both instead of importing the CLI or the wraps.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..admin.shimlinks import refresh_shims
from ..install.installation import (
    MONITOR_UNIT, MPS_UNIT, PROG, UNIT_NAME, InstallError, Layout, install, prepare_package, render_monitor_unit,
    render_mps_unit, render_service_unit, SERVICE_UNIT, render_tmpfiles, render_unit, stop_monitor, uninstall,
)
from ..install.voice import package_say
from .manpages import PAGES, man_path, render as render_man


def man_pages(layout: Layout) -> Dict[Path, str]:
    """Every man page, rendered, by where it goes under LAYOUT's root."""
    return {man_path(layout.root, page): render_man(page) for page in PAGES}


def render_bash_completion() -> str:
    """packaging/cudawrap.bash-completion, from both commands' definitions."""
    from .completion import render_bash

    return render_bash()


def _render(action: str, layout: Layout) -> str:
    if action == "render-config":
        from ..policy.defaults import render_config

        return render_config()
    if action == "render-completion":
        return render_bash_completion()
    if action.startswith("render-man-"):
        return render_man(action[len("render-man-"):])
    if action == "render-unit":
        return render_unit(layout)
    if action == "render-monitor-unit":
        return render_monitor_unit(layout)
    if action == "render-mps-unit":
        return render_mps_unit(layout)
    if action == "render-service-unit":
        return render_service_unit(layout)
    return render_tmpfiles(layout)


def _parser() -> Tuple[argparse.ArgumentParser, Dict[str, str]]:
    """The installer's argument parser, and its render-* actions (name -> what each prints)."""
    parser = argparse.ArgumentParser(prog="python -m cudawrap.cli.installer",
                                     description="install.sh's second half; run install.sh instead")
    sub = parser.add_subparsers(dest="action", required=True)
    inst = sub.add_parser("install")
    inst.add_argument("--root", required=True, type=Path)
    inst.add_argument("--python", required=True, help="the interpreter baked into the shim")
    inst.add_argument("--source", type=Path, help="the source directory (for packaging/ files)")
    inst.add_argument("--created", type=Path, action="append", default=[],
                      help="a directory install.sh created for the virtual environment")
    inst.add_argument("--wheel", type=Path, help="the client wheel to leave for users")
    inst.add_argument("--build", default="", help="which build this is (commit, date), for --version")
    inst.add_argument("--way", choices=("service", "daemonless"),
                      help="how a new install runs (default: a root install with its service, a --prefix "
                           "one daemonless); an upgrade keeps its way")
    prep = sub.add_parser("prepare", help="directories, runtime area and shim of an install root (the .deb's "
                                           "postinst)")
    prep.add_argument("--root", required=True, type=Path)
    prep.add_argument("--python", required=True, help="the interpreter baked into the shim")
    prep.add_argument("--way", choices=("service", "daemonless"), default="service",
                      help="how a new install runs (the .deb's: service); an upgrade keeps its way")
    rem = sub.add_parser("uninstall")
    rem.add_argument("--root", required=True, type=Path)
    rem.add_argument("--unwrap-all", action="store_true")
    rem.add_argument("--keep-wraps", action="store_true",
                     help="keep the wrapped programs, registry and config for the Debian package")
    rem.add_argument("--purge", action="store_true",
                     help="remove the state too (registry, ledger, usage history) and an edited config")
    stopper = sub.add_parser("stop-monitor", help="stop a `cudawrap monitor --daemon` (the .deb's prerm)")
    stopper.add_argument("--root", required=True, type=Path)
    renderers = {
        "render-config": "the commented default configuration",
        "render-completion": "packaging/cudawrap.bash-completion",
        "render-unit": f"packaging/{UNIT_NAME} (for --root, default /)",
        "render-monitor-unit": f"packaging/{MONITOR_UNIT} (for --root, default /)",
        "render-mps-unit": f"packaging/{MPS_UNIT} (for --root, default /)",
        "render-service-unit": f"packaging/{SERVICE_UNIT} (for --root, default /)",
        "render-tmpfiles": "packaging/cudawrap.tmpfiles (for --root, default /)",
    }
    renderers.update({f"render-man-{page}": f"the man page packaging/man/{page}" for page in PAGES})
    for name, what in renderers.items():
        sub.add_parser(name, help=f"print {what}").add_argument("--root", type=Path, default=Path("/"))
    return parser, renderers


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m cudawrap.cli.installer install|uninstall …``: install.sh's Python half."""
    parser, renderers = _parser()
    args = parser.parse_args(argv)
    if args.action in renderers:
        sys.stdout.write(_render(args.action, Layout(args.root.absolute())))
        return 0
    layout = Layout(args.root.absolute())
    who = "cudawrap" if args.action in ("prepare", "stop-monitor") else PROG  # the .deb's scripts
    try:
        if args.action == "prepare":
            from ..install.way import record_way

            record_way(layout, args.way)  # before prepare: the directories' modes follow it
            prepare_package(layout, args.python, refresh_shims)
        elif args.action == "install":
            install(layout, args.python, args.source, args.created, wheel=args.wheel, build=args.build,
                    man_pages=man_pages(layout), refresh=refresh_shims, way=args.way)
        elif args.action == "stop-monitor":
            stop_monitor(layout, package_say)
        else:
            uninstall(layout, args.unwrap_all, keep_wraps=args.keep_wraps, purge=args.purge)
    except InstallError as exc:
        print(f"{who}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        where = f" {exc.filename}" if exc.filename else ""
        print(f"{who}: error:{where}: {exc.strerror or exc}", file=sys.stderr)
        return 74
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
