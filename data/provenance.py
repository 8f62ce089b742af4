"""Where a training sample's tokens come from: the shard, the document and the token span inside it.

A sample is a window of a domain's token stream (data/packed.py), so it may hold the end of one document, whole
short ones and the start of the next. `sample_pieces` names each of them: the shard (its file name without
suffix), the document's index in that shard's `.idx`, and the span [start, stop) of the document's tokens the
sample holds (an appended end-of-document token counts as the document's last). Reads only the shards' indexes,
never their tokens, and imports no torch, so a command and the trainer both use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.packed import BlendedSamples, LongDocuments, PackedSamples


@dataclass(frozen=True)
class Piece:
    """One document's part of a sample."""

    shard: str
    """The shard's file name without `.bin` (ayumi's `train_00000`, or a Megatron prefix's name)."""
    document: int
    """The document's index in the shard's `.idx` (for a filtered stream too: the shard's own numbering)."""
    start: int
    """First token of the document in the sample."""
    stop: int
    """One past the last token of the document in the sample."""
    length: int
    """The document's tokens (its end-of-document token included)."""

    def as_dict(self) -> dict:
        return {"shard": self.shard, "document": self.document, "start": self.start, "stop": self.stop,
                "length": self.length}


def reader_pieces(reader, start: int, stop: int) -> list[Piece]:
    """The documents of tokens [start, stop) of one reader's stream (a shard, with appended EODs or filtered)."""
    if isinstance(reader, LongDocuments):
        lengths = np.diff(reader.reader.doc_offsets)
        kept = np.flatnonzero(lengths >= reader.min_tokens)  # the filter LongDocuments applies, in its order
        bounds, names = reader._starts, kept
    else:  # a ShardReader, or EodAppended (whose offsets count the separators)
        bounds, names = reader.doc_offsets, None
    shard = Path(reader.bin_path).stem
    pieces = []
    position = start
    doc = int(np.searchsorted(bounds, position, side="right")) - 1
    while position < stop:
        while int(bounds[doc + 1]) <= position:  # empty documents hold no token of the sample
            doc += 1
        first, end = int(bounds[doc]), int(bounds[doc + 1])
        take = min(stop, end)
        name = int(names[doc]) if names is not None else doc
        pieces.append(Piece(shard, name, position - first, take - first, end - first))
        position = take
        doc += 1
    return pieces


def sample_pieces(samples: PackedSamples | BlendedSamples, index: int) -> list[Piece]:
    """The documents sample `index` of a domain's samples holds, in order (see the module doc)."""
    if isinstance(samples, BlendedSamples):
        part, inner = samples.locate(index)
        return sample_pieces(samples.parts[part], inner)
    start = index * samples.seq_len
    stop = start + samples.seq_len + 1
    pieces = []
    shard = int(np.searchsorted(samples._starts, start, side="right")) - 1
    position = start
    while position < stop:
        offset = int(samples._starts[shard])
        take = min(stop, int(samples._starts[shard + 1]))
        pieces += reader_pieces(samples.readers[shard], position - offset, take - offset)
        position = take
        shard += 1
    return pieces


def describe(pieces: list[Piece]) -> str:
    """`shard:document[start:stop]` for each piece, joined by ` + ` (the table's column)."""
    return " + ".join(f"{p.shard}:{p.document}[{p.start}:{p.stop}]" for p in pieces)

