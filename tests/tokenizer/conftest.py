"""Real text for the tokenizer tests, made once per session.

ja / math: small texts written for these tests (fixtures/). en: docstrings of the Python standard
library (real English prose, PSF licence, always on the machine). code: standard-library source files.
"""
from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
CODE_MODULES = ["textwrap.py", "shlex.py", "fnmatch.py", "string.py", "heapq.py", "bisect.py", "glob.py", "colorsys.py"]
DOC_MODULES = ["argparse.py", "subprocess.py", "tarfile.py", "pathlib/__init__.py", "pathlib.py", "logging/__init__.py"]

TINY_SIZES = dict(total_vocab=1000, ja=560, en=600, code=500, math=400)


def stdlib_docstrings() -> list[str]:
    docs = []
    for name in DOC_MODULES:
        path = STDLIB / name
        if not path.exists():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    docs.append(doc)
    return docs


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """domain → input file (jsonl for en/code, text for ja/math)."""
    root = tmp_path_factory.mktemp("corpus")
    en = root / "en.jsonl"
    en.write_text("".join(json.dumps({"text": d}) + "\n" for d in stdlib_docstrings()), encoding="utf-8")
    code = root / "code.jsonl"
    code.write_text("".join(json.dumps({"text": (STDLIB / m).read_text(encoding="utf-8")}) + "\n"
                            for m in CODE_MODULES if (STDLIB / m).exists()), encoding="utf-8")
    return {"ja": FIXTURES / "ja.txt", "en": en, "code": code, "math": FIXTURES / "math.tex.txt"}


def tiny_overrides(corpus: dict[str, Path], out: Path, **extra) -> list[str]:
    s = TINY_SIZES
    overrides = [f"tokenizer.inputs.{d}={p}" for d, p in corpus.items()] + [
        f"output_dir={out}",
        f"tokenizer.total_vocab={s['total_vocab']}",
        *(f"tokenizer.domains.{d}.vocab_size={s[d]}" for d in ("ja", "en", "code", "math")),
        "tokenizer.sample.heldout_fraction=0.15",
        "tokenizer.num_threads=2",
        "tokenizer.domains.ja.character_coverage=0.98",  # the small fixture: rare kanji go to bytes
    ]
    return overrides + [f"{k}={v}" for k, v in extra.items()]


@pytest.fixture(scope="session")
def built(corpus, tmp_path_factory) -> Path:
    """One tokenizer built through the CLI, shared by the read-only tests."""
    from tokenizer.cli import main

    out = tmp_path_factory.mktemp("built") / "tok"
    assert main(["build", *tiny_overrides(corpus, out)]) == 0
    return out
