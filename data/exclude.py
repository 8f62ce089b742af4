"""`data.exclude`: documents a run stops training on from a given step on, without re-tokenizing anything.

The file lists one document a line, as `ayumi batch` and a spike event name them: its domain, its shard (the file
name without `.bin`; a shard since merged by `ayumi data merge` too) and its index in that shard's `.idx`:

    # domain  shard       document
    en        part_00001  0
    en        part_00001:1          (the `shard:document` form `ayumi batch` prints is read too)

A sample holding any token of a listed document is *excluded*: from the global sample index its entry applies at
(`from_sample`, the stream position where the run was given the file), each excluded sample's place in the stream is
taken by the sample at the same place of the stream's next epoch (the epoch after, if that one is excluded too): a
sample drawn as if from another epoch, so it is read once more, about an epoch apart. The
stream's position holds no count of what was excluded before it, so nothing else moves: the stage
boundaries, the cursors, the other samples, so the stream is still a pure function of the global index, the same on
every rank, for a resume and for `ayumi batch`. Samples before `from_sample` are untouched: the past is the past.

A run keeps its entries in its checkpoints and in RUN_DIR/excluded_documents.json (rank 0 writes it), so a resume
honours them whatever its command line says; pretrain/excluded.py does that. Imports no torch.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from data.packed import BlendedSamples, LongDocuments, PackedSamples

LEDGER = "excluded_documents.json"
"""The run's exclusions in its run dir: [{"from_sample": P, "documents": [[domain, shard, index], ...]}, ...]."""

Document = tuple[str, str, int]
"""(domain, shard, document index in the shard's .idx)."""


class ExcludeError(ValueError):
    """A data.exclude file cannot be honoured; the message names the file, the line and the fix."""


@dataclass(frozen=True)
class Entry:
    """Documents excluded from one stream position on."""

    from_sample: int
    """The first global sample index the exclusion applies to."""
    documents: tuple[Document, ...]

    def as_dict(self) -> dict:
        return {"from_sample": self.from_sample, "documents": [list(d) for d in self.documents]}


def entry_of(record: dict) -> Entry:
    return Entry(int(record["from_sample"]), tuple((str(d), str(s), int(i)) for d, s, i in record["documents"]))


def read_exclude_file(path: str | Path) -> list[Document]:
    """The documents a data.exclude file lists, in its order without repeats; ExcludeError on a line it cannot read."""
    path = Path(path)
    if not path.is_file():
        raise ExcludeError(f"data.exclude={path}: no such file. Fix: give a file of `domain shard document` lines "
                           "(docs/stability.md)")
    out: list[Document] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        words = line.split("#", 1)[0].replace(":", " ").split()
        if not words:
            continue
        if len(words) != 3 or not words[2].isdigit():
            raise ExcludeError(f"{path}:{number}: {line.strip()!r} is not `domain shard document` (e.g. `en "
                               "part_00001 12`, as `ayumi batch` names a document); fix the line")
        document = (words[0], words[1], int(words[2]))
        if document not in out:
            out.append(document)
    return out


def document_span(samples: PackedSamples, shard: str, index: int) -> tuple[int, int] | None:
    """[first, last) token of document `index` of `shard` in the stream `samples` concatenates; None when the stream
    does not read that shard (nor a shard merged from it) or its filter leaves the document out."""
    if samples.lineage is not None:  # named by a shard since merged: its place in the present shards
        shard, index = samples.lineage.present(shard, index) or (shard, index)
    for position, reader in enumerate(samples.readers):
        if Path(reader.bin_path).stem != shard:
            continue
        offset = int(samples._starts[position])
        if isinstance(reader, LongDocuments):
            kept = np.flatnonzero(np.diff(reader.reader.doc_offsets) >= reader.min_tokens)
            at = int(np.searchsorted(kept, index))
            if at >= kept.size or int(kept[at]) != index:
                return None
            return offset + int(reader._starts[at]), offset + int(reader._starts[at + 1])
        if index + 1 >= len(reader.doc_offsets):
            return None
        return offset + int(reader.doc_offsets[index]), offset + int(reader.doc_offsets[index + 1])
    return None


def document_samples(samples: PackedSamples | BlendedSamples, shard: str, index: int) -> list[int]:
    """The sample ids of a stream holding a token of document `index` of `shard`; a weighted blend's through each
    part that reads the shard."""
    if isinstance(samples, BlendedSamples):
        return [blended for part, inner_samples in enumerate(samples.parts)
                for inner in document_samples(inner_samples, shard, index)
                for blended in samples.reading(part, inner)]
    span = document_span(samples, shard, index)
    return list(samples_holding(samples, *span)) if span else []


def document_tokens(samples: PackedSamples | BlendedSamples, shard: str, index: int) -> int:
    """Tokens of document `index` of `shard` as the stream reads it (0 where it does not)."""
    if isinstance(samples, BlendedSamples):
        return max((document_tokens(part, shard, index) for part in samples.parts), default=0)
    span = document_span(samples, shard, index)
    return span[1] - span[0] if span else 0


