"""Fixed-length training samples cut from token shards, and a deterministic global sample order.

Documents in a shard already end with EOS, so a domain's shards form one token stream. Sample i
is tokens[i*L : i*L + L + 1] (L = sequence length): inputs are its first L tokens, labels its
last L, and neighbouring samples share one token, as in Megatron's GPT dataset.

The global order is a pure function of (seed, global sample index): any rank can compute any
part of it, so a run resumes exactly and a different data-parallel size sees the same stream.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from data.shards import ShardFormatError, ShardReader, find_shards


class PackedSamples:
    """Samples of `seq_len + 1` tokens over the concatenation of one domain's shards."""

    def __init__(self, readers: Sequence[ShardReader], seq_len: int, name: str = ""):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.readers = list(readers)
        self.seq_len = seq_len
        self.name = name
        self._starts = np.cumsum([0] + [reader.num_tokens for reader in self.readers])
        self.num_tokens = int(self._starts[-1])
        self.num_samples = max(0, (self.num_tokens - 1) // seq_len)

    @classmethod
    def from_directory(cls, directory: str | Path, seq_len: int, name: str = "") -> "PackedSamples":
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
            pieces.append(reader.tokens[offset:offset + take])
            position += take
            shard += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def sample(self, index: int) -> np.ndarray:
        """Sample `index`: seq_len + 1 token ids."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range ({self.num_samples} samples in {self.name or 'dataset'})")
        start = index * self.seq_len
        return self.tokens(start, start + self.seq_len + 1)


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

    def get(self, global_index: int) -> tuple[np.ndarray, int]:
        _, flat = self.order(global_index)
        domain = int(np.searchsorted(self._starts, flat, side="right")) - 1
        samples = self.domains[self.domain_names[domain]]
        return samples.sample(flat - int(self._starts[domain])), domain


def domains_under(root: str | Path, split: str, names: Iterable[str] | None = None) -> dict[str, Path]:
    """`ROOT/<domain>/<split>` directories, for the given names or every domain found."""
    root = Path(root)
    if not root.is_dir():
        raise ShardFormatError(f"data root {root} does not exist: run `ayumi data prepare` or set data.root")
    if names:
        dirs = {name: root / name / split for name in names}
        missing = [str(path) for path in dirs.values() if not path.is_dir()]
        if missing:
            raise ShardFormatError(f"no {split} shards for: {', '.join(missing)} (check data.domains and data.root)")
        return dirs
    dirs = {path.parent.name: path for path in sorted(root.glob(f"*/{split}")) if path.is_dir()}
    if not dirs and split == "train":
        raise ShardFormatError(f"no <domain>/{split}/ shard directories under {root}: run `ayumi data prepare` first")
    return dirs
