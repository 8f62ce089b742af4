"""Word segmentation of a domain's training text, so that its model's pieces never span two words.

`tokenizer.domains.<d>.presegment` names a morphological analyzer (llm-jp-tokenizer v2 segments Japanese
with one before training). The analyzer only marks boundaries; the domain model is then trained on the
sample's *word counts* (SentencePiece's `input_format=tsv`: one "word<TAB>count" per line), so no piece
can span two words. The unigram EM is the same as on the running text with boundaries marked (pieces
cannot cross a boundary, so a line's lattice is the product of its words' lattices), and SentencePiece's
seed extraction sees every word's end as a hard boundary.

Why not SentencePiece's `pretokenization_delimiter` (a character between words, which it drops): in
sentencepiece 0.2.3 its seed candidates are the substrings followed by two different characters in the
text, and with the delimiter after every word a word is a candidate only where it also appears not
followed by one. On manpages-ja (demo_8k, 4,800 pieces) that left 117 of the 300 most frequent
words out of the vocabulary (場合, この, デフォルト, ファイル…) and cost 30% of the model's chars/token
against no segmentation; word counts cost 10.5% (bench/tokenizer_presegment.py, docs/tokenizer.md).

A word here is what lies between two boundaries, with the whitespace before it ('▁' to SentencePiece):
only boundaries between two non-whitespace characters are marked, since at a space SentencePiece already
starts a new piece (`▁word`). Each line's first word carries the dummy-prefix space the line would get.
Only the domain model's training changes: the merge, the joint baseline, the held-out text and the
encoder at inference see the plain text, so ids and round-trip are as without it.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from tokenizer.errors import TokenizerConfigError

Analyzer = Callable[[str], list[str]]
"""A line → its words' surfaces in order (whitespace may be left out)."""

INSTALL = {"fugashi": "pip install fugashi unidic-lite", "sudachi": "pip install sudachipy sudachidict_core"}
"""The pip command that provides each analyzer, dictionary included (both ship it in the package: no download at run time)."""

MAX_CHUNK_CHARS = 4000
"""Analyzers see at most this much at once (Sudachi refuses inputs over ~49 kB; training lines are shorter)."""


class PresegmentUnavailable(TokenizerConfigError):
    """The configured analyzer cannot be imported or has no dictionary; the message names the pip install."""


def load_analyzer(name: str, field: str = "presegment") -> Analyzer:
    """The analyzer called `name` (fugashi or sudachi), loaded once; PresegmentUnavailable says how to install it."""
    loaders = {"fugashi": _fugashi, "sudachi": _sudachi}
    if name not in loaders:
        raise TokenizerConfigError(f"{field}={name!r}: use one of {', '.join(('none', *loaders))}.")
    try:
        return loaders[name]()
    except (ImportError, RuntimeError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise PresegmentUnavailable(
            f"{field}={name} needs the {name} analyzer and its dictionary, which cannot be loaded here "
            f"({type(err).__name__}: {reason}). Fix: {INSTALL[name]} (or {field}=none)."
        ) from None


def _fugashi() -> Analyzer:
    """MeCab with UniDic (unidic-lite): short units, e.g. 住ん|で|いる."""
    import fugashi
    import unidic_lite  # noqa: F401  # fugashi would fall back to another installed dictionary silently

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


def split_words(line: str, analyze: Analyzer) -> list[str]:
    """The line cut at its word boundaries (the pieces join back to the line)."""
    cuts = word_boundaries(line, analyze)
    return [line[a:b] for a, b in zip([0] + cuts, cuts + [len(line)])]


@dataclass
class PresegmentStats:
    """What segmenting one training file did."""

    analyzer: str
    """The analyzer's name."""
    lines: int = 0
    """Training lines segmented."""
    words: int = 0
    """Words counted (a line with n boundaries has n + 1)."""
    distinct: int = 0
    """Distinct words: the lines SentencePiece trains on."""
    tabs: int = 0
    """Tab characters left out (the word list's separator; the merge keeps every domain's characters and tab runs)."""
    seconds: float = 0.0
    """Time spent analysing, counting and writing."""

    def to_dict(self) -> dict:
        return {"analyzer": self.analyzer, "lines": self.lines, "words": self.words, "distinct": self.distinct,
                "tabs": self.tabs, "seconds": round(self.seconds, 3)}


def count_words(lines: Iterable[str], analyze: Analyzer, dummy_prefix: bool, stats: PresegmentStats) -> Counter:
    """word → count over `lines`; each line's first word gets the ' ' SentencePiece's dummy prefix would add."""
    counts: Counter = Counter()
    for line in lines:
        words = split_words(line, analyze)
        if dummy_prefix:
            words[0] = " " + words[0]
        for word in words:
            # A tab would end the word list's first column: it stays out, as a boundary.
            parts = word.split("\t")
            stats.tabs += len(parts) - 1
            counts.update(p for p in parts if p)
        stats.lines += 1
        stats.words += len(words)
    return counts


def write_word_counts(src: Path, dst: Path, analyzer: str, dummy_prefix: bool) -> PresegmentStats:
    """Segment the training lines of src with `analyzer` and write their word counts to dst (word<TAB>count)."""
    analyze = load_analyzer(analyzer)
    stats, start = PresegmentStats(analyzer), time.time()
    with open(src, encoding="utf-8") as f:
        counts = count_words((line.rstrip("\n") for line in f), analyze, dummy_prefix, stats)
    with open(dst, "w", encoding="utf-8") as f:
        for word, count in counts.most_common():
            f.write(f"{word}\t{count}\n")
    stats.distinct = len(counts)
    stats.seconds = time.time() - start
    return stats


def crossing_tokens(spans: Iterable[tuple[int, int]], cuts: Sequence[int]) -> int:
    """How many (begin, end) spans strictly contain a boundary offset (spans and cuts in ascending order)."""
    crossing, i = 0, 0
    for begin, end in spans:
        while i < len(cuts) and cuts[i] <= begin:
            i += 1
        if i < len(cuts) and cuts[i] < end:
            crossing += 1
    return crossing
