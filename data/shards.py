"""The token-shard format every later stage reads: Megatron's indexed dataset (`.bin` + `.idx`).

A shard is two files sharing a prefix, byte for byte what megatron-core's `IndexedDataset`
reads and `IndexedDatasetBuilder` writes (so do Megatron-LM's `preprocess_data.py`, NeMo,
GPT-NeoX and datatrove):

- `PREFIX.bin`: the token ids of all sequences back to back, little-endian, nothing else.
- `PREFIX.idx`, little-endian::

      magic              9 bytes  b"MMIDIDX\\x00\\x00"
      version            u64      1
      dtype code         u8       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16 (6/7 are floats)
      sequence count     u64      S
      document count     u64      D + 1
      sequence lengths   int32[S] tokens per sequence
      sequence pointers  int64[S] byte offset of each sequence in .bin
      document indices   int64[D+1] sequence index where each document starts, then S

  34 bytes of header, then the three arrays.

ayumi writes one sequence per document (document indices 0..D), uint16 ids below 65,500
vocabulary entries and int32 above (megatron-core's `DType.optimal_dtype`). The stream a model
trains on is every sequence's tokens in index order; ayumi's documents already end with EOS.

The format carries no tokenizer identity: that lives in the domain's record (`domain.json`,
`data/manifest.py`) with each shard's size, largest id and sha256, checked at training start.

Writing is atomic: both files are written under temporary names and renamed `.bin` first, then
`.idx`, so an `.idx` on disk always describes a complete `.bin`; a crash leaves only `*.tmp`
files, which readers never look at.

A reader keeps no file open and no memory map for its tokens, nor for an index of up to 4 MiB
(`_read_index`, `ShardReader.slice`): a root of 10,000 shards per domain would otherwise hold two
descriptors and two maps per shard (Python's mmap keeps a duplicate of the descriptor) and meet the
process's limits (`ulimit -n`, vm.max_map_count) before training starts. Small indexes are read
into memory, larger ones stay mapped (few shards are that large); a sample's tokens are read with
one `pread`. `tokens`, the whole stream as an
array, is mapped on first use by the tools that scan shards (verify, finish, Megatron checks).
Training opens the shards a domain record lists with `ShardReader.recorded`: from the record's counts, with
one `stat` per file and no index read (the index is read, and checked in full, when its documents are first
asked for), so opening 10,000 shards per domain costs 20,000 `stat`s, not 10,000 index reads.

A reader's errors say what is wrong with which file, then `Fix: ...`: the reader cannot know who
made the shard, so its caller says how to remake it (`ShardReader(prefix, fix=...)`: ayumi's own
shards are remade by `ayumi data prepare`; registered Megatron data only by whoever owns the prefix).
"""
from __future__ import annotations

import hashlib
import os
import struct
from functools import cached_property
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
_PREAMBLE = struct.Struct("<9sQBQQ")
HEADER_SIZE = _PREAMBLE.size  # 34
LEGACY_MAGIC = b"AYUMIIDX"  # ayumi's own index before Megatron's format (data pipeline version 1)
# megatron-core's DType codes; the float ones (6, 7) never hold token ids.
_DTYPES = {1: np.dtype("u1"), 2: np.dtype("i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"), 5: np.dtype("<i8"),
           8: np.dtype("<u2")}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
UINT16_BELOW = 65500
"""Vocabularies smaller than this are written as uint16, larger ones as int32 (megatron-core's rule)."""
_CHUNK = 1 << 23  # elements per pass when scanning large arrays: bounded memory on 100M-document indices
_INDEX_IN_MEMORY_BYTES = 1 << 22
"""Indexes up to this size (about 200,000 documents) are read into memory, larger ones mapped: many small shards
then hold no descriptor and no map each, and the few large ones cost no more memory than they did."""


class ShardFormatError(ValueError):
    """A shard file is missing, truncated, corrupt, or not in this format; the message names the file."""


REMAKE = "re-run the data preparation that wrote it"
"""A reader's default fix, for shards whose maker it is not told (tests, benchmarks, `from_directory`)."""


