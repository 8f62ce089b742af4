"""A domain's merge history: the shards each split was merged from, back to the shards it was prepared in.

`ayumi data merge` (data/merge.py) rewrites a split's shards as fewer, the documents in the same order. Each merge
appends to the record's `merged` list the shard records it replaced (`shards`: split -> list, in order). A run
names its data by shards: its checkpoints record what the shards held (the domain fingerprints), and its
`data.exclude` documents are (domain, shard, index). Both read the shards through here:

- the identity of a split is that of the shards it was first written in (`original_shards`), so a run resumes
  across a merge, and a change of content (another sha256 in any generation) is still a change;
- a document named by a shard of any generation has one place in the present shards (`Lineage.present`): a
  shard's documents are a contiguous run of the split's documents in every generation.

The history sits in the sealed record, as trusted as the shard list. A history whose documents or tokens
disagree with its split is refused like any damaged record (`history_problem`). A merge recorded before the
history kept shard lists (only `shards_before`, counts) has no generations: the present shards stand for it.
"""
from __future__ import annotations

import numpy as np


def generations(record: dict, split: str) -> list[list[dict]]:
    """The shard lists a split has had, oldest first, the present one last."""
    past = [entry["shards"][split] for entry in record.get("merged", []) if split in entry.get("shards", {})]
    return [*past, record["splits"][split]["shards"]]


def original_shards(record: dict, split: str) -> list[dict]:
    """The shards a split was prepared in (its present ones when it was never merged)."""
    return generations(record, split)[0]


def history_problem(record: dict) -> str | None:
    """What is wrong with a record's merge history (a generation of other documents or tokens than its split), or
    None."""
    for number, entry in enumerate(record.get("merged", []), 1):
        for split, shards in entry.get("shards", {}).items():
            info = record["splits"].get(split)
            held = (sum(shard["docs"] for shard in shards), sum(shard["tokens"] for shard in shards))
            if info is None or held != (info["docs"], info["tokens"]):
                now = "no such split" if info is None else f"{info['docs']} documents, {info['tokens']} tokens"
                return (f"merge {number} lists {held[0]} documents, {held[1]} tokens in the {split} shards it "
                        f"replaced; the split holds {now}")
    return None


class Lineage:
    """Every shard name a split has had, and where each one's documents are among the present shards."""

    def __init__(self, record: dict, split: str):
        *past, present = generations(record, split)
        self.names = [shard["name"] for shard in present]
        self.docs = {shard["name"]: shard["docs"] for shard in present}
        self.starts = np.cumsum([0] + [shard["docs"] for shard in present])
        self.past: dict[str, tuple[int, int]] = {}
        """An old shard's name -> (its first document in the split, its documents)."""
        for shards in past:
            first = 0
            for shard in shards:
                self.past.setdefault(shard["name"], (first, shard["docs"]))
                first += shard["docs"]

    def __bool__(self) -> bool:
        return bool(self.past)

    def shards(self) -> dict[str, int]:
        """name -> documents, of every shard the split has had (the present ones win a name)."""
        return {**{name: docs for name, (_, docs) in self.past.items()}, **self.docs}

    def present(self, shard: str, index: int) -> tuple[str, int] | None:
        """(present shard, index in it) of document `index` of `shard`, a shard the split has or had; None when it
        never had that shard or that document."""
        if shard in self.docs:
            return (shard, index) if 0 <= index < self.docs[shard] else None
        if shard not in self.past or not 0 <= index < self.past[shard][1]:
            return None
        at = self.past[shard][0] + index
        position = int(np.searchsorted(self.starts, at, side="right")) - 1
        return self.names[position], at - int(self.starts[position])
