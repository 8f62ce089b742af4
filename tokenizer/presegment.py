"""Word segmentation of a domain's training text, so that its model's pieces never span two words.

`tokenizer.domains.<d>.presegment` names a morphological analyzer (as llm-jp-tokenizer segments
Japanese before training). The analyzer only marks boundaries: the domain's training lines are written
a second time with DELIMITER between adjacent words, and SentencePiece's own `pretokenization_delimiter`
keeps every piece inside one word and drops the delimiter from the text it scores. Nothing else sees
that file: the merge's re-estimation, the joint baseline, the held-out text and the encoder at
inference all use the plain text, so ids and round-trip are as without it.

Only boundaries between two non-whitespace characters are marked: at a space SentencePiece already
splits (the space becomes the next piece's `▁` prefix), and a delimiter there would forbid `▁word`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tokenizer.config import PRESEGMENT_CHOICES, TokenizerConfigError

Analyzer = Callable[[str], list[str]]
"""A line → its words' surfaces in order (whitespace may be left out)."""

DELIMITER = "\ue000"
"""Marks a word boundary in the training file: a private-use character, which no normaliser maps to
anything else and real text (almost) never holds; one that does is removed there (it would read as a boundary)."""

INSTALL = {"fugashi": "pip install fugashi unidic-lite", "sudachi": "pip install sudachipy sudachidict_core"}
"""The pip command that provides each analyzer, dictionary included (both ship it in the wheel: no download at run time)."""

MAX_CHUNK_CHARS = 4000
"""Analyzers see at most this much at once (Sudachi refuses inputs over ~49 kB; training lines are shorter)."""


class PresegmentUnavailable(TokenizerConfigError):
    """The configured analyzer cannot be imported or has no dictionary; the message names the pip install."""


def load_analyzer(name: str, field: str = "presegment") -> Analyzer:
    """The analyzer called `name` (fugashi or sudachi), loaded once; PresegmentUnavailable says how to install it."""
    loaders = {"fugashi": _fugashi, "sudachi": _sudachi}
    if name not in loaders:
        raise TokenizerConfigError(f"{field}={name!r}: use one of {', '.join(PRESEGMENT_CHOICES)}.")
    try:
        return loaders[name]()
    except (ImportError, RuntimeError) as err:
        raise PresegmentUnavailable(
            f"{field}={name} needs the {name} analyzer and its dictionary, which cannot be loaded here "
            f"({type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else err!r}). "
            f"Fix: {INSTALL[name]} (or {field}=none)."
        ) from None


def _fugashi() -> Analyzer:
    """MeCab with UniDic (unidic-lite): short units, e.g. 住ん|で|いる."""
    import fugashi
    import unidic_lite  # noqa: F401  # fugashi falls back to other dictionaries silently; insist on the one we measured

    tagger = fugashi.Tagger("-Owakati")
    # MeCab drops whitespace and never puts a space inside a word, so the wakati output splits cleanly.
    return lambda line: tagger.parse(line).split()


def _sudachi() -> Analyzer:
    """Sudachi with sudachidict_core, split mode C (the longest units, e.g. 東京都 and named entities)."""
    from sudachipy import SplitMode, dictionary

    tokenizer = dictionary.Dictionary(dict="core").tokenizer(mode=SplitMode.C)
    return lambda line: [m.surface() for m in tokenizer.tokenize(line)]


def word_boundaries(line: str, analyze: Analyzer) -> list[int]:
    """Character offsets inside `line` where one word ends and the next begins with no whitespace between."""
    cuts: list[int] = []
    for start in range(0, len(line), MAX_CHUNK_CHARS):
        chunk = line[start:start + MAX_CHUNK_CHARS]
        cuts += [start + cut for cut in _chunk_boundaries(chunk, analyze(chunk))]
    return cuts


def _chunk_boundaries(text: str, words: Sequence[str]) -> list[int]:
    """Ends of `words` located in order in `text`, kept where both neighbours are non-whitespace."""
    cuts, cursor = [], 0
    for word in words:
        if not word.strip():
            continue
        found = text.find(word, cursor)
        if found < 0:
            continue  # an analyzer that rewrote a word: no boundary from it rather than a wrong one
        cursor = found + len(word)
        if 0 < cursor < len(text) and not text[cursor - 1].isspace() and not text[cursor].isspace():
            cuts.append(cursor)
    return cuts


def document_boundaries(text: str, analyze: Analyzer) -> list[int]:
    """word_boundaries of a whole document (analysed line by line), as offsets into the document."""
    cuts, offset = [], 0
    for line in text.split("\n"):
        if line.strip():
            cuts += [offset + cut for cut in word_boundaries(line, analyze)]
        offset += len(line) + 1
    return cuts


def segment_line(line: str, analyze: Analyzer) -> tuple[str, int]:
    """The line with DELIMITER at each word boundary, and how many were put in."""
    line = line.replace(DELIMITER, "")
    cuts = word_boundaries(line, analyze)
    parts, last = [], 0
    for cut in cuts:
        parts.append(line[last:cut])
        last = cut
    parts.append(line[last:])
    return DELIMITER.join(parts), len(cuts)


@dataclass
class PresegmentStats:
    """What segmenting one training file did."""

    analyzer: str
    """The analyzer's name."""
    lines: int = 0
    """Lines segmented."""
    chars: int = 0
    """Characters of the lines as SentencePiece counts them (each line's text plus its '▁' prefix)."""
    boundaries: int = 0
    """Delimiters put in."""
    seconds: float = 0.0
    """Time spent analysing and writing."""

    def to_dict(self) -> dict:
        return {"analyzer": self.analyzer, "lines": self.lines, "chars": self.chars,
                "boundaries": self.boundaries, "seconds": round(self.seconds, 3)}


def write_presegmented(src: Path, dst: Path, analyzer: str) -> PresegmentStats:
    """Copy the training lines of src to dst with DELIMITER between adjacent words."""
    analyze = load_analyzer(analyzer)
    stats, start = PresegmentStats(analyzer), time.time()
    with open(src, encoding="utf-8") as fin, open(dst, "w", encoding="utf-8") as fout:
        for line in fin:
            line = line.rstrip("\n")
            segmented, cuts = segment_line(line, analyze)
            fout.write(segmented + "\n")
            stats.lines += 1
            stats.chars += len(line) + 1
            stats.boundaries += cuts
    stats.seconds = time.time() - start
    return stats


def coverage_with_delimiters(character_coverage: float, stats: PresegmentStats) -> float:
    """The character_coverage to give SentencePiece so that the real characters keep `character_coverage`.

    SentencePiece (0.2.3) counts the delimiters among the characters it covers, and as the most frequent
    character they are covered first: with ~40% of the characters being delimiters, 0.9995 would let
    rare characters worth 0.08% of the text fall to bytes instead of 0.05%. Same uncovered mass:
    (1 - c') (chars + delimiters) = (1 - c) chars."""
    if character_coverage >= 1.0 or stats.chars == 0:
        return character_coverage
    return 1.0 - (1.0 - character_coverage) * stats.chars / (stats.chars + stats.boundaries)


def crossing_tokens(spans: Iterable[tuple[int, int]], cuts: Sequence[int]) -> int:
    """How many (begin, end) spans strictly contain a boundary offset (spans and cuts in ascending order)."""
    crossing, i = 0, 0
    for begin, end in spans:
        while i < len(cuts) and cuts[i] <= begin:
            i += 1
        if i < len(cuts) and cuts[i] < end:
            crossing += 1
    return crossing
