"""The README and the documentation site say what the code does, and nothing that goes stale.

- the site builds with `mkdocs build --strict` (a broken link or anchor, or a page left out of
  the navigation, fails), renders from disk with nothing fetched from the network, and its
  command and configuration references cover every command, switch and setting;
- every `cudawrap …` and `create-cudawrap …` in a shell block of README.md or docs/ names a
  real command and real switches (read off the plumbum definitions, as --help does);
- README.md stays short, and README.md, SECURITY.md and the docs' own pages carry no commit
  hash, run timestamp, issue number or measured time: figures live in bench/RESULTS.md and
  bench/REAL-GPU.md, which name no issue either;
- the Grafana dashboard queries only metrics the exporter writes.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, List, Optional, Tuple

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
README_MAX_LINES = 250


def own_pages() -> List[Path]:
    """README.md, SECURITY.md and the docs' own Markdown pages (the generated ones are not files)."""
    return [REPO / "README.md", REPO / "SECURITY.md"] + sorted(DOCS.rglob("*.md"))


# ---- the site ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1", "HOME": str(out)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def test_the_site_builds_strictly_and_every_page_is_in_it(site: Path) -> None:
    pages = {p.relative_to(DOCS).with_suffix(".html") for p in DOCS.rglob("*.md")}
    built = {p.relative_to(site) for p in site.rglob("*.html")}
    assert pages <= built, sorted(map(str, pages - built))
    for generated in ("reference/commands.html", "reference/config.html", "benchmarks/results.html",
                      "benchmarks/real-gpu.html", "security/policy.html"):
        assert Path(generated) in built, generated


def test_the_site_fetches_nothing_from_the_network(site: Path) -> None:
    """Scripts, styles, images and fonts are all local files, linked relatively (the .deb's
    copy is opened from disk): no http(s) or protocol-relative address in any of them."""
    fetched = re.compile(r"<(?:script|link|img|iframe|source)\b[^>]*\b(?:src|href)=\"((?:https?:)?//[^\"]*)\"")
    for page in site.rglob("*.html"):
        found = fetched.findall(page.read_text(encoding="utf-8"))
        assert found == [], (page.relative_to(site), found)
    css = " ".join(p.read_text(encoding="utf-8") for p in site.rglob("*.css"))
    assert not re.search(r"@import\s+url\(\s*[\"']?https?:|fonts\.googleapis", css)


def test_diagrams_are_drawn_by_the_local_mermaid(site: Path) -> None:
    page = (site / "architecture.html").read_text(encoding="utf-8")
    assert page.count('<div class="diagram">') >= 2
    assert 'src="assets/javascripts/mermaid.min.js"' in page
    assert (site / "assets" / "javascripts" / "mermaid.min.js").stat().st_size > 1_000_000


def test_the_references_cover_every_command_switch_and_setting(site: Path) -> None:
    from cudawrap.cli.docpages import render_commands, render_config
    from cudawrap.policy.config import DEFAULTS, RETIRED

    commands = render_commands()
    for path, app in every_command():
        assert f"`{path}`" in commands, path
        for info in set(app._switches_by_name.values()):
            longest = max(info.names, key=len)
            assert ("--" if len(longest) > 1 else "-") + longest in commands, (path, longest)
    config = render_config()
    for key in DEFAULTS:
        assert (f"| `{key}` |" in config) is (key not in RETIRED), key  # a retired key parses, unoffered
    assert "max_devices_per_user" in config
    assert "cudawrap doctor" in (site / "reference" / "commands.html").read_text(encoding="utf-8")


# ---- commands in shell blocks ------------------------------------------------------------

def every_command() -> Iterator[Tuple[str, Any]]:
    """(path, app instance) for create-cudawrap, cudawrap and each of its subcommands."""
    from cudawrap.cli import Cudawrap
    from cudawrap.cli.admin import CreateCudawrap

    def walk(path: str, app: Any) -> Iterator[Tuple[str, Any]]:
        yield path, app
        for sub, entry in sorted(app._subcommands.items()):
            yield from walk(f"{path} {sub}", entry.get()(f"{path} {sub}"))

    yield "create-cudawrap", CreateCudawrap("create-cudawrap")
    yield from walk("cudawrap", Cudawrap("cudawrap"))


