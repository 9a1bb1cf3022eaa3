"""Man pages: generated from the commands' own definitions, rendered by man, every switch listed."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cudawrap.policy.config import DEFAULTS, DESCRIPTIONS
from cudawrap.cli.manpages import PAGES, exit_codes, render

SOURCE = Path(__file__).resolve().parent.parent
MAN = SOURCE / "packaging" / "man"


def cli(*args: str) -> str:
    prog = "create-cudawrap" if args[0] == "create-cudawrap" else "cudawrap"
    entry = "create_main" if prog == "create-cudawrap" else "main"
    code = f"import sys; sys.argv[0] = {prog!r}; from cudawrap.cli import {entry}; {entry}()"
    argv = args[1:] if prog == "create-cudawrap" else args
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def help_switches(text: str) -> set:
    """Every switch name a --help text lists ("-n", "--gpus", ...)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("    -"):
            head = re.split(r"\s{2,}", line.strip())[0]
            names.update(re.findall(r"(?<![\w-])--?[a-z][\w-]*", head))
    return names


def rendered(page: str, lang: str = "C.UTF-8") -> str:
    """PAGE as man shows it (plain text) in LANG, checking man and groff have nothing to complain about."""
    if shutil.which("man") is None:
        pytest.fail("man (man-db) is not installed: .ci/run installs it")
    done = subprocess.run(["man", "--warnings", "-l", str(MAN / page)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "MANWIDTH": "100", "MAN_KEEP_FORMATTING": "0",
                               "LANG": lang, "LC_ALL": lang})
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    # Plain text: no overstrike bold, no hyphenation at line ends.
    return re.sub(r"[‐-]\n\s+", "", re.sub(r".\x08", "", done.stdout))


@pytest.mark.parametrize("page", list(PAGES))
def test_packaged_page_is_what_the_code_renders(page):
    assert (MAN / page).read_text(encoding="utf-8") == render(page), "packaging/man is stale: run `make packaging`"


def test_cudawrap_page_lists_every_command_and_switch():
    text = rendered("cudawrap.1")
    top = cli("--help")
    commands = re.findall(r"^    (\w+)\s{2,}", top.split("Sub-commands:")[1], re.M)
    assert len(commands) >= 8, top
    for switch in help_switches(top):
        assert switch in text, switch
    for command in commands:
        assert re.search(rf"^   {command}$", text, re.M), command  # its own subsection
        own = help_switches(cli(command, "--help"))
        assert own, command
        section = re.split(r"\n   \S|\nENVIRONMENT", text.split(f"\n   {command}\n", 1)[1], 1)[0]
        for switch in own:
            assert switch in section, (command, switch)


def test_create_cudawrap_page_lists_every_switch():
    text = rendered("create-cudawrap.8")
    switches = help_switches(cli("create-cudawrap", "--help"))
    assert "--gpus" in switches and "--multi-mig" in switches
    for switch in switches:
        assert switch in text, switch
    assert "N:str" not in text


def test_config_page_lists_every_setting_with_its_description():
    from cudawrap.policy.config import RETIRED

    text = " ".join(rendered("cudawrap.toml.5").split())
    for key in DEFAULTS:
        if key in RETIRED:  # parses, does nothing, and is not offered
            assert f"{key} = " not in text, key
            continue
        assert f"{key} = " in text, key
        assert " ".join(DESCRIPTIONS[key].split()) in text, key


def test_exit_status_lists_every_error_class():
    text = " ".join(rendered("cudawrap.1").split())
    section = text.split("EXIT STATUS", 1)[1].split("FILES", 1)[0]
    for code in exit_codes():
        assert f" {code} " in section, code
    assert {64, 65, 69, 72, 75, 77, 78, 126, 127} <= set(exit_codes())


@pytest.mark.parametrize("page", list(PAGES))
def test_pages_are_ascii_and_render_without_warnings_in_the_c_locale(page):
    # An ellipsis written as itself made groff warn "can't find special character 'u2026'"
    # on a terminal without UTF-8 (rendered() fails on any warning).
    assert (MAN / page).read_bytes().isascii()
    text = rendered(page, lang="C")
    if page == "cudawrap.1":
        assert "DEVICE... (index, UUID or UUID prefix" in " ".join(text.split())


def test_exit_status_lists_each_meaning_of_a_code_as_its_own_item():
    text = rendered("cudawrap.1")
    section = text.split("EXIT STATUS", 1)[1].split("FILES", 1)[0]
    items: list = []
    for line in section.splitlines():
        words = line.split()
        starts = bool(words) and words[0].isdigit()  # a code's tag, then its text or its first item
        words = words[1:] if starts else words
        if words[:1] == ["\u2022"]:  # an item of a code's list
            words, starts = words[1:], True
        if starts:
            items.append("")
        if words:
            items[-1] = " ".join([items[-1], *words]).strip()
    meanings = [m for ms in exit_codes().values() for m in ms]
    for meaning in meanings:  # each a sentence of its own, never run on into the next
        assert f"{' '.join(meaning.split())}." in items, (meaning, items)


def test_help_has_no_plumbum_glitches():
    top = cli("--help")
    assert ".;" not in top and "for more info" not in top
    assert "cudawrap COMMAND --help" in top
    assert ":str" not in cli("run", "--help") and ":str" not in cli("create-cudawrap", "--help")
    assert "--help-all" in top
    leaf = cli("list", "--help")
    assert "--help-all" not in leaf
    r = subprocess.run([sys.executable, "-c", "from cudawrap.cli import main; main()", "list", "--help-all"],
                       capture_output=True, text=True)
    assert r.returncode == 64 and "--help-all" in r.stderr
