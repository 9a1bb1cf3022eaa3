"""Man pages cudawrap(1), create-cudawrap(8) and cudawrap.toml(5), generated from the code.

The commands' pages are read off their plumbum definitions (the docstrings and switch help
that ``--help`` prints), the exit codes off ``errors.py``, the configuration page off
``config.DEFAULTS``/``DESCRIPTIONS`` (what install.sh writes commented out): nothing here is
a second copy that could drift. ``make packaging`` writes them to packaging/man/.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, List, Tuple

from .. import __version__
from .app import exit_codes

PAGES = {"cudawrap.1": "cudawrap", "create-cudawrap.8": "create-cudawrap", "cudawrap.toml.5": "config"}
DATE = "2026"


# Non-ASCII text as groff draws it on every device, a terminal in the C locale included:
# ASCII where groff has no fallback of its own (it warns "can't find special character"
# for an ellipsis), its named glyphs where it has one, \[uXXXX] for the rest.
_GLYPHS = {"\u2026": "...", "\u2013": "\\(en", "\u2014": "\\(em", "\u00d7": "\\(mu", "\u2018": "\\(oq",
           "\u2019": "\\(cq", "\u201c": "\\(lq", "\u201d": "\\(rq", "\u2192": "\\(->", "\u2264": "\\(<=",
           "\u2265": "\\(>=", "\u00b0": "\\(de", "\u00b1": "\\(+-", "\u00b2": "\\(S2"}


def _glyph(char: str) -> str:
    return char if char < "\x80" else _GLYPHS.get(char, f"\\[u{ord(char):04X}]")


def esc(text: str) -> str:
    """TEXT safe in a roff line: backslashes, hyphens, and a leading dot or quote escaped;
    every non-ASCII character written as groff's glyph for it, or as ASCII (_GLYPHS)."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    text = "".join(map(_glyph, text))
    return "\\&" + text if text[:1] in (".", "'") else text


def _paragraphs(doc: str) -> List[str]:
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc.strip()) if p.strip()]


def _header(name: str, section: int, title: str) -> List[str]:
    return [f'.TH {name.upper()} {section} "{DATE}" "cudawrap {__version__}" "cudawrap"',
            ".SH NAME", f"{esc(name)} \\- {esc(title)}"]


def switches(app: Any) -> List[Tuple[str, str, str]]:
    """(group, "-n, --gpus N", help) for each switch APP shows in --help, in its order."""
    out = []
    for info in sorted(app._switches_by_func.values(), key=lambda i: (i.group != "Switches", i.names)):
        names = ", ".join(("-" if len(n) == 1 else "--") + n for n in info.names
                          if app._switches_by_name.get(n) is info)
        if info.argtype:
            names += " " + (info.argname or "VALUE")
        out.append((info.group, names, info.help or ""))
    return out


def _switch_lines(app: Any) -> List[str]:
    lines = []
    for _, names, text in switches(app):
        lines += [".TP", f"\\fB{esc(names)}\\fR", esc(" ".join(text.split()))]
    return lines


def _usage(app: Any) -> str:
    usage = app.USAGE or ("    {progname} [SWITCHES] COMMAND [SWITCHES] ARGS...\n" if app._subcommands
                          else "    {progname} [SWITCHES] {tailargs}\n")
    return " ".join(usage.format(progname=app.PROGNAME, tailargs="").split())


def _exit_status() -> List[str]:
    """A tagged paragraph per code; a code of several meanings lists them, one sentence each
    (joined on one line, they read as one run-on sentence)."""
    lines = [".SH EXIT STATUS", ".TP", "\\fB0\\fR", "Success."]
    for code, meanings in exit_codes().items():
        lines += [".TP", f"\\fB{code}\\fR"]
        if len(meanings) == 1:
            lines.append(esc(_sentence(meanings[0])))
            continue
        lines += [".PD 0"]
        for meaning in meanings:
            lines += [".RS", ".IP \\(bu 2", esc(_sentence(meaning)), ".RE"]
        lines += [".PD"]
    return lines


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:].rstrip(".") + "."


def _files() -> List[str]:
    from .. import locations as loc

    out = [".SH FILES"]
    for rel, what in ((loc.CONFIG_FILE, "the configuration, see cudawrap.toml(5)"),
                      (loc.REGISTRY_FILE, "the registry of wrapped programs"),
                      (loc.LEASE_DIR, "one lease file per device; a run holds a flock on its device's"),
                      (loc.QUEUE_DIR, "the wait queue"),
                      (loc.SHARE_DIR, "slot files of shared devices; a shared run holds a flock on one"),
                      (loc.SHIM, "the shim every wrapped program links to")):
        out += [".TP", f"\\fI/{esc(rel)}\\fR", esc(what)]
    return out


