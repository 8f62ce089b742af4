"""Excluded data: the documents `data.exclude` took out of the run, and from which stream position on.

A session given `data.exclude=FILE` adds one entry: the file's documents not already excluded, from the stream
position it starts training at (data/exclude.py says what excluding does to the stream). Entries live in the
checkpoint (the trainer's shared state) and in the run dir (`excluded_documents.json`, rank 0 writes it), like the
skip ledger (pretrain/skips.py): a resume honours them whatever its command line says, a resume from an older
checkpoint too, and `ayumi batch` reads the same file to name what each step trained on. Entries keep the shard
names they were given; after `ayumi data merge` they name shards merged since, and data/lineage.py finds their
documents in the merged ones. A document no shard of the root holds or held stops the run at the start.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from curriculum.mixer import Mixer
from data.exclude import (
    LEDGER, Entry, Exclusion, check_documents, covered, entry_of, merged, read_exclude_file, read_ledger, stream_shards,
)
from data.manifest import write_json_atomic


class ExcludedData:
    """The run's exclusions and the sample source they apply to."""

    def __init__(self, run_dir: Path, source, is_main: bool):
        self.path = Path(run_dir) / LEDGER
        self.source = source
        self.is_main = is_main
        self.entries: list[Entry] = read_ledger(run_dir)

    def add(self, records: Iterable[dict]) -> None:
        """Merge entries from a checkpoint's state."""
        self.entries = merged([*self.entries, *(entry_of(r) for r in records)])

    def begin(self, exclude_file: str | None, position: int) -> Entry | None:
        """This session's start at stream `position`: the file's new documents become an entry from there on; every
        entry is applied to the source. Returns the new entry (None: nothing new)."""
        new = None
        if exclude_file:
            documents = read_exclude_file(exclude_file)
            check_documents(documents, source_shards(self.source), str(exclude_file))
            fresh = tuple(d for d in documents if d not in covered(self.entries))
            if fresh:
                new = Entry(position, fresh)
                self.entries = merged([*self.entries, new])
        if self.entries:
            apply_entries(self.source, self.entries)
            if self.is_main:
                write_json_atomic(self.path, {"entries": [entry.as_dict() for entry in self.entries]})
        return new

    def state(self) -> list[dict]:
        return [entry.as_dict() for entry in self.entries]


def source_streams(source) -> list[tuple[str, Any]]:
    """(domain, samples) of each stream of a sample source, in its stream order: the curriculum mixer's streams, or
    every domain of the shuffled stream."""
    if isinstance(source, Mixer):
        return source.stream_samples()
    return list(source.domains.items())


def stream_names(source) -> list[str]:
    return [stream.name for stream in source.streams] if isinstance(source, Mixer) else list(source.domains)


def apply_entries(source, entries: list[Entry]) -> None:
    """Leave out the entries' documents from each one's position on (data/exclude.py says how). A document the data
    does not hold, under its shard's name now or before a merge, is refused: an exclusion is never dropped."""
    check_documents(sorted(covered(entries)), source_shards(source), f"the run's excluded documents ({LEDGER})",
                    "the data root is not the one the run excluded them from. Fix: restore that data root, or start "
                    "a new run")
    source.exclusion = Exclusion(source_streams(source), entries, pooled=not isinstance(source, Mixer)) or None


def source_shards(source) -> dict[str, dict[str, int]]:
    """domain -> shard -> documents, over every stream of a sample source (the mixer's, or every domain)."""
    out: dict[str, dict[str, int]] = {}
    for domain, samples in source_streams(source):
        out.setdefault(domain, {}).update(stream_shards(samples))
    return out


def apply_ledger(source, run_dir: Path) -> None:
    """The run's recorded exclusions on a rebuilt source (`ayumi batch`): the stream as the run trained it."""
    entries = read_ledger(run_dir)
    if entries:
        apply_entries(source, entries)


def plan_lines(cfg) -> list[str]:
    """What `ayumi plan` says of data.exclude: the documents, their tokens and the samples of each stream it takes
    out (ExcludeError for a file it cannot honour). Opens the data as training does, sizes checked only."""
    from data.exclude import document_tokens
    from pretrain.stream import open_training_data, sample_source

    if not cfg.data.exclude:
        return []
    documents = read_exclude_file(cfg.data.exclude)
    train, _ = open_training_data(cfg, verify="sizes", validation=False)
    source = sample_source(cfg, train)
    check_documents(documents, source_shards(source), str(cfg.data.exclude))
    streams, names = source_streams(source), stream_names(source)
    counts = Exclusion(streams, [Entry(0, tuple(documents))], pooled=not isinstance(source, Mixer)).counts()
    tokens = 0
    for domain, shard, index in documents:  # the document's tokens, from the first stream of its domain
        samples = next((samples for name, samples in streams if name == domain), None)
        tokens += document_tokens(samples, shard, index) if samples is not None else 0
    removed = ", ".join(f"{count:,} of {len(samples):,} samples of stream {name}"
                        for name, count, (_, samples) in zip(names, counts, streams) if count)
    return [f"data.exclude: {len(documents):,} document(s) ({tokens:,} tokens) from {cfg.data.exclude}, left out from "
            f"the step the run is given them: {removed or 'no sample the stages read'}"]
