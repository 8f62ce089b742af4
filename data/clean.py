"""Per-domain cleaning: pure functions from raw text to cleaned text or a drop reason.

`Cleaner(cfg)(text)` returns `(cleaned, None)` or `(None, reason)`; it holds no state, so any
worker can clean any document and the result depends on the text alone. De-duplication needs
state across documents and lives in the parent process (data/prepare.py); it uses
`Cleaner.key` (`content_key` in the domain's `clean.dedup` mode), the 16-byte identity of a
cleaned document, which also decides the validation split and drives the train/val overlap check.

`DropCounts` tallies drops by reason and keeps the first few locations of each (the tally
`common.corpus.ReadStats` keeps of reader skips: `count_reason`).
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass, field

from common.corpus import count_reason
from data.config import CleanConfig

# Reasons a cleaning filter drops a document (reader skips use common.corpus.SKIP_REASONS).
CLEAN_REASONS = ("empty_after_clean", "too_short", "too_long", "low_script_share", "too_many_symbols", "duplicate")

# Letters of each script, as regex character classes. "ja" counts kana and kanji (and the
# prolonged sound mark) but not Latin, so romaji-only pages score low.
_SCRIPT_CLASSES = {
    "ja": "\u3040-\u309f\u30a0-\u30ff\u31f0-\u31ff\uff66-\uff9f\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f",
    "cjk": "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f",
    "latin": "A-Za-z\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u024f\u1e00-\u1eff",
    "hangul": "\u1100-\u11ff\u3130-\u318f\uac00-\ud7af",
    "cyrillic": "\u0400-\u04ff\u0500-\u052f",
}
_NOT_SCRIPT = {name: re.compile(f"[^{chars}]+") for name, chars in _SCRIPT_CLASSES.items()}
_NOT_LETTER = re.compile(r"[\W\d_]+")  # removing these leaves the letters
_NOT_SYMBOL = re.compile(r"[^\W_]+|\s+")  # removing letters, digits, spaces leaves the symbols
# C0 controls but \t and \n, DEL, BOM. One character per match: searching is ~3x faster than with "+".
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufeff]")
# The same C0/DEL set as bytes: in UTF-8 these bytes only ever stand for those characters, so
# deleting them from the encoded text and comparing lengths finds one ~3x faster than a regex search.
_CONTROL_BYTES = bytes([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
# A literal prefix lets the regex engine jump between candidates; "\n{3,}" is ~6x slower.
_BLANK_LINES = re.compile(r"\n\n\n+")
# Whitespace as str.split() sees it, by how a key removes it: ASCII bytes are deleted from the
# UTF-8 encoding; these four survive NFKC (every other non-ASCII space becomes " ") and send a
# text down the slower str.split() path.
_ASCII_WHITESPACE_BYTES = b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f "
_NFKC_STABLE_SPACES = ("\x85", "\u1680", "\u2028", "\u2029")


class Cleaner:
    """Applies one domain's CleanConfig; call it on a text."""

    def __init__(self, cfg: CleanConfig):
        self.cfg = cfg
        self._normal_form = None if cfg.normalize == "none" else cfg.normalize

    def __call__(self, text: str) -> tuple[str | None, str | None]:
        """(cleaned text, None) if the document is kept, else (None, drop reason)."""
        cfg = self.cfg
        if self._normal_form:
            text = unicodedata.normalize(self._normal_form, text)
        if cfg.tidy_whitespace:
            text = tidy_whitespace(text, cfg.collapse_spaces)
        if not text:
            return None, "empty_after_clean"
        if len(text) < cfg.min_chars:
            return None, "too_short"
        if cfg.max_chars and len(text) > cfg.max_chars:
            return None, "too_long"
        if cfg.min_script_share > 0 and script_share(text, cfg.script) < cfg.min_script_share:
            return None, "low_script_share"
        if cfg.max_symbol_share < 1.0 and symbol_share(text) > cfg.max_symbol_share:
            return None, "too_many_symbols"
        return text, None

    def key(self, cleaned: str) -> bytes:
        """The cleaned document's content key in this domain's `dedup` mode (one key serves de-dup and the split)."""
        return content_key(cleaned, self.cfg.dedup)


