"""English: Jane Austen's six novels from Debian's r-cran-janeaustenr, one document per chapter.

The package stores each novel as an R character vector (a line per element) in its lazy-load
database, read here with demo.rdata; no R needed.
"""
from __future__ import annotations

import re
from pathlib import Path

from demo.base import DemoCorpusError
from demo.debian import Package
from demo.rdata import read_lazyload_db

PACKAGE = "r-cran-janeaustenr"

AUSTEN_TITLES = {
    "sensesensibility": "Sense and Sensibility", "prideprejudice": "Pride and Prejudice",
    "mansfieldpark": "Mansfield Park", "emma": "Emma", "northangerabbey": "Northanger Abbey",
    "persuasion": "Persuasion",
}
_CHAPTER_HEADING = re.compile(r"^\s*chapter\s+([0-9]+|[ivxlc]+)\b\.?\s*$", re.IGNORECASE)
_VOLUME_HEADING = re.compile(r"^\s*volume\s+([0-9]+|[ivxlc]+)\b\.?\s*$", re.IGNORECASE)


def austen_rdx(package: Package) -> Path:
    return package.root / "usr/lib/R/site-library/janeaustenr/data/Rdata.rdx"


def split_chapters(lines: list[str | None]) -> list[str]:
    """A novel's lines → one text per chapter (front matter and volume headings dropped).

    The package stores a line per element, paragraphs separated by empty elements: lines of a
    paragraph are joined with spaces, paragraphs with a blank line; each chapter keeps its heading.
    """
    chapters: list[list[str]] = []
    for line in lines:
        line = (line or "").strip()
        if _CHAPTER_HEADING.match(line):
            chapters.append([line, ""])
        elif chapters and not _VOLUME_HEADING.match(line):
            chapters[-1].append(line)
    return [_join_paragraphs(chapter) for chapter in chapters]


def _join_paragraphs(lines: list[str]) -> str:
    paragraphs, current = [], []
    for line in lines + [""]:
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    return "\n\n".join(paragraphs)


def austen_docs(package: Package) -> list[dict]:
    books = read_lazyload_db(austen_rdx(package))
    docs = []
    for key, title in AUSTEN_TITLES.items():
        if key not in books:
            raise DemoCorpusError(f"{austen_rdx(package)}: no novel {key!r} (has {sorted(books)})")
        for number, chapter in enumerate(split_chapters(books[key]), start=1):
            docs.append({"text": chapter, "source": f"{PACKAGE}:{key}:chapter{number}"})
    return docs