class TokenizerMismatchError(ValueError):
    """Shards were made with a different tokenizer than the one a run uses."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The token dtype Megatron uses for a vocabulary: uint16 below 65,500 entries, else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return _DTYPES[8] if vocab_size < UINT16_BELOW else _DTYPES[4]


def shard_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """(`.bin`, `.idx`) paths of a shard prefix; a prefix given with either suffix is accepted."""
    prefix = Path(prefix)
    if prefix.suffix in (".bin", ".idx"):
        prefix = prefix.with_suffix("")
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")


def _fsync_rename(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)


class ShardWriter:
    """Appends documents to one shard; `close()` publishes it atomically.

    Besides the two files it keeps what the domain record stores for integrity checks: the
    largest id written (`max_id`) and the sha256 of the `.bin` bytes (`sha256`).
    Use as a context manager: on an exception the temporary files are removed and nothing is published.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int):
        self.bin_path, self.idx_path = shard_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + ".tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._digest = hashlib.sha256()
        self._lengths: list[np.ndarray] = []
        self.num_docs = 0
        self.num_tokens = 0
        self.max_id = -1
        self._closed = False

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.dtype.itemsize

    @property
    def sha256(self) -> str:
        """sha256 hex of the `.bin` bytes written so far."""
        return self._digest.hexdigest()

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document's token ids (EOS, if wanted, is the caller's to include)."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document is a 1-D sequence of token ids, got shape {array.shape}")
        self.add_packed(array, np.array([array.size]))

    def add_packed(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many documents at once: their ids back to back in `tokens`, their sizes in `lengths`."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"document lengths add up to {int(lengths.sum())} tokens, got {tokens.size}")
        if lengths.size and int(lengths.max()) >= 2**31:
            raise ValueError(f"a document of {int(lengths.max())} tokens does not fit Megatron's int32 lengths")
        if tokens.size:
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"token id out of range [0, {self.vocab_size}) in documents for {self.bin_path}: "
                                 f"min {low}, max {high}")
            self.max_id = max(self.max_id, high)
        data = tokens.astype(self.dtype, copy=False).tobytes()
        self._bin.write(data)
        self._digest.update(data)
        self._lengths.append(lengths)
        self.num_docs += lengths.size
        self.num_tokens += int(tokens.size)

    def add_documents(self, documents: Iterable[Sequence[int] | np.ndarray]) -> None:
        for document in documents:
            self.add_document(document)

    def close(self) -> None:
        """Write the index and publish both files (`.bin` first, `.idx` last)."""
        if self._closed:
            return
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int64)
        pointers = np.zeros(lengths.size, dtype="<i8")
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with open(self._idx_tmp, "wb") as handle:
            handle.write(_PREAMBLE.pack(MAGIC, VERSION, _DTYPE_CODES[self.dtype], lengths.size, lengths.size + 1))
            handle.write(lengths.astype("<i4").tobytes())
            handle.write(pointers.tobytes())
            handle.write(np.arange(lengths.size + 1, dtype="<i8").tobytes())  # one sequence per document
        _fsync_rename(self._bin_tmp, self.bin_path)
        _fsync_rename(self._idx_tmp, self.idx_path)
        self._closed = True

    def abort(self) -> None:
        """Drop everything written so far; nothing is published."""
        if self._closed:
            return
        self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            tmp.unlink(missing_ok=True)
        self._closed = True

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ShardReader:
    """One shard, its index and `.bin` size checked when opened; it keeps its counts, not its files (module doc).

    `tokens` is the shard's token stream (every sequence in index order); documents are the
    index's documents (for ayumi's shards, one sequence each). The index arrays are read again when
    first asked for, unless the index is large (then they stay mapped from the start).
    """

    def __init__(self, prefix: str | os.PathLike, fix: str = REMAKE):
        """`fix`: how to remake this shard, the end of every error it raises (module doc)."""
        self.bin_file = os.fspath(shard_paths(prefix)[0])
        self._fix = fix
        self._counts_from = "the index when opened"
        index = _read_index(self.idx_path, fix)
        if index.mapped:
            self.__dict__["_index"] = index  # a large index stays mapped: reading it again would cost its size
        self._index_identity = index.identity
        self.dtype = index.dtype
        self.num_sequences = index.lengths.size
        self.num_docs = index.documents.size - 1
        self.num_tokens = index.num_tokens
        self._identity = _check_bin_size(self.bin_file, self.dtype, self.num_tokens, fix)

    @classmethod
    def recorded(cls, prefix: str, fix: str, dtype: np.dtype, docs: int, tokens: int,
                 counts_from: str = "its record") -> "ShardReader":
        """A shard ayumi wrote (one sequence per document), opened from the counts its record holds: a `stat`
        of each file, whose sizes follow from the counts; no index is read. Training reads samples by token
        offsets, which need no index, so a domain of 10,000 shards opens in the time of 20,000 `stat`s.

        The index is read on first use of its arrays (documents, `ayumi batch`, long-document streams) and
        checked in full then: its layout, its counts against the record, and that it is still the file
        that was opened. `counts_from` names the record in that message."""
        reader = cls.__new__(cls)
        reader.bin_file, reader._fix, reader._counts_from = prefix + ".bin", fix, counts_from
        reader.dtype = dtype
        reader.num_sequences = reader.num_docs = docs
        reader.num_tokens = tokens
        reader._index_identity = _check_index_size(prefix + ".idx", ayumi_index_bytes(docs), fix)
        reader._identity = _check_bin_size(reader.bin_file, dtype, tokens, fix)
        return reader

    @cached_property
    def bin_path(self) -> Path:
        return Path(self.bin_file)

    @property
    def idx_path(self) -> Path:
        return self.bin_path.with_suffix(".idx")

    @property
    def prefix(self) -> Path:
        return self.bin_path.with_suffix("")

    @cached_property
    def _index(self) -> "_Index":
        index = _read_index(self.idx_path, self._fix)
        if index.identity != self._index_identity:
            raise ShardFormatError(f"{self.idx_path}: replaced by another file after it was opened (the data was "
                                   f"prepared again under a reader of it). Fix: {self._fix}")
        found = (index.documents.size - 1, index.num_tokens, index.lengths.size, index.dtype)
        if found != (self.num_docs, self.num_tokens, self.num_sequences, self.dtype):
            raise ShardFormatError(f"{self.idx_path}: describes {found[0]} documents and {found[1]} {found[3].name} "
                                   f"tokens in {found[2]} sequences, but {self._counts_from} says {self.num_docs}, "
                                   f"{self.num_tokens} {self.dtype.name} and {self.num_sequences}; the index was "
                                   f"changed or damaged. Fix: {self._fix}")
        return index

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._index.lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self._index.pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self._index.documents

    @cached_property
    def tokens(self) -> np.ndarray:
        """The shard's whole token stream, memory-mapped on first use (the map keeps a descriptor open)."""
        if self.num_tokens == 0:
            return np.zeros(0, dtype=self.dtype)
        self._check_same_bin(os.stat(self.bin_file))
        return np.memmap(self.bin_file, dtype=self.dtype, mode="r", shape=(self.num_tokens,))

    def _check_same_bin(self, found: os.stat_result) -> None:
        if (found.st_dev, found.st_ino) != self._identity:  # a map kept the old file; a path finds the new one
            raise ShardFormatError(f"{self.bin_path}: replaced by another file after it was opened (the data was "
                                   f"prepared again under a reader of it). Fix: {self._fix}")

    @cached_property
    def doc_offsets(self) -> np.ndarray:
        """Token offset where each document starts, then the token count (num_docs + 1 values)."""
        starts = np.zeros(self.num_sequences + 1, dtype=np.int64)
        starts[:-1] = self.sequence_pointers // self.dtype.itemsize
        starts[-1] = self.num_tokens
        return starts[self.document_indices]

    def __len__(self) -> int:
        return self.num_docs

    def document(self, index: int) -> np.ndarray:
        """Token ids of document `index` (a view into the memory map)."""
        if not 0 <= index < self.num_docs:
            raise IndexError(f"document {index} out of range for {self.idx_path} ({self.num_docs} documents)")
        start, stop = self.doc_offsets[index:index + 2]  # the index first: it is checked when first read
        return self.tokens[start:stop]

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the shard's stream (0 <= start <= stop <= num_tokens), read with one `pread`, or
        from the map when `tokens` is mapped already: a training sample keeps no file open (module doc)."""
        if "tokens" in self.__dict__ or stop <= start:
            return self.tokens[start:stop]
        size = self.dtype.itemsize
        try:
            fd = os.open(self.bin_file, os.O_RDONLY)
        except FileNotFoundError:
            raise ShardFormatError(f"{self.bin_path}: removed after it was opened (the data was prepared again or "
                                   f"merged under a reader of it). Fix: {self._fix}") from None
        try:
            self._check_same_bin(os.fstat(fd))
            data = os.pread(fd, (stop - start) * size, start * size)
        finally:
            os.close(fd)
        if len(data) != (stop - start) * size:
            raise ShardFormatError(f"{self.bin_path}: ended at byte {start * size + len(data)} while reading tokens "
                                   f"{start}-{stop}; the file was truncated after it was opened. Fix: {self._fix}")
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.document(index)

    def __iter__(self):
        for index in range(self.num_docs):
            yield self.document(index)

    def max_id(self) -> int:
        """The largest token id in the shard (a full pass over `.bin`; -1 when empty)."""
        highest = -1
        for start in range(0, self.num_tokens, _CHUNK):
            highest = max(highest, int(self.tokens[start:start + _CHUNK].max()))
        return highest

    def min_id(self) -> int:
        """The smallest token id (signed dtypes can hold negative ids in a corrupt file)."""
        lowest = 0
        for start in range(0, self.num_tokens, _CHUNK):
            lowest = min(lowest, int(self.tokens[start:start + _CHUNK].min()))
        return lowest

    def __repr__(self) -> str:
        return f"ShardReader({str(self.prefix)!r}, docs={self.num_docs}, tokens={self.num_tokens})"


class _Index(NamedTuple):
    """The parsed arrays of an `.idx` (read into memory when small, memory-mapped when large)."""

    dtype: np.dtype
    lengths: np.ndarray
    pointers: np.ndarray
    documents: np.ndarray
    num_tokens: int
    mapped: bool
    identity: tuple[int, int]
    """The `.idx` file's (device, inode) when read: a later read must find the same file."""