def script_share(text: str, script: str) -> float:
    """Share of the text's letters that belong to `script` (a key of _SCRIPT_CLASSES); 0 when it has no letters."""
    letters = len(_NOT_LETTER.sub("", text))  # what is left after removing non-letters
    if letters == 0:
        return 0.0
    in_script = len(_NOT_SCRIPT[script].sub("", text))  # what is left after removing other characters
    # A few script characters are marks, not letters (e.g. the katakana middle dot): cap at 1.
    return min(1.0, in_script / letters)


def tidy_whitespace(text: str, collapse_spaces: bool = False) -> str:
    """Unix newlines, no control characters, no trailing spaces, at most one blank line in a row, trimmed ends.

    With `collapse_spaces`, runs of whitespace inside a line become one space and line starts are
    trimmed too (prose; never for code, where indentation is meaning). Written with str methods
    rather than regexes where it matters: this runs on every byte of the corpus.
    """
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    if has_control(text):
        text = _CONTROL.sub("", text)
    if collapse_spaces:
        text = "\n".join(" ".join(line.split()) for line in text.split("\n"))
    else:
        text = "\n".join(map(str.rstrip, text.split("\n")))
    if "\n\n\n" in text:
        text = _BLANK_LINES.sub("\n\n", text)
    return text.strip()


def has_control(text: str) -> bool:
    """Whether the text holds a character `tidy_whitespace` removes (C0 control but tab/newline, DEL, BOM)."""
    if "\ufeff" in text:
        return True
    encoded = text.encode("utf-8", "surrogatepass")  # lone surrogates are not ours to judge here
    return len(encoded.translate(None, _CONTROL_BYTES)) != len(encoded)


def symbol_share(text: str) -> float:
    """Share of characters that are neither letters, digits nor whitespace (punctuation, marks, emoji …)."""
    if not text:
        return 0.0
    return len(_NOT_SYMBOL.sub("", text)) / len(text)


def content_key(cleaned: str, mode: str) -> bytes:
    """16-byte identity (blake2b-128) of a cleaned document under a `clean.dedup` mode.

    "exact" and "off": the UTF-8 bytes of the cleaned text, so only byte-identical documents
    (after the domain's own cleaning) share a key; code keeps the indentation that is its meaning.
    "normalized": `normalized_key`, which also equates copies that differ in spacing or width.
    """
    if mode == "normalized":
        return normalized_key(cleaned)
    return hashlib.blake2b(cleaned.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def normalized_key(cleaned: str) -> bytes:
    """blake2b-128 of the text's NFKC form with all whitespace removed (the `normalized` dedup mode).

    Documents that differ only in spacing, line breaks or character width (ＡＢＣ１２３ and ABC123)
    get the same key, so de-duplication also catches copies that were spaced or cleaned differently.
    Case still matters.
    """
    canonical = cleaned
    if not cleaned.isascii() and not unicodedata.is_normalized("NFKC", cleaned):  # the check is ~20x cheaper
        canonical = unicodedata.normalize("NFKC", cleaned)
    if any(space in canonical for space in _NFKC_STABLE_SPACES):
        stripped = "".join(canonical.split()).encode("utf-8", "surrogatepass")
    else:  # only ASCII whitespace is left: delete its bytes, ~4x faster than split and join
        stripped = canonical.encode("utf-8", "surrogatepass").translate(None, _ASCII_WHITESPACE_BYTES)
    return hashlib.blake2b(stripped, digest_size=16).digest()


@dataclass
class DropCounts:
    """Documents dropped, by reason, with the first few locations of each."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, location: str) -> None:
        count_reason(self.counts, self.examples, reason, [location])

    @property
    def total(self) -> int:
        return sum(self.counts.values())
