"""The documentation site's command and configuration references, generated from the code.

Like the man pages (manpages.py), these are read off the plumbum definitions (docstrings and
switch help, as ``--help`` prints them), the exit codes off ``errors.py`` and the settings off
``config.DEFAULTS``/``DESCRIPTIONS``: the site's build (docs/hooks/reference.py) writes them
as it builds, so they cannot drift from the programs they describe.
"""
from __future__ import annotations

import re
from typing import Any, List

from .manpages import switches


def _paragraphs(doc: str) -> List[str]:
    """DOC's paragraphs, each on one line."""
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc) if p.strip()]


def _usage(app: Any) -> str:
    """APP's usage line, as --help prints it."""
    tail = "[SWITCHES] COMMAND [SWITCHES] ARGS..." if app._subcommands else "[SWITCHES]"
    return " ".join((app.USAGE or f"{{progname}} {tail}").format(progname=app.PROGNAME, tailargs="").split())


def _text(text: str) -> str:
    """Help TEXT as Markdown prose: one line, and what Markdown would read as markup escaped
    (`CUDAWRAP_<name>` is text, not an HTML tag)."""
    return " ".join(text.split()).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def _cell(text: str) -> str:
    """TEXT as one Markdown table cell: prose, pipes escaped."""
    return _text(text).replace("|", "\\|")


def _switch_table(app: Any) -> List[str]:
    # A pipe inside a code span (`--foreign avoid|ignore`) does not split a table's row.
    rows = switches(app)
    if not rows:
        return []
    lines = ["| switch | what |", "|---|---|"]
    lines += [f"| `{names}` | {_cell(text)} |" for _, names, text in rows]
    return lines + [""]


def _command(app: Any, title: str, level: int) -> List[str]:
    lines = ["#" * level + f" `{title}`", "", "```text", _usage(app), "```", ""]
    for para in _paragraphs(app.DESCRIPTION or ""):
        lines += [_text(para), ""]
    lines += _switch_table(app)
    for sub, entry in sorted(app._subcommands.items()):
        subapp = entry.get()(f"{title} {sub}")
        subapp.parent = app
        lines += _command(subapp, f"{title} {sub}", min(level + 1, 4))
    return lines


def render_commands() -> str:
    """The command reference: create-cudawrap, then cudawrap and every subcommand."""
    from . import Cudawrap
    from .admin import CreateCudawrap
    from .app import exit_codes

    lines = ["# Command reference", "",
             "Generated from the commands' own definitions when this site is built, as the man pages "
             "are (`man cudawrap`, `man create-cudawrap`): what `--help` prints, in one place.", ""]
    lines += _command(CreateCudawrap("create-cudawrap"), "create-cudawrap", 2)
    lines += _command(Cudawrap("cudawrap"), "cudawrap", 2)
    lines += ["## Exit status", "",
              "Every command, and every wrapped program, exits with one of these (a wrapped program that "
              "ran passes its own status through).", "", "| code | meaning |", "|---|---|", "| 0 | success |"]
    lines += [f"| {code} | {_cell('; '.join(meanings))} |" for code, meanings in exit_codes().items()]
    return "\n".join(lines) + "\n"


def render_config() -> str:
    """The configuration reference: every table and key with its default and meaning."""
    from ..policy.config import DEFAULTS, DESCRIPTIONS, SHARING_DESCRIPTIONS
    from ..policy.defaults import (HEADER, LIMITS_EXAMPLE, PROGRAMS_EXAMPLE, SHARING_EXAMPLE, SHARING_SHOWN,
                                   render_config as default_file, sections, toml_value)

    intro = " ".join(line.lstrip("#").strip() for line in HEADER.splitlines()[1:])
    lines = ["# Configuration reference", "",
             "Generated from the configuration's schema when this site is built, as `man cudawrap.toml` "
             "is. The file is `/etc/cudawrap/config.toml` (TOML).", "", _text(intro), ""]
    for section, keys in sections().items():
        lines += [f"## `[{section}]`", "", "| key | default | meaning |", "|---|---|---|"]
        lines += [f"| `{key}` | `{toml_value(DEFAULTS[key])}` | {_cell(DESCRIPTIONS[key])} |"
                  for key in keys]
        lines.append("")
    lines += ["## `[limits]`", "", "```toml", LIMITS_EXAMPLE.rstrip(), "```", "",
              "## `[sharing]`", "",
              "Optional keys without a fixed default are derived from the device's slots; the value shown "
              "is what each is with `slots = 1`.", "", "| key | shown as | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | `{SHARING_SHOWN[key]}` | {_cell(what)} |"
              for key, what in SHARING_DESCRIPTIONS.items()]
    lines += ["", "```toml", SHARING_EXAMPLE.rstrip(), "```", "",
              '## `[programs."NAME"]`', "", "```toml", PROGRAMS_EXAMPLE.rstrip(), "```", "",
              "## The default file", "",
              "What install.sh and the Debian package write where no configuration exists:", "",
              "```toml", default_file().rstrip(), "```"]
    return "\n".join(lines) + "\n"