def _read_index(idx_path: Path, fix: str) -> _Index:
    """The checked arrays of an index: one open and one read when it is small (module doc)."""
    try:
        handle = open(idx_path, "rb")
    except FileNotFoundError:
        hint = " (its .bin does: an unfinished or damaged shard)" if idx_path.with_suffix(".bin").exists() else ""
        raise ShardFormatError(f"shard index {idx_path} does not exist{hint}. Fix: {fix}") from None
    with handle:
        stat = os.fstat(handle.fileno())
        size = stat.st_size
        whole = handle.read(size if size <= _INDEX_IN_MEMORY_BYTES else HEADER_SIZE)
    head = whole[:HEADER_SIZE]
    if head.startswith(LEGACY_MAGIC):  # only ayumi ever wrote these: its own fix, whoever asks
        raise ShardFormatError(
            f"{idx_path}: written by an older ayumi in its own index format (AYUMIIDX); shards are now "
            "Megatron's format. Fix: re-run `ayumi data prepare` with the same config (it rewrites every domain)"
        )
    if len(head) < HEADER_SIZE:
        raise ShardFormatError(f"{idx_path}: truncated index ({size} bytes, the header alone is {HEADER_SIZE}). "
                               f"Fix: {fix}")
    magic, version, code, sequences, documents = _PREAMBLE.unpack(head)
    if magic != MAGIC:
        raise ShardFormatError(f"{idx_path}: not a Megatron indexed-dataset index (magic {magic!r}, expected {MAGIC!r}). "
                               f"Fix: {fix}")
    if version != VERSION:
        raise ShardFormatError(f"{idx_path}: index version {version}, only version {VERSION} is known. Fix: {fix}")
    if code not in _DTYPES:
        raise ShardFormatError(f"{idx_path}: token dtype code {code} is not an integer type "
                               f"(known: {', '.join(f'{c}={d.name}' for c, d in sorted(_DTYPES.items()))}). Fix: {fix}")
    expected = HEADER_SIZE + 12 * sequences + 8 * documents
    if size != expected:
        extra = " (one mode byte per sequence: a multimodal index, which ayumi does not train on)" \
            if size == expected + sequences and sequences else ""
        raise ShardFormatError(f"{idx_path}: {size} bytes, but {sequences} sequences and {documents} document "
                               f"indices need {expected}{extra}; the file is truncated or corrupt. Fix: {fix}")
    if documents < 1:
        raise ShardFormatError(f"{idx_path}: no document indices (a valid index has at least one). Fix: {fix}")
    in_memory = len(whole) == size  # no descriptor or map kept (module doc)
    mapped = np.frombuffer(whole, dtype=np.uint8) if in_memory else np.memmap(idx_path, mode="r", dtype=np.uint8)
    lengths = mapped[HEADER_SIZE:HEADER_SIZE + 4 * sequences].view("<i4")
    pointers = mapped[HEADER_SIZE + 4 * sequences:HEADER_SIZE + 12 * sequences].view("<i8")
    document_indices = mapped[HEADER_SIZE + 12 * sequences:expected].view("<i8")
    dtype = _DTYPES[code]
    num_tokens = _check_layout(idx_path, dtype, lengths, pointers, document_indices, fix)
    return _Index(dtype, lengths, pointers, document_indices, num_tokens, not in_memory, (stat.st_dev, stat.st_ino))


