"""Benchmark: tokens per indentation run after a newline, with and without the merge's indentation pieces.

Two tokenizers built in one run by `ayumi tokenizer build` from the same small real text (the
test suite's: Japanese and math fixtures, English docstrings and code of the Python standard
library), identical but for tokenizer.merge.indent_tabs/indent_spaces (baseline: 0/0, no
indentation pieces; ours: the defaults, 4/16). Held out from both: tab-indented C headers from
/usr/include, space-indented standard-library modules the build never reads, and the docstrings of
other standard-library modules (English prose). Printed: mean whitespace-only tokens per
indentation run (tokenizer/indentation.py) per depth, and chars/token on held-out prose and code.

    python bench/tokenizer_indentation.py [--vocab 1000] [--work DIR]

Ends with: RESULT tokenizer_indentation ours=<worst mean tokens per run> baseline=<same> ratio=<r> target=<=1tok ok=...
"""
from __future__ import annotations

import argparse
import ast
import glob
import json
import re
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.result_form import machine_line, result_line  # noqa: E402  (first: it reads the load at the start)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_CODE = ["textwrap.py", "shlex.py", "fnmatch.py", "string.py", "heapq.py", "bisect.py", "glob.py", "colorsys.py"]
TRAIN_DOCS = ["argparse.py", "subprocess.py", "tarfile.py", "pathlib.py", "logging/__init__.py"]
HELD_CODE = ["difflib.py", "csv.py", "ftplib.py", "json/encoder.py", "calendar.py", "pprint.py", "dataclasses.py", "inspect.py"]
HELD_DOCS = ["email/message.py", "unittest/case.py", "http/client.py", "collections/__init__.py", "zipfile.py",
             "typing.py", "functools.py", "threading.py"]


def docstrings(modules: list[str]) -> list[str]:
    docs = []
    for name in modules:
        path = STDLIB / name
        if path.exists():
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc and len(doc) > 200:
                        docs.append(doc)
    return docs


def tab_headers() -> list[str]:
    texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in sorted(glob.glob("/usr/include/*.h"))]
    return [t for t in texts if re.search(r"^\t\t", t, re.M)]


def build(work: Path, name: str, vocab: int, tabs: int, spaces: int) -> Path:
    from tokenizer.cli import main

    fixtures = ROOT / "tests" / "tokenizer" / "fixtures"
    en, code = work / "en.jsonl", work / "code.jsonl"
    en.write_text("".join(json.dumps({"text": d}) + "\n" for d in docstrings(TRAIN_DOCS)), encoding="utf-8")
    code.write_text("".join(json.dumps({"text": (STDLIB / m).read_text(encoding="utf-8")}) + "\n"
                            for m in TRAIN_CODE if (STDLIB / m).exists()), encoding="utf-8")
    out = work / name
    extra = vocab - 1000  # domain models grow with the vocabulary (en and code only: ja/math have no more text)
    args = [f"tokenizer.inputs.ja={fixtures / 'ja.txt'}", f"tokenizer.inputs.en={en}", f"tokenizer.inputs.code={code}",
            f"tokenizer.inputs.math={fixtures / 'math.tex.txt'}", f"output_dir={out}", "overwrite=true",
            f"tokenizer.total_vocab={vocab}", "tokenizer.domains.ja.vocab_size=560",
            f"tokenizer.domains.en.vocab_size={600 + round(0.8 * extra)}", f"tokenizer.domains.code.vocab_size={500 + round(0.6 * extra)}",
            "tokenizer.domains.math.vocab_size=400", "tokenizer.domains.ja.character_coverage=0.98",
            "tokenizer.sample.heldout_fraction=0.15", "tokenizer.evaluate.baseline=false",
            f"tokenizer.merge.indent_tabs={tabs}", f"tokenizer.merge.indent_spaces={spaces}"]
    assert main(["build", *args]) == 0
    return out


def measure(folder: Path, held: dict[str, list[str]]) -> dict:
    import sentencepiece as spm

    from tokenizer.indentation import indentation_costs, summarize

    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    runs = summarize(indentation_costs(lambda t: sp.encode(t, out_type=str), held["tab_code"] + held["space_code"]))
    cpt = {k: sum(map(len, v)) / sum(len(sp.encode(t)) for t in v) for k, v in held.items()}
    own = json.loads((folder / "eval.json").read_text())["results"]["merged"]["domains"]
    cpt.update({f"heldout_{d}": own[d]["chars_per_token"] for d in ("en", "ja", "code")})
    return {"runs": runs, "chars_per_token": cpt}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--work", type=Path, help="keep both tokenizers here (default: a temporary folder, removed)")
    args = parser.parse_args()
    print(machine_line())
    work = args.work or Path(tempfile.mkdtemp(prefix="indent-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    held = {"tab_code": tab_headers(), "space_code": [(STDLIB / m).read_text(encoding="utf-8") for m in HELD_CODE],
            "prose_en": docstrings(HELD_DOCS)}
    try:
        results = {name: measure(build(work, name, args.vocab, t, s), held)
                   for name, t, s in (("baseline", 0, 0), ("ours", 4, 16))}
    finally:
        if args.work is None:  # the two tokenizers were built only to be measured
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'depth':>8} {'runs':>6} {'baseline':>9} {'ours':>6}   (mean whitespace tokens per indentation run)")
    for depth, row in results["baseline"]["runs"].items():
        print(f"{depth:>8} {row['runs']:>6} {row['mean']:>9.2f} {results['ours']['runs'][depth]['mean']:>6.2f}")
    print(f"\n{'chars/token':>16} {'baseline':>9} {'ours':>9} {'change':>8}")
    for key, base in results["baseline"]["chars_per_token"].items():
        ours = results["ours"]["chars_per_token"][key]
        print(f"{key:>16} {base:>9.4f} {ours:>9.4f} {100 * (ours / base - 1):>+7.2f}%")
    worst = {name: max(r["mean"] for r in res["runs"].values()) for name, res in results.items()}
    # One build each: token counts of a fixed model on fixed text do not vary between runs (n=1).
    print(result_line("tokenizer_indentation", worst["ours"], worst["baseline"], "<=1tok", unit="tok"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
