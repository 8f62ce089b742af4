"""Japanese: Debian's manpages-ja rendered with groff, and the quality filter behind ja_clean.

One document per man page (symlinks and `.so` aliases skipped): groff renders the troff source
to UTF-8 text, the page header and footer are dropped, and the spaces troff leaves between
Japanese characters where it joined lines are removed. `JA_CLEAN_FILTER` keeps the pages that
are mostly Japanese prose (share of kana/kanji among the letters, length, symbol density):
ja_raw is every page, ja_clean the pages that pass.
"""
from __future__ import annotations

import gzip
import re
import shutil
import subprocess
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from demo import debian
from demo.base import DemoCorpusError, Progress, SourceUnavailable, squeeze_blank_lines

PACKAGE = "manpages-ja"

# Tables (-t), input encoding detection (-k), no justification (AD=l), one long page (cR=1) with
# long lines (LL) so paragraphs are not hard-wrapped, and no overstrike/colour/SGR (-P-cbou).
GROFF_COMMAND = ["groff", "-t", "-k", "-Tutf8", "-man", "-dAD=l", "-rLL=1000n", "-rcR=1", "-P-cbou"]
GROFF_TIMEOUT_S = 60

# Kana, kanji, the prolonged sound mark and Japanese punctuation / full-width forms: the characters
# between which a line join leaves a space that Japanese never writes.
_JA_CHAR = "\u3000-\u303f\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
_JA_SINGLE_SPACE = re.compile(f"(?<=[{_JA_CHAR}]) (?=[{_JA_CHAR}])")
_KANA_KANJI = re.compile("[\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LETTER = re.compile(r"[^\W\d_]")
_SYMBOL = re.compile(r"[^\w\s]|_")


def join_japanese_spaces(text: str) -> str:
    """Remove the single spaces left between two Japanese characters where lines were joined.

    troff joins source lines with a space; Japanese has no word spaces, so "場合、 要素" becomes
    "場合、要素". Spaces next to Latin text ("-l と合わせて") and runs of spaces (tables) stay.
    """
    return _JA_SINGLE_SPACE.sub("", text)


def is_alias_page(source: str) -> bool:
    """A man page that only points at another (`.so man3/other.3`): rendering it repeats the target."""
    lines = [line.strip() for line in source.splitlines()]
    content = [line for line in lines if line and not line.startswith(('.\\"', "'\\\""))]  # troff comments
    return bool(content) and all(line.startswith(".so ") for line in content)


def man_root(package: debian.Package) -> Path:
    """Where the unpacked package keeps its Japanese pages (man1/, man2/, ...)."""
    return package.root / "usr/share/man/ja"


def man_page_files(man_root: Path) -> list[Path]:
    """Every regular gzipped page under man_root (symlinks are other names for pages already listed)."""
    return sorted(path for path in man_root.rglob("*.gz") if path.is_file() and not path.is_symlink())


def render_man_page(source: bytes) -> str:
    """groff's UTF-8 text of one troff page (DemoCorpusError if groff fails)."""
    result = subprocess.run(GROFF_COMMAND, input=source, capture_output=True, timeout=GROFF_TIMEOUT_S)
    if result.returncode != 0:
        raise DemoCorpusError(f"groff exited {result.returncode}: {result.stderr.decode('utf-8', 'replace')[-300:]}")
    return result.stdout.decode("utf-8", "replace")


def clean_rendered_page(rendered: str) -> str:
    """Rendered page → document: no header/footer line, no indentation, NFC, Japanese spacing fixed."""
    lines = rendered.splitlines()
    content = [i for i, line in enumerate(lines) if line.strip()]
    if len(content) < 3:
        return ""
    body = lines[content[0] + 1:content[-1]]  # the first and last lines are the page header and footer
    text = "\n".join(line.strip() for line in body)
    text = join_japanese_spaces(unicodedata.normalize("NFC", text))
    return squeeze_blank_lines(text).strip()


def man_page_doc(path: Path, man_root: Path) -> dict | None:
    """One page as a document ({"text", "source"}), or None for an alias or an empty rendering."""
    source = gzip.decompress(path.read_bytes())
    if is_alias_page(source.decode("utf-8", "replace")):
        return None
    text = clean_rendered_page(render_man_page(source))
    name = path.relative_to(man_root).as_posix().removesuffix(".gz")
    return {"text": text, "source": f"{PACKAGE}:{name}"} if text else None


@dataclass(frozen=True)
class QualityFilter:
    """Document-level quality thresholds (a curation team's first pass over a Japanese crawl)."""

    min_chars: int = 400
    """Shorter pages are stubs: a name line and a pointer elsewhere."""
    max_chars: int = 60_000
    """Longer pages are mostly generated reference tables."""
    min_japanese_share: float = 0.5
    """Kana+kanji share among the letters; below it the page is mostly untranslated English or code."""
    max_symbol_share: float = 0.12
    """Punctuation/symbol share of all characters; above it the page is mostly option syntax and examples."""

    def reason(self, text: str) -> str | None:
        """Why the document fails the filter (too_short, too_long, low_japanese_share, too_many_symbols), or None."""
        if len(text) < self.min_chars:
            return "too_short"
        if len(text) > self.max_chars:
            return "too_long"
        if japanese_share(text) < self.min_japanese_share:
            return "low_japanese_share"
        if symbol_share(text) > self.max_symbol_share:
            return "too_many_symbols"
        return None


JA_CLEAN_FILTER = QualityFilter()


def japanese_share(text: str) -> float:
    """Share of the letters that are kana or kanji (0 when there are no letters)."""
    letters = len(_LETTER.findall(text))
    return len(_KANA_KANJI.findall(text)) / letters if letters else 0.0


def symbol_share(text: str) -> float:
    """Share of non-space characters that are punctuation or symbols (not letters or digits)."""
    visible = len(text) - sum(1 for char in text if char.isspace())
    return len(_SYMBOL.findall(text)) / visible if visible else 0.0


def split_by_quality(docs: list[dict], quality: QualityFilter = JA_CLEAN_FILTER) -> tuple[list[dict], dict[str, int]]:
    """(documents that pass, drop counts by reason)."""
    kept, dropped = [], {}
    for doc in docs:
        reason = quality.reason(doc["text"])
        if reason is None:
            kept.append(doc)
        else:
            dropped[reason] = dropped.get(reason, 0) + 1
    return kept, dict(sorted(dropped.items()))


def ensure_groff(progress: Progress = print) -> None:
    """groff on PATH, installing Debian's groff-base if allowed (root + apt-get); else SourceUnavailable."""
    if shutil.which("groff"):
        return
    if debian.can_install():
        progress("groff is missing; installing Debian's groff-base to render the Japanese man pages "
                 "(apt-get install -y groff-base) ...")
        debian.install("groff-base")
        if shutil.which("groff"):
            return
        raise SourceUnavailable("groff-base was installed but `groff` is still not on PATH")
    raise SourceUnavailable("groff is needed to render the Japanese man pages: install it "
                            "(Debian/Ubuntu: `sudo apt-get install groff-base`)")