def shell_lines(text: str) -> Iterator[str]:
    """Each command line of TEXT's shell blocks (sh, bash, console; `$ ` lines of text blocks)."""
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        for line in body.splitlines():
            if lang in ("sh", "bash", "shell", "console"):
                yield line[2:] if line.startswith("$ ") else line
            elif line.startswith("$ "):
                yield line[2:]


def simple_commands(line: str) -> Iterator[List[str]]:
    """LINE split into simple commands at `|`, `&&`, `;`, `&`, `(`, `)`, comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words: List[str] = []
    try:
        tokens = list(lexer)
    except ValueError:  # an unclosed quote: not a command line
        return
    for token in tokens:
        if token and set(token) <= set("|&;()<>"):
            if words:
                yield words
            words = []
        else:
            words.append(token)
    if words:
        yield words


def ours(words: List[str]) -> Optional[List[str]]:
    """WORDS from `cudawrap`/`create-cudawrap` on (after sudo, env and assignments), or None."""
    rest = list(words)
    while rest:
        head = rest[0]
        if head in ("sudo", "env", "runuser", "exec") or head.startswith("$") or re.match(r"\w+=", head):
            rest.pop(0)
        elif head in ("-u", "-E") and len(rest) > 1:
            rest = rest[2:] if head == "-u" else rest[1:]
        else:
            break
    if rest and rest[0].rsplit("/", 1)[-1] in ("cudawrap", "create-cudawrap"):
        return [rest[0].rsplit("/", 1)[-1]] + rest[1:]
    return None


def check_command(words: List[str]) -> Optional[str]:
    """What is wrong with WORDS (a cudawrap or create-cudawrap command line), or None."""
    apps = dict(every_command())
    path, app, args = words[0], apps[words[0]], words[1:]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        if arg.startswith("--"):
            name, eq, _ = arg[2:].partition("=")
            info = app._switches_by_name.get(name)
            if info is None:
                return f"`{path}` has no switch --{name}"
            i += 2 if info.argtype and not eq else 1
            continue
        if arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit():
            info = app._switches_by_name.get(arg[1])
            if info is None:
                return f"`{path}` has no switch -{arg[1]}"
            i += 2 if info.argtype and len(arg) == 2 else 1
            continue
        if app._subcommands:
            if arg not in app._subcommands:
                return f"`{path}` has no command {arg!r}"
            path = f"{path} {arg}"
            app = apps[path]
        i += 1
    return None


def documented_commands() -> List[Tuple[str, str, List[str]]]:
    found = []
    for page in own_pages():
        for line in shell_lines(page.read_text(encoding="utf-8")):
            for words in simple_commands(line):
                command = ours(words)
                if command:
                    found.append((str(page.relative_to(REPO)), line, command))
    return found


def test_the_command_checker_knows_a_wrong_command_from_a_right_one() -> None:
    assert check_command(["cudawrap", "status", "--json", "--watch", "2"]) is None
    assert check_command(["cudawrap", "run", "-n", "2", "--", "python", "--nonsense"]) is None
    assert check_command(["cudawrap", "mps", "status", "--json"]) is None
    assert "no command 'stauts'" in check_command(["cudawrap", "stauts"])
    assert "no switch --frobnicate" in check_command(["cudawrap", "status", "--frobnicate"])
    assert "no switch --gpu" in check_command(["create-cudawrap", "--gpu", "2", "/opt/app/bin/recon"])
    assert ours(["sudo", "env", "$FAKE", "/tmp/cw/usr/local/bin/cudawrap", "status"]) == ["cudawrap", "status"]
    assert ours(["CUDAWRAP_WAIT=0", "/tmp/cwdemo/recon"]) is None


def test_every_command_in_readme_and_docs_is_a_real_one() -> None:
    found = documented_commands()
    named = {" ".join(c[:2]) for _, _, c in found}
    # The parser finds what is there: the README's and the guides' commands at least.
    assert {"create-cudawrap /opt/app/bin/recon", "cudawrap status", "cudawrap drain", "cudawrap why",
            "cudawrap mps", "cudawrap usage", "cudawrap serve"} <= named, sorted(named)
    wrong = [f"{page}: {line.strip()}: {problem}" for page, line, command in found
             if (problem := check_command(command))]
    assert wrong == [], "\n".join(wrong)


# ---- what the prose may not carry --------------------------------------------------------

HASH = re.compile(r"(?<![\w\-/.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w\-])")
TIMESTAMP = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d(?::\d\d)? UTC\b")
ISSUE = re.compile(r"\b[Ii]ssues? #?\d+|(?<![\w&])#\d+\b")
MEASURED = re.compile(r"(?<![≤<] )(?<!within )\b\d+(?:\.\d+)?(?:[–-]\d+(?:\.\d+)?)? ?(?:ms|µs)\b")


def prose(text: str) -> str:
    """TEXT without its fenced blocks (examples of output may show a time of day)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"


