"""The house's limits, which import-linter cannot count (pyproject's contracts hold the layers):
no module of the package over 400 lines, no function over 60, and no module importing another
cudawrap module's private name (a name with one leading underscore is its module's own; a
module that needs it elsewhere makes it public, with a docstring, where it lives).

Read from the source with ast, so that a module or function grown past its limit fails here
with its name, its size and the limit, before a review has to find it.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Tuple

PACKAGE = Path(__file__).resolve().parent.parent / "cudawrap"
MODULE_LINES = 400
FUNCTION_LINES = 60


def modules() -> Iterator[Tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def _name(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_no_module_is_over_its_limit() -> None:
    over = [f"{_name(p)}: {len(p.read_text().splitlines())} lines" for p, _ in modules()
            if len(p.read_text().splitlines()) > MODULE_LINES]
    assert not over, f"modules over {MODULE_LINES} lines (move a part with one job into a module of its own): {over}"


def _long_functions(path: Path, tree: ast.Module) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size > FUNCTION_LINES:
                yield f"{_name(path)}:{node.lineno} {node.name}: {size} lines"


def test_no_function_is_over_its_limit() -> None:
    over = [line for path, tree in modules() for line in _long_functions(path, tree)]
    assert not over, f"functions over {FUNCTION_LINES} lines: {over}"


def _private_imports(path: Path, tree: ast.Module) -> Iterator[str]:
    """`from <a cudawrap module> import _name` in PATH (the C modules `_socket`, `_signal`... and
    dunders such as __version__ are not another module's private names)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        ours = node.level > 0 or (node.module or "").split(".")[0] == "cudawrap"
        if not ours:
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                yield f"{_name(path)}:{node.lineno} imports {'.' * node.level}{node.module or ''}.{alias.name}"


MODULES = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
           for p in PACKAGE.rglob("*.py")}


def _source(path: Path, node: ast.ImportFrom) -> str:
    """The module NODE imports from, as a dotted name (a relative import resolved from PATH)."""
    if not node.level:
        return node.module or ""
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    return ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))


def _private_attributes(path: Path, tree: ast.Module) -> Iterator[str]:
    """`module._name` where module is another cudawrap module imported by PATH: an import of
    its private name by another spelling."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                full = f"{_source(path, node)}.{alias.name}"
                if full in MODULES:
                    aliases[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            yield f"{_name(path)}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}"


def test_no_module_imports_another_modules_private_name() -> None:
    found = [line for path, tree in modules()
             for line in list(_private_imports(path, tree)) + list(_private_attributes(path, tree))]
    assert not found, f"private names imported from another module (make them public where they live): {found}"


def test_the_checks_see_what_they_look_for() -> None:
    """Each check fails on what it forbids: a long function, a private import."""
    source = "from ..x import _hidden\n\ndef long():\n" + "    pass\n" * FUNCTION_LINES
    path = PACKAGE / "sizes_probe.py"  # named as if in the package, never written there
    tree = ast.parse(source)
    assert list(_private_imports(path, tree)) == ["cudawrap/sizes_probe.py:1 imports ..x._hidden"]
    probe = PACKAGE / "ops" / "sizes_probe.py"
    used = ast.parse("from ..ledger import looks as ledger\nledger._hidden()\nledger.__name__\n")
    assert list(_private_attributes(probe, used)) == ["cudawrap/ops/sizes_probe.py:2 uses cudawrap.ledger.looks._hidden"]
    assert list(_long_functions(path, tree)) == [f"cudawrap/sizes_probe.py:3 long: {FUNCTION_LINES + 1} lines"]