def _check_layout(idx_path: Path, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray, documents: np.ndarray,
                  fix: str) -> int:
    """Sequences must lie back to back from byte 0 (as every Megatron writer lays them out) and
    document indices must rise from 0 to the sequence count; returns the token count."""
    sequences = lengths.size
    if documents[0] != 0 or documents[-1] != sequences:
        raise ShardFormatError(f"{idx_path}: document indices run from {documents[0]} to {documents[-1]}, "
                               f"expected 0 to {sequences}; the index is corrupt. Fix: {fix}")
    expected_pointer = 0
    for start in range(0, sequences, _CHUNK):
        chunk = lengths[start:start + _CHUNK].astype(np.int64)
        if chunk.size and chunk.min() < 0:
            raise ShardFormatError(f"{idx_path}: negative sequence length; the index is corrupt. Fix: {fix}")
        ends = expected_pointer + np.cumsum(chunk * dtype.itemsize)
        starts = np.concatenate(([expected_pointer], ends[:-1]))
        if not np.array_equal(starts, pointers[start:start + _CHUNK]):
            raise ShardFormatError(f"{idx_path}: sequences are not stored back to back in the .bin "
                                   f"(pointers disagree with lengths); ayumi reads only contiguous shards. Fix: {fix}")
        expected_pointer = int(ends[-1]) if ends.size else expected_pointer
    for start in range(0, documents.size - 1, _CHUNK):
        if np.any(np.diff(documents[start:start + _CHUNK + 1]) < 0):
            raise ShardFormatError(f"{idx_path}: document indices decrease; the index is corrupt. Fix: {fix}")
    return expected_pointer // dtype.itemsize


