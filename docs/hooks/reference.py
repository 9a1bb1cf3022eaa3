"""mkdocs hook: the pages that are generated or kept elsewhere, added as the site builds.

- reference/commands.md and reference/config.md, from the commands' and the configuration's
  own definitions (cudawrap/cli/docpages.py), as the man pages are: they cannot drift;
- benchmarks/results.md and benchmarks/real-gpu.md: bench/RESULTS.md and bench/REAL-GPU.md
  as they are (the figures live only there);
- security/policy.md: SECURITY.md, its links into docs/ made relative to the site;
- assets/cudawrap-grafana.json: packaging/grafana/cudawrap.json, for the metrics page's link.
"""
from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[2]


def _pages() -> dict:
    from cudawrap.cli.docpages import render_commands, render_config

    security = (REPO / "SECURITY.md").read_text(encoding="utf-8").replace("](docs/", "](../")
    return {
        "reference/commands.md": render_commands(),
        "reference/config.md": render_config(),
        "benchmarks/results.md": (REPO / "bench" / "RESULTS.md").read_text(encoding="utf-8"),
        "benchmarks/real-gpu.md": (REPO / "bench" / "REAL-GPU.md").read_text(encoding="utf-8"),
        "security/policy.md": security,
        "assets/cudawrap-grafana.json": (REPO / "packaging" / "grafana" / "cudawrap.json").read_text(encoding="utf-8"),
    }


def on_files(files, config):  # noqa: ANN001, ANN201 - mkdocs' hook signature
    for uri, text in _pages().items():
        files.append(File.generated(config, uri, content=text))
    return files
