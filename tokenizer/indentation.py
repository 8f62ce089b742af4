"""What indentation costs: whitespace-only tokens per indentation run after a newline.

A line's indentation run is its leading tabs (depth = number of tabs) or leading spaces (depth =
number of spaces), when the run is of one kind and followed by text. Its cost is the number of
tokens that lie wholly inside the run: "\\n", "\\t", "\\t", "return" costs 2; "\\n", "▁▁▁", "▁return"
costs 1 (the "▁" that "▁return" carries belongs to the word's token, which an unindented line needs too).
The newline itself is a separate piece ("\\n" is user-defined) and not counted.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Callable, Iterable

RUN = re.compile(r"\n(\t+|(?: )+)(?=[^\s])")
TAB_DEPTHS = range(1, 5)
"""The common tab depths the vocabulary promises one token for."""
SPACE_DEPTHS = range(2, 17)
"""The common space depths the vocabulary promises one token for."""
WHITESPACE_BYTES = {"<0x09>", "<0x20>"}
"""Byte-fallback pieces of a tab or a space (a vocabulary without a tab piece spells it so)."""


def run_cost(pieces: list[str], start: int) -> int:
    """Whitespace-only pieces from pieces[start] on, up to the first piece holding text."""
    cost = 0
    for piece in pieces[start:]:
        if piece not in WHITESPACE_BYTES and piece.strip("▁\t") != "":
            break
        cost += 1
    return cost


def indentation_costs(encode: Callable[[str], list[str]], texts: Iterable[str]) -> dict[tuple[str, int], list[int]]:
    """(kind, depth) → the cost of every indentation run of that kind and depth in `texts`.

    Each run is measured in its line's own context: "\\n" + the line, encoded alone, so that the run
    directly follows the newline piece as it does inside a document."""
    costs: dict[tuple[str, int], list[int]] = defaultdict(list)
    for text in texts:
        for match in RUN.finditer(text):
            run = match.group(1)
            kind = "tab" if run[0] == "\t" else "space"
            end = text.find("\n", match.end())
            line = text[match.start():end if end >= 0 else len(text)]
            pieces = encode(line)
            first = pieces.index("\n") + 1 if "\n" in pieces else 0
            costs[(kind, len(run))].append(run_cost(pieces, first))
    return costs


def summarize(costs: dict[tuple[str, int], list[int]]) -> dict[str, dict]:
    """Per kind and depth in the common ranges: runs measured, mean tokens per run, share costing more than one."""
    rows = {}
    for kind, depths in (("tab", TAB_DEPTHS), ("space", SPACE_DEPTHS)):
        for depth in depths:
            values = costs.get((kind, depth), [])
            if values:
                rows[f"{kind}{depth}"] = {"runs": len(values), "mean": sum(values) / len(values),
                                          "over_one": sum(v > 1 for v in values) / len(values)}
    return rows