def samples_holding(samples: PackedSamples, first: int, last: int) -> range:
    """The sample ids of `samples` holding a token of [first, last): sample i holds [i * L, i * L + L + 1)."""
    length = samples.seq_len
    low = max(0, (first - length - 1) // length + 1)
    high = min(len(samples), (last - 1) // length + 1)
    return range(low, max(low, high))


def check_documents(documents: Iterable[Document], shards: dict[str, dict[str, int]], where: str,
                    fix: str = "fix the line") -> None:
    """Every document names a domain of the run, one of its shards (present, or merged into them) and an index
    inside it (`shards`: domain -> shard -> its document count); ExcludeError naming the first that does not."""
    for domain, shard, index in documents:
        if domain not in shards:
            raise ExcludeError(f"{where}: domain {domain!r} is not one the run trains on ({', '.join(sorted(shards))}); "
                               f"{fix}")
        if shard not in shards[domain]:
            raise ExcludeError(f"{where}: domain {domain!r} has no shard {shard!r} (it has "
                               f"{some_names(shards[domain])}), now or before a merge; {fix}")
        if not 0 <= index < shards[domain][shard]:
            raise ExcludeError(f"{where}: shard {domain}/{shard} holds documents 0-{shards[domain][shard] - 1}, not "
                               f"{index}; {fix}")


def some_names(names: Iterable[str], shown: int = 8) -> str:
    """The first `shown` names, sorted, and how many there are in all when there are more (a root may hold
    10,000 shards a domain)."""
    names = sorted(names)
    return ", ".join(names) if len(names) <= shown else f"{', '.join(names[:shown])}, ... ({len(names):,} in all)"


def stream_shards(samples: PackedSamples | BlendedSamples) -> dict[str, int]:
    """shard name -> documents, of the shards a stream reads, and of those merged into them (data/lineage.py)."""
    if isinstance(samples, BlendedSamples):
        out: dict[str, int] = {}
        for part in samples.parts:
            out.update(stream_shards(part))
        return out
    out = samples.lineage.shards() if samples.lineage is not None else {}
    for reader in samples.readers:
        inner = reader.reader if isinstance(reader, LongDocuments) else reader
        out[Path(reader.bin_path).stem] = len(inner.doc_offsets) - 1
    return out


class Exclusion:
    """The compiled exclusions of one sample source: per stream, sample id -> the first global index it is excluded
    from. `replacement` walks a stream's order past excluded samples (the module doc)."""

    MAX_EPOCHS = 64
    """Later epochs a replacement is looked for in before the stream is taken for all excluded."""

    def __init__(self, streams: Sequence[tuple[str, PackedSamples | BlendedSamples]], entries: Sequence[Entry],
                 pooled: bool = False):
        """`streams`: (domain, samples) of each stream of the source, in the source's stream order. `pooled`: the
        streams share one order (the shuffled stream), so a replacement may come from another stream."""
        self.entries = list(entries)
        self.by_stream: list[dict[int, int]] = []
        for domain, samples in streams:
            excluded: dict[int, int] = {}
            for entry in sorted(self.entries, key=lambda e: -e.from_sample):  # the earliest entry wins a tie
                for name, shard, index in entry.documents:
                    if name != domain:
                        continue
                    for sample in document_samples(samples, shard, index):
                        excluded[sample] = entry.from_sample
            self.by_stream.append(excluded)
        self.refuse_an_emptied_stream(streams, pooled)

    def refuse_an_emptied_stream(self, streams, pooled: bool) -> None:
        """ExcludeError, at the start, where every sample a replacement could come from is excluded."""
        sizes = [len(samples) for _, samples in streams]
        counts = self.counts()
        if pooled and sizes and sum(counts) >= sum(sizes):
            raise ExcludeError(f"data.exclude leaves no sample to train on: its documents fill all {sum(sizes):,} "
                               "samples of the run's data. Fix: exclude fewer documents")
        for (domain, _), size, count in zip(streams, sizes, counts):
            if not pooled and count >= size:
                raise ExcludeError(f"data.exclude leaves no sample of domain {domain!r} to train on: its documents "
                                   f"fill all {size:,} samples of that stream. Fix: exclude fewer documents")

    def __bool__(self) -> bool:
        return any(self.by_stream)

    def excluded(self, stream: int, sample: int, position: int) -> bool:
        since = self.by_stream[stream].get(sample)
        return since is not None and since <= position

    def replacement(self, stream: int, cursor: int, position: int, order) -> tuple[int, int]:
        """(epoch, sample id) that takes the place of the excluded sample at `cursor` of a stream (`order` its
        EpochPermutation): the one at the same place of the next epoch's order holding no excluded document."""
        _, epoch, sample = self.later_epoch(lambda epochs: (stream, *order(cursor + epochs * order.num_samples)),
                                            position)
        return epoch, sample

    def later_epoch(self, place, position: int) -> tuple[int, int, int]:
        """The first of `place(1)`, `place(2)`, ... (stream, epoch, sample id at the same place of a later epoch)
        holding no document excluded at stream `position`."""
        for epochs in range(1, self.MAX_EPOCHS + 1):
            found = place(epochs)
            if not self.excluded(found[0], found[2], position):
                return found
        raise ExcludeError(f"data.exclude leaves no sample to train on at stream position {position} (none in "
                           f"{self.MAX_EPOCHS} later epochs); exclude fewer documents")

    def counts(self) -> list[int]:
        """Excluded samples per stream."""
        return [len(excluded) for excluded in self.by_stream]


def read_ledger(run_dir: str | Path) -> list[Entry]:
    path = Path(run_dir) / LEDGER
    if not path.is_file():
        return []
    return [entry_of(record) for record in json.loads(path.read_text(encoding="utf-8"))["entries"]]


def merged(entries: Iterable[Entry]) -> list[Entry]:
    """Entries without repeats, by first position."""
    seen: list[Entry] = []
    for entry in entries:
        if entry not in seen:
            seen.append(entry)
    return sorted(seen, key=lambda e: e.from_sample)


def covered(entries: Iterable[Entry]) -> set[Document]:
    return {document for entry in entries for document in entry.documents}
