"""Fixed-length training samples cut from token shards, and a deterministic global sample order.

Documents in a shard end with EOS, so a domain's shards form one token stream: ayumi writes one
after every document, and Megatron data prepared without --append-eod (a domain with
`append_eod: true`) is read through `EodAppended`, which supplies one after each document. Sample i
is tokens[i*L : i*L + L + 1] (L = sequence length): inputs are its first L tokens, labels its
last L, and neighbouring samples share one token, as in Megatron's GPT dataset.

The global order is a pure function of (seed, global sample index): any rank can compute any
part of it, so a run resumes exactly and a different data-parallel size sees the same stream.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from data.shards import ShardFormatError, ShardReader, find_shards


class CorruptShardError(ShardFormatError):
    """A sample holds a token id the model has no embedding for: the shard's bytes were damaged after writing.

    Raised by the rank that read it (ranks read different samples), so every rank may report it.
    """


class PackedSamples:
    """Samples of `seq_len + 1` tokens over the concatenation of one domain's shards.

    `vocab_size`, when given, is checked on every sample (one max over seq_len ids): a damaged
    `.bin` then stops the run with the file and position named, not an IndexError in the embedding.
    """

    def __init__(self, readers: Sequence[ShardReader | EodAppended], seq_len: int, name: str = "",
                 vocab_size: int | None = None):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.readers = list(readers)
        self.seq_len = seq_len
        self.name = name
        self.vocab_size = vocab_size
        self.fingerprint: str | None = None
        """What the data is (set by data/domains.py from the records' checksums): a resume compares it."""
        self.lineage = None
        """The shards merged into these (data/lineage.py, set by data/domains.py): data.exclude's old names."""
        self._starts = np.cumsum([0] + [reader.num_tokens for reader in self.readers])
        self.num_tokens = int(self._starts[-1])
        self.num_samples = max(0, (self.num_tokens - 1) // seq_len)

    @classmethod
    def from_directory(cls, directory: str | Path, seq_len: int, name: str = "") -> "PackedSamples":
        """Every shard found in a folder, in name order (tests and benchmarks; training opens the shards its
        data root's manifest lists, data/domains.py)."""
        prefixes = find_shards(directory)
        if not prefixes:
            raise ShardFormatError(f"no shards (*.idx) in {directory}: run `ayumi data prepare` first")
        return cls([ShardReader(prefix) for prefix in prefixes], seq_len, name=name or Path(directory).name)

    def __len__(self) -> int:
        return self.num_samples

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the concatenated stream, read across shard boundaries."""
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pieces = []
        position = start
        shard = first
        while position < stop:
            reader = self.readers[shard]
            offset = position - int(self._starts[shard])
            take = min(stop - position, reader.num_tokens - offset)
            pieces.append(reader.slice(offset, offset + take))
            position += take
            shard += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def sample(self, index: int) -> np.ndarray:
        """Sample `index`: seq_len + 1 token ids."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range ({self.num_samples} samples in {self.name or 'dataset'})")
        start = index * self.seq_len
        tokens = self.tokens(start, start + self.seq_len + 1)
        if self.vocab_size is not None and tokens.size and (int(tokens.max()) >= self.vocab_size or int(tokens.min()) < 0):
            self._refuse(start, tokens)
        return tokens

    def _refuse(self, start: int, tokens: np.ndarray) -> None:
        bad = int(np.flatnonzero((tokens >= self.vocab_size) | (tokens < 0))[0])
        position = start + bad
        shard = int(np.searchsorted(self._starts, position, side="right")) - 1
        reader = self.readers[shard]
        raise CorruptShardError(
            f"{reader.bin_path}: token {position - int(self._starts[shard]):,} of the stream is id {int(tokens[bad])}, "
            f"outside the vocabulary [0, {self.vocab_size}) of domain {self.name!r}; the file was damaged after it was "
            "written. Fix: `ayumi data verify DATA_ROOT` lists every damaged shard, each with how to remake it"
        )


class EodAppended:
    """A shard read as if an end-of-document id followed every document (Megatron data prepared
    without `--append-eod`): without it, documents would run into each other unseparated."""

    def __init__(self, reader: ShardReader, eod_id: int):
        self.reader, self.eod_id = reader, eod_id
        self.bin_path = reader.bin_path
        self.num_docs = reader.num_docs
        self.num_tokens = reader.num_tokens + reader.num_docs
        # Start of document d in the stream with separators: its start in the shard plus d separators (num_docs + 1
        # values, as ShardReader.doc_offsets).
        self.doc_offsets = reader.doc_offsets + np.arange(reader.num_docs + 1, dtype=np.int64)

    def slice(self, start: int, stop: int) -> np.ndarray:
        out = np.empty(stop - start, dtype=np.int64)
        doc = int(np.searchsorted(self.doc_offsets, start, side="right")) - 1
        filled = 0
        while start + filled < stop:
            position = start + filled
            doc_end = int(self.doc_offsets[doc + 1]) - 1  # where this document's separator sits
            if position < doc_end:
                take = min(stop, doc_end) - position
                inner = int(self.reader.doc_offsets[doc]) + position - int(self.doc_offsets[doc])
                out[filled:filled + take] = self.reader.slice(inner, inner + take)
            else:
                take = 1
                out[filled] = self.eod_id
                doc += 1
            filled += take
        return out


class LongDocuments:
    """A shard read as the concatenation of its documents of at least `min_tokens` tokens (each with its
    end-of-document token, which counts), for a curriculum stage that asks for long documents.

    The shard's index already holds every document's length, so choosing them reads no tokens.
    """

    def __init__(self, reader: ShardReader | EodAppended, min_tokens: int):
        bounds = reader.doc_offsets
        lengths = np.diff(bounds)
        kept = np.flatnonzero(lengths >= min_tokens)
        self.reader, self.min_tokens = reader, min_tokens
        self.bin_path = reader.bin_path
        self.num_docs = int(kept.size)
        self._doc_starts = bounds[kept]
        self._starts = np.concatenate([[0], np.cumsum(lengths[kept])]).astype(np.int64)
        self.num_tokens = int(self._starts[-1])

    def slice(self, start: int, stop: int) -> np.ndarray:
        pieces = []
        doc = int(np.searchsorted(self._starts, start, side="right")) - 1
        position = start
        while position < stop:
            offset = position - int(self._starts[doc])
            take = min(stop, int(self._starts[doc + 1])) - position
            first = int(self._doc_starts[doc]) + offset
            pieces.append(self.reader.slice(first, first + take))
            position += take
            doc += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class BlendedSamples:
    """A domain made of several Megatron prefixes with weights (`0.3 A 0.7 B`, as in Megatron's --data-path).

    The domain keeps as many samples as its parts hold together; part k gets a share of them
    proportional to its weight. A part with fewer samples than its share is repeated in order, one
    with more is read at evenly spaced samples. Shuffling is the mixer's (or ShuffledDomains') job.
    """

    def __init__(self, parts: Sequence[PackedSamples], weights: Sequence[float], name: str = ""):
        if len(parts) != len(weights) or not parts:
            raise ValueError("one weight per part, at least one part")
        self.parts, self.name = list(parts), name
        self.seq_len = parts[0].seq_len
        self.num_tokens = sum(part.num_tokens for part in parts)
        self.counts = _shares(sum(len(part) for part in parts), weights, [len(part) for part in parts])
        self._starts = np.cumsum([0] + self.counts)
        self.num_samples = int(self._starts[-1])
        self.readers = [reader for part in parts for reader in part.readers]
        self.fingerprint: str | None = None

    def __len__(self) -> int:
        return self.num_samples

    def sample(self, index: int) -> np.ndarray:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range ({self.num_samples} samples in {self.name or 'dataset'})")
        part, inner = self.locate(index)
        return self.parts[part].sample(inner)

    def locate(self, index: int) -> tuple[int, int]:
        """(part, the part's sample) that blend sample `index` reads."""
        k = int(np.searchsorted(self._starts, index, side="right")) - 1
        local, count, available = index - int(self._starts[k]), self.counts[k], len(self.parts[k])
        return k, (local * available // count if count <= available else local % available)

    def reading(self, part: int, inner: int) -> range:
        """The blend samples that read sample `inner` of part `part`: `locate`'s inverse."""
        start, count, available = int(self._starts[part]), self.counts[part], len(self.parts[part])
        if count <= available:  # read at evenly spaced samples: local * available // count == inner
            return range(start - (-inner * count // available), start - (-(inner + 1) * count // available))
        return range(start + inner, start + count, available)  # repeated in order


def _shares(total: int, weights: Sequence[float], available: Sequence[int]) -> list[int]:
    """`total` samples split in proportion to the weights (largest remainder), none to an empty part."""
    weights = [w if n > 0 else 0.0 for w, n in zip(weights, available)]
    scale = sum(weights)
    if scale <= 0:
        return [0] * len(weights)
    exact = [total * w / scale for w in weights]
    counts = [int(x) for x in exact]
    for k in sorted(range(len(exact)), key=lambda k: counts[k] - exact[k])[:total - sum(counts)]:
        counts[k] += 1
    return counts


class DataChangedError(ValueError):
    """A resumed run finds other data than the checkpoint was trained on."""


class EpochPermutation:
    """Global index g -> sample id: a fresh seeded shuffle of all n samples per epoch (g // n)."""

    def __init__(self, num_samples: int, seed: int):
        if num_samples <= 0:
            raise ValueError("cannot order an empty dataset")
        self.num_samples = num_samples
        self.seed = seed
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """The shuffle of epoch `epoch` (cached for the current epoch)."""
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            dtype = np.int32 if self.num_samples < 2**31 else np.int64
            self._perm = rng.permutation(self.num_samples).astype(dtype)
            self._epoch = epoch
        return self._perm

    def __call__(self, global_index: int) -> tuple[int, int]:
        """(epoch, sample id) at position `global_index` of the stream."""
        epoch, within = divmod(global_index, self.num_samples)
        return epoch, int(self.permutation(epoch)[within])


class ShuffledDomains:
    """All domains' samples in one shuffled stream (the run without a curriculum).

    `get(g)` returns (tokens, domain index). The curriculum's mixer offers the same interface
    with per-stage weights.
    """

    def __init__(self, domains: dict[str, PackedSamples], seed: int):
        if not domains:
            raise ValueError("no training domains")
        self.domains = dict(domains)
        self.domain_names = list(self.domains)
        counts = [len(samples) for samples in self.domains.values()]
        self._starts = np.cumsum([0] + counts)
        total = int(self._starts[-1])
        if total == 0:
            raise ValueError(
                f"the training data holds no complete sample (domains: {', '.join(self.domain_names)}); "
                "prepare more text or lower train.seq_len"
            )
        self.order = EpochPermutation(total, seed)
        self.num_samples = total
        self.exclusion = None
        """data.exclude's documents (data/exclude.py's Exclusion over the domains in order, set by
        pretrain/excluded.py); None: every sample is trained."""

    def state_dict(self) -> dict:
        """What a resume must find unchanged: the samples each domain holds (the stream's shape)."""
        return {"domain_samples": {name: len(samples) for name, samples in self.domains.items()},
                "domain_fingerprints": {name: samples.fingerprint for name, samples in self.domains.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Refuse to resume over data that changed: the same global index would now be another sample."""
        now = self.state_dict()
        saved_samples, saved_prints = state.get("domain_samples", {}), state.get("domain_fingerprints", {})
        changes = [f"{name}: {saved_samples.get(name)} -> {now['domain_samples'].get(name)} samples"
                   for name in sorted({*saved_samples, *now["domain_samples"]})
                   if saved_samples.get(name) != now["domain_samples"].get(name)]
        changes += [f"{name}: same size, other shards (checksums differ)" for name, fingerprint in saved_prints.items()
                    if fingerprint and now["domain_fingerprints"].get(name) not in (None, fingerprint)
                    and saved_samples.get(name) == now["domain_samples"].get(name)]
        if changes:
            raise DataChangedError(
                "cannot resume: the training data changed since the checkpoint was written (" + "; ".join(changes)
                + "), so the shuffled stream would not continue where it stopped. Fix: restore the data the run "
                "started with, or start a new run (a new run_dir) on the new data")

    def sample_slots(self, global_index: int) -> int:
        """Every sample is one global index (only a curriculum stage may have longer samples)."""
        return 1

    def get(self, global_index: int) -> tuple[np.ndarray, int]:
        domain, _, sample = self._locate(global_index)
        return self.domains[self.domain_names[domain]].sample(sample), domain

    def origin(self, global_index: int) -> tuple[str, int, int, PackedSamples]:
        """Where sample `global_index` comes from: (domain name, epoch, sample id in the domain, its samples); `get`
        reads it from there, and `ayumi batch` names its documents from it."""
        domain, epoch, sample = self._locate(global_index)
        name = self.domain_names[domain]
        return name, epoch, sample, self.domains[name]

    def _locate(self, global_index: int) -> tuple[int, int, int]:
        found = self._at(global_index)
        if self.exclusion is None or not self.exclusion.excluded(found[0], found[2], global_index):
            return found
        # the same place of a later epoch's order
        return self.exclusion.later_epoch(lambda epochs: self._at(global_index + epochs * self.num_samples),
                                          global_index)

    def _at(self, global_index: int) -> tuple[int, int, int]:
        epoch, flat = self.order(global_index)
        domain = int(np.searchsorted(self._starts, flat, side="right")) - 1
        return domain, epoch, flat - int(self._starts[domain])
