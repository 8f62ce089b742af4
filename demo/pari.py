"""Math: the PARI/GP manual and tutorials (TeX) from Debian's pari-doc, one document per (sub)section.

A light de-TeX: PARI's typographic macros are unwrapped, index entries dropped, `$…$` formulas and
the GP examples kept as written.
"""
from __future__ import annotations

import re
from pathlib import Path

from demo.base import squeeze_blank_lines
from demo.debian import Package

PACKAGE = "pari-doc"

PARI_FILES = tuple(f"usersch{i}.tex" for i in range(1, 9)) + ("tutorial.tex", "tutorial-mf.tex")
_PARI_HEADING = re.compile(r"^\\(chapter|section|subsec|subsubsec)\b", re.MULTILINE)
_BRACED = r"\{((?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*)\}"  # a {...} argument, braces nested up to 3 deep
# Index and cross-reference macros print nothing in the running text: dropped with their argument.
_PARI_DROPPED = re.compile(r"\\(?:label|kbdsidx|sidx|secref|tetidx|kbdidx)" + _BRACED + r"|\\(?:noindent|smallskip|medskip|bigskip|vfill|hfill|newpage)\b\s?")
# Typographic macros whose argument is the text itself.
_PARI_UNWRAPPED = re.compile(r"\\(?:kbd|var|tet|emph|idx|teb|key|tev|sbr|bf|it|misctitle|subsec|subsubsec|section|chapter)" + _BRACED)
_PARI_FUN = re.compile(r"\\fun" + _BRACED + _BRACED + _BRACED)  # \fun{type}{name}{args} -> name(args)
_PARI_TYPE = re.compile(r"\\typ" + _BRACED)  # \typ{INT} -> t_INT
_PARI_PROGRAM = re.compile(r"\\bprog\s*|\s*@eprog")  # verbatim GP examples: keep the code, drop the markers


def pari_doc_dir(package: Package) -> Path:
    return package.root / "usr/share/pari/doc"


def detex_pari(text: str) -> str:
    """Light TeX→text for the PARI manual: unwrap its typographic macros, drop index entries, keep `$…$`."""
    text = _PARI_DROPPED.sub("", text)
    text = _PARI_FUN.sub(lambda m: f"{m.group(2)}({m.group(3)})", text)
    text = _PARI_TYPE.sub(lambda m: f"t_{m.group(1)}", text)
    text = _PARI_PROGRAM.sub("\n", text)
    for _ in range(2):  # macros nested in macros (\emph{\kbd{x}})
        text = _PARI_UNWRAPPED.sub(lambda m: m.group(1), text)
    return squeeze_blank_lines(text.replace("\\_", "_")).strip()


def split_tex_sections(text: str) -> list[str]:
    """A TeX file → one chunk per \\chapter/\\section/\\subsec/\\subsubsec (the preamble dropped)."""
    starts = [match.start() for match in _PARI_HEADING.finditer(text)]
    return [text[start:end] for start, end in zip(starts, starts[1:] + [len(text)])]


MIN_MATH_CHARS = 80  # headings with no body (a chapter title right before its first section)


def pari_docs(package: Package) -> list[dict]:
    docs = []
    for name in PARI_FILES:
        path = pari_doc_dir(package) / name
        for number, section in enumerate(split_tex_sections(path.read_text(encoding="utf-8", errors="replace"))):
            text = detex_pari(section)
            if len(text) >= MIN_MATH_CHARS:
                docs.append({"text": text, "source": f"{PACKAGE}:{name}#{number}"})
    return docs