@pytest.mark.parametrize("page", own_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_hash_timestamp_issue_number_or_measured_time(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert HASH.findall(text) == [], "a commit hash: say what changed, not where"
    assert TIMESTAMP.findall(prose(text)) == [], "a run's date or time: it belongs in bench/RESULTS.md"
    assert ISSUE.findall(text) == [], "an issue number"
    assert MEASURED.findall(prose(text)) == [], "a measured time: link bench/RESULTS.md instead"


def test_the_checks_catch_what_they_are_for() -> None:
    assert HASH.findall("on 3ff16b3, and cf593adbc77a") == ["3ff16b3", "cf593adbc77a"]
    assert HASH.findall("GPU-a1c93e57-7d2f GPU-8f3a deadbeef 1234567 mermaid.min.js") == []
    assert TIMESTAMP.findall("measured 2026-11-28 06:26 UTC") == ["2026-11-28", "06:26 UTC"]
    assert ISSUE.findall("issue 31's fix, see #12") == ["issue 31", "#12"]
    assert MEASURED.findall("took 12.1–17.0 ms, or 0.5 ms; ≤ 2 ms; within 10 ms") == ["12.1–17.0 ms", "0.5 ms"]


@pytest.mark.parametrize("name", ["RESULTS.md", "REAL-GPU.md"])
def test_result_files_name_no_issue(name: str) -> None:
    assert ISSUE.findall((REPO / "bench" / name).read_text(encoding="utf-8")) == []


# ---- the Grafana dashboard ---------------------------------------------------------------

def exported() -> set:
    """The series names the metrics file has: each family's, a histogram's _bucket/_sum/_count."""
    from cudawrap.monitor.metrics import Counters, render

    text = render([], {}, Counters())
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        names |= {name + s for s in ("_bucket", "_sum", "_count")} if kind == "histogram" else {name}
    return names


def test_the_grafana_dashboard_queries_only_what_the_exporter_writes() -> None:
    dashboard = json.loads((REPO / "packaging" / "grafana" / "cudawrap.json").read_text(encoding="utf-8"))
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert len(queries) >= 10
    queried = {name for q in queries for name in re.findall(r"\bcudawrap_\w+", q)}
    assert queried, queries
    assert queried <= exported(), sorted(queried - exported())
    # Every family the exporter writes is shown somewhere.
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in exported()}
    assert families <= {re.sub(r"_(bucket|sum|count)$", "", n) for n in queried}, sorted(families)


@pytest.mark.parametrize("name", ["README.md", "SECURITY.md"])
def test_readme_and_security_links_lead_somewhere(name: str) -> None:
    """Their links into docs/ (which the site's strict build does not see) name real files,
    and their own anchors real headings."""
    text = (REPO / name).read_text(encoding="utf-8")
    headings = {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        path, _, anchor = target.partition("#")
        if re.match(r"\w+://", target):
            continue
        if path:
            assert (REPO / path).exists(), f"{name}: {target}"
        else:
            assert anchor in headings, f"{name}: {target}"