def ayumi_index_bytes(docs: int) -> int:
    """The size of the `.idx` ShardWriter writes for `docs` documents (one sequence each)."""
    return HEADER_SIZE + 12 * docs + 8 * (docs + 1)


def _check_index_size(idx_path: str, size: int, fix: str) -> tuple[int, int]:
    """The `.idx`'s (device, inode), once it exists with the size its recorded counts give."""
    try:
        found = os.stat(idx_path)
    except FileNotFoundError:
        hint = " (its .bin does: an unfinished or damaged shard)" if os.path.exists(idx_path[:-4] + ".bin") else ""
        raise ShardFormatError(f"shard index {idx_path} does not exist{hint}. Fix: {fix}") from None
    if found.st_size != size:
        raise ShardFormatError(f"{idx_path}: {found.st_size} bytes, but the documents recorded for it need {size}; "
                               f"the file is truncated or corrupt. Fix: {fix}")
    return found.st_dev, found.st_ino


def _check_bin_size(bin_path: str | Path, dtype: np.dtype, num_tokens: int, fix: str) -> tuple[int, int]:
    """The `.bin`'s (device, inode), once its size is the index's: what a later read checks it still is."""
    try:
        found = os.stat(bin_path)
        size = found.st_size
    except FileNotFoundError:
        raise ShardFormatError(f"shard data {bin_path} does not exist (its .idx does). Fix: {fix}") from None
    if size != num_tokens * dtype.itemsize:
        raise ShardFormatError(
            f"{bin_path}: {size} bytes, but its index says {num_tokens} tokens of {dtype.itemsize} bytes "
            f"({num_tokens * dtype.itemsize} bytes); the file is truncated or corrupt. Fix: {fix}"
        )
    return found.st_dev, found.st_ino


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 hex of a file's bytes, read in 8 MiB blocks (unbuffered: half the time of `open` on 10,000 small
    shards, hashed one after another at training start)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        for block in iter(lambda: os.read(fd, 1 << 23), b""):
            digest.update(block)
    finally:
        os.close(fd)
    return digest.hexdigest()


def find_shards(directory: str | os.PathLike) -> list[Path]:
    """Prefixes of the complete shards in a directory (those with an `.idx`), sorted by name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ShardFormatError(f"shard directory {directory} does not exist")
    return sorted(path.with_suffix("") for path in directory.glob("*.idx"))