def _env() -> List[str]:
    return [".SH ENVIRONMENT",
            ".TP", "\\fBCUDAWRAP_ROOT\\fR", "the install root the commands work on (default: where they were installed)",
            ".TP", "\\fBCUDAWRAP_WAIT\\fR", "seconds to wait for a free device, or forever, for one run",
            ".TP", "\\fBCUDAWRAP_SHARE\\fR=1", "share a device with other shared runs, for one run",
            ".TP", "\\fBCUDAWRAP_VERBOSE\\fR=1, \\fBCUDAWRAP_DEBUG\\fR=1", "say more; add tracebacks"]


def _command_page(app: Any, name: str, section: int) -> List[str]:
    paras = _paragraphs(app.DESCRIPTION or "")
    lines = _header(name, section, paras[0].rstrip(".") if paras else name)
    lines += [".SH SYNOPSIS", f"\\fB{esc(_usage(app))}\\fR", ".SH DESCRIPTION"]
    for para in paras:
        lines += [".PP", esc(para)]
    lines += [".SH OPTIONS"] + _switch_lines(app)
    if app._subcommands:
        lines += [".SH COMMANDS"] + _command_lines(app, name, "")
    return lines


def _command_lines(app: Any, name: str, prefix: str) -> List[str]:
    """A subsection per command of APP, and per command of those (``mps start``)."""
    lines: List[str] = []
    for sub, entry in sorted(app._subcommands.items()):
        subapp = entry.get()(f"{name} {sub}")
        subapp.parent = app
        lines += [".SS " + esc(prefix + sub), f"\\fB{esc(_usage(subapp))}\\fR"]
        for para in _paragraphs(subapp.DESCRIPTION or ""):
            lines += [".PP", esc(para)]
        lines += _switch_lines(subapp)
        if subapp._subcommands:
            lines += _command_lines(subapp, f"{name} {sub}", f"{prefix}{sub} ")
    return lines


def render_command(name: str) -> str:
    """cudawrap(1) or create-cudawrap(8)."""
    from . import Cudawrap
    from .admin import CreateCudawrap

    app, section = (Cudawrap, 1) if name == "cudawrap" else (CreateCudawrap, 8)
    lines = _command_page(app(name), name, section) + _env() + _exit_status() + _files()
    other = "\\fBcreate\\-cudawrap\\fR(8)" if section == 1 else "\\fBcudawrap\\fR(1)"
    lines += [".SH SEE ALSO", f"{other}, \\fBcudawrap.toml\\fR(5)"]
    return "\n".join(lines) + "\n"


def render_config_page() -> str:
    """cudawrap.toml(5): every setting, its section and default, from config.DESCRIPTIONS."""
    from ..policy.config import DEFAULTS, DESCRIPTIONS
    from ..policy.defaults import HEADER, sections, toml_value

    lines = _header("cudawrap.toml", 5, "the cudawrap configuration file")
    lines += [".SH SYNOPSIS", "\\fI/etc/cudawrap/config.toml\\fR", ".SH DESCRIPTION"]
    header = " ".join(line.lstrip("#").strip() for line in HEADER.splitlines()[1:])
    lines += [".PP", esc(header.strip())]
    for section, keys in sections().items():
        lines.append(f".SH SECTION [{esc(section)}]")
        for key in keys:
            lines += [".TP", f"\\fB{esc(key)}\\fR = {esc(toml_value(DEFAULTS[key]))}", esc(DESCRIPTIONS[key])]
    from ..policy.config import SHARING_DESCRIPTIONS

    lines.append(".SH SECTION [sharing]")
    for key, what in SHARING_DESCRIPTIONS.items():
        default = {"slots": "1", "mode": '"time-slicing"', "memory_action": '"warn"', "grace_s": "5",
                   "kill_after_s": "10"}.get(key, "(derived from slots)")
        lines += [".TP", f"\\fB{esc(key)}\\fR = {esc(default)}", esc(what)]
    lines += [".PP", esc('[sharing.devices."UUID or prefix"] slots = N: one device\'s slots (a GPU- prefix '
                         'covers its MIG instances). Run cudawrap sync after changing slots. The same table may '
                         'set memory_limit_mib, memory_action, grace_s and kill_after_s for that device.')]
    lines += [".SH SECTION [programs.\"NAME\"]", ".PP",
              esc("Any [policy] key, for one wrapped program, by its name or its full path (the path wins); "
                  "and [sharing]'s memory_limit_mib, memory_action, grace_s and kill_after_s for its shares."),
              ".SH SEE ALSO", "\\fBcudawrap\\fR(1), \\fBcreate\\-cudawrap\\fR(8)"]
    return "\n".join(lines) + "\n"


def man_path(root: Any, page: str) -> Any:
    """Where PAGE goes under an install root (root/usr/local/share/man/manN/PAGE)."""
    return root / "usr" / "local" / "share" / "man" / f"man{page.rsplit('.', 1)[1]}" / page


def render(page: str) -> str:
    """The roff text of PAGE, one of PAGES."""
    what = PAGES[page]
    return render_config_page() if what == "config" else render_command(what)


def all_pages() -> Iterable[Tuple[str, str]]:
    for page in PAGES:
        yield page, render(page)
