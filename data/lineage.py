"""A domain's merge history: the shards each split was merged from, back to the shards it was prepared in.

`ayumi data merge` (data/merge.py) rewrites a split's shards as fewer, the documents in the same order. Each merge
appends to the record's `merged` list the shards it replaced (`shards`: split -> one list per field of
HISTORY_FIELDS, in order). Columns, because every run start parses and seals them: 20,000 shards take ~50 ms so,
~140 ms as shard records. A run names its data by shards: its checkpoints record what the shards held (the
domain fingerprints), and its `data.exclude` documents are (domain, shard, index). Both read them through here:

- the identity of a split is that of the shards it was first written in (`original_fields`), so a run resumes
  across a merge, and a split prepared again with other content (other checksums) is still a change;
- a document named by a shard of any generation has one place in the present shards (`Lineage.present`): a
  shard's documents are a contiguous run of the split's documents in every generation.

The history sits in the sealed record, as trusted as the shard list. A history whose documents or tokens
disagree with its split is refused like any damaged record (`history_problem`). A merge recorded before the
history kept shard lists (only `shards_before`, counts) has no generations: the present shards stand for it.
"""
from __future__ import annotations

from functools import cached_property
from itertools import accumulate

import numpy as np


HISTORY_FIELDS = ("name", "docs", "tokens", "bytes", "sha256")
"""What a merge keeps of each shard it replaced: what identifies the data (data/domains.py's fingerprint, a
checkpoint's data identity) and where each document went (`Lineage`)."""


def history_columns(shards: list[dict]) -> dict[str, list]:
    """The shards a merge replaces, as the record keeps them: one list per field of HISTORY_FIELDS."""
    return {field: [shard.get(field) for shard in shards] for field in HISTORY_FIELDS}


def past_columns(record: dict, split: str) -> list[dict[str, list]]:
    """The shards a split had before each of its merges, oldest first, as the record keeps them (columns)."""
    return [entry["shards"][split] for entry in record.get("merged", []) if split in entry.get("shards", {})]


def shard_names(record: dict, split: str) -> set[str]:
    """Every name a shard of the split has had, present or replaced."""
    names = {shard["name"] for shard in record["splits"][split]["shards"]}
    return names.union(*(columns["name"] for columns in past_columns(record, split)))


def original_fields(record: dict, split: str, fields: tuple[str, ...]) -> list[list]:
    """Of each shard the split was first written in, in order, the values of `fields` (None where it has none: a
    merged shard has no `prefix`). Read from the columns as they are: 10,000 shards in a few ms."""
    past = past_columns(record, split)
    if not past:
        return [[shard.get(field) for field in fields] for shard in record["splits"][split]["shards"]]
    columns = past[0]
    missing = [None] * len(columns["name"])
    return [list(row) for row in zip(*(columns.get(field, missing) for field in fields))]


def history_problem(record: dict) -> str | None:
    """What is wrong with a record's merge history (a generation of other documents or tokens than its split), or
    None."""
    for number, entry in enumerate(record.get("merged", []), 1):
        for split, columns in entry.get("shards", {}).items():
            if sorted(columns) != sorted(HISTORY_FIELDS) or len({len(values) for values in columns.values()}) != 1:
                return f"merge {number} lists the {split} shards it replaced in columns of other names or lengths"
            info = record["splits"].get(split)
            held = (sum(columns["docs"]), sum(columns["tokens"]))
            if info is None or held != (info["docs"], info["tokens"]):
                now = "no such split" if info is None else f"{info['docs']} documents, {info['tokens']} tokens"
                return (f"merge {number} lists {held[0]} documents, {held[1]} tokens in the {split} shards it "
                        f"replaced; the split holds {now}")
    return None


class Lineage:
    """Every shard name a split has had, and where each one's documents are among the present shards. Built on
    first use (data.exclude): opening a merged root reads no more of its history than its identity needs."""

    def __init__(self, record: dict, split: str):
        self.record, self.split = record, split

    def __bool__(self) -> bool:
        return bool(past_columns(self.record, self.split))

    @cached_property
    def present_shards(self) -> tuple[list[str], dict[str, int], np.ndarray]:
        """(names, name -> documents, first document of each in the split) of the present shards."""
        present = self.record["splits"][self.split]["shards"]
        return ([shard["name"] for shard in present], {shard["name"]: shard["docs"] for shard in present},
                np.cumsum([0] + [shard["docs"] for shard in present]))

    @cached_property
    def past(self) -> dict[str, tuple[int, int]]:
        """An old shard's name -> (its first document in the split, its documents)."""
        past: dict[str, tuple[int, int]] = {}
        for columns in past_columns(self.record, self.split):
            firsts = accumulate(columns["docs"][:-1], initial=0)
            for name, first, docs in zip(columns["name"], firsts, columns["docs"]):
                past.setdefault(name, (first, docs))
        return past

    def shards(self) -> dict[str, int]:
        """name -> documents, of every shard the split has had (the present ones win a name)."""
        return {**{name: docs for name, (_, docs) in self.past.items()}, **self.present_shards[1]}

    def present(self, shard: str, index: int) -> tuple[str, int] | None:
        """(present shard, index in it) of document `index` of `shard`, a shard the split has or had; None when it
        never had that shard or that document."""
        names, docs, starts = self.present_shards
        if shard in docs:
            return (shard, index) if 0 <= index < docs[shard] else None
        if shard not in self.past or not 0 <= index < self.past[shard][1]:
            return None
        at = self.past[shard][0] + index
        position = int(np.searchsorted(starts, at, side="right")) - 1
        return names[position], at - int(starts[position])
