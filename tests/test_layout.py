"""The house rules, checked on the code itself (imports read with `ast`, lazy ones inside functions included):

- only `pretrain/engine/` imports DeepSpeed (`pretrain/tools/doctor.py` aside: it reports DeepSpeed's versions
  and ops), and only `pretrain/metrics.py` imports W&B;
- the data flows one way: tokenizer -> data -> curriculum -> downstream -> pretrain (`common` below all, `demo`
  above all; downstream evaluation sits below the trainer that calls it);
- no import circles between files (a circle makes "where does this live?" unanswerable);
- no product file names a document that is not in the repository, or a machine path.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "tokenizer", "data", "curriculum", "downstream", "pretrain", "demo")
PRODUCT_DIRS = (*PACKAGES, "bench", "conf", "launch", "docs")
# Lower layers never import higher ones (the one-way data flow; demo drives them all).
LAYER = {"common": 0, "tokenizer": 1, "data": 2, "curriculum": 3, "downstream": 4, "pretrain": 5, "demo": 6}


def product_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")) if (REPO / package).is_dir() else []:
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def imported_names(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file: `import a.b` -> a.b; `from a import b` -> a.b and a."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = product_modules()
    graph = {}
    for name, path in modules.items():
        # A module imported as `from pkg import module` counts as that module; a package's __init__ is not
        # an edge (importing pkg.x runs pkg/__init__, which holds no code of ours beyond a docstring).
        graph[name] = {m for m in imported_names(path) if m in modules and m != name
                       and not (modules[m].name == "__init__.py" and any(o.startswith(m + ".") for o in modules))}
    return graph


def test_only_the_engine_imports_deepspeed_and_only_metrics_imports_wandb():
    offenders = []
    for name, path in product_modules().items():
        roots = {m.split(".")[0] for m in imported_names(path)}
        rel = path.relative_to(REPO).as_posix()
        if "deepspeed" in roots and not (rel.startswith("pretrain/engine/") or rel == "pretrain/tools/doctor.py"):
            offenders.append(f"{rel} imports deepspeed")
        if "wandb" in roots and rel != "pretrain/metrics.py":
            offenders.append(f"{rel} imports wandb")
    assert offenders == []


def test_the_data_flows_one_way():
    backwards = [f"{name} imports {dep}" for name, deps in import_graph().items() for dep in deps
                 if LAYER[dep.split(".")[0]] > LAYER[name.split(".")[0]]]
    assert backwards == []


def test_no_two_files_import_each_other():
    """No circle of any length (Tarjan's strongly connected components of the file graph)."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert circles == []


MARKDOWN_NAME = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)\b")
WRITTEN_BY_AYUMI = {"summary.md", "results.md"}  # outputs (`ayumi report`, bench/gpu_acceptance.py), not documents to read
# An absolute path into a home or work folder of one machine.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:home|Users|root|work|mnt|scratch)/\w")
CLIMB = re.compile(r"(?<![\w.])((?:\.\./)+[\w./-]*)")


def leaves_the_repository(path: Path, line: str) -> bool:
    """A relative path in `line` that climbs out of the repository from `path`'s folder (a docs/ link to
    ../README.md stays inside)."""
    return any(REPO not in (path.parent / target).resolve().parents for target in CLIMB.findall(line))


def product_text_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "ayumi", REPO / "pyproject.toml"]
    for folder in PRODUCT_DIRS:
        if (REPO / folder).is_dir():
            files += [p for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".sh",
                                                                                             ".sbatch", ".toml", "")]
    return files


def test_no_product_file_cites_a_document_outside_the_repository_or_a_machine_path():
    """Every markdown document a product file names is in the repository, and no product file holds a path of
    one machine: what a user or contributor needs is in docs/."""
    in_repo = {path.name for path in REPO.rglob("*.md") if ".venv" not in path.parts}
    found = []
    for path in product_text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            missing = [name for name in MARKDOWN_NAME.findall(line)
                       if Path(name).name not in in_repo | WRITTEN_BY_AYUMI]
            if missing or MACHINE_PATH.search(line) or leaves_the_repository(path, line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert found == []


def test_every_package_says_what_lives_there_and_what_it_may_import():
    missing = []
    for init in sorted(REPO.glob("*/**/__init__.py")):
        rel = init.relative_to(REPO)
        if rel.parts[0] not in PACKAGES:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
        if not re.search(r"May import:", doc):
            missing.append(str(rel))
    assert missing == []
