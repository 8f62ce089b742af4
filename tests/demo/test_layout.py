"""The demo package's import rules (demo/__init__.py): nothing else in ayumi imports `demo`; the
demo imports only ayumi's own packages, and its modules only downward (sources never the build or
the run, the build never the run)."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PRODUCT = ("common", "tokenizer", "data", "curriculum", "pretrain")
# demo module -> the demo modules it must not import (the layers above it)
ABOVE = {"run": set(), "corpus": {"demo.run"}}
SOURCES_ABOVE = {"demo.run", "demo.corpus"}


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` or `from ... import` names in the file, lazy (in-function) imports included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_no_other_package_imports_demo():
    offenders = [f"{path.relative_to(REPO)}: {name}" for package in PRODUCT for path in sorted((REPO / package).rglob("*.py"))
                 for name in sorted(imported_modules(path)) if name == "demo" or name.startswith("demo.")]
    assert offenders == []


def test_demo_imports_ayumi_packages_only_and_downward():
    modules = sorted((REPO / "demo").glob("*.py"))
    assert {path.stem for path in modules} >= {"__init__", "run", "corpus", "cloze", "debian", "rdata", "manpages",
                                              "austen", "pari", "python_code"}
    for path in modules:
        ayumi = {name for name in imported_modules(path) if name.split(".")[0] in (*PRODUCT, "demo", "tests", "bench")}
        assert {name.split(".")[0] for name in ayumi} <= {*PRODUCT, "demo"}, path.name
        forbidden = ABOVE.get(path.stem, SOURCES_ABOVE)
        assert not [name for name in ayumi if any(name == up or name.startswith(up + ".") for up in forbidden)], path.name
