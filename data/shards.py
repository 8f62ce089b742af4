"""The token-shard format every later stage reads: Megatron-style `.bin` + `.idx` pairs.

A shard is two files sharing a prefix:

- `PREFIX.bin`: the token ids of all documents back to back (uint16 when the vocabulary fits,
  else uint32), little-endian, nothing else.
- `PREFIX.idx`: a fixed header, then `num_docs + 1` uint64 token offsets (document i spans
  tokens[offsets[i]:offsets[i+1]]).

Header (little-endian, 112 bytes)::

    magic            8s   b"AYUMIIDX"
    version          u32  1
    dtype code       u32  1 = uint16, 2 = uint32
    num_docs         u64
    num_tokens       u64
    vocab_size       u64
    tokenizer sha256 64s  hex of the tokenizer.model the tokens came from ("0"*64 if unknown)

Writing is atomic: both files are written under temporary names and renamed `.bin` first, then
`.idx`, so an `.idx` on disk always describes a complete `.bin`; a crash leaves only `*.tmp`
files, which readers never look at.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

MAGIC = b"AYUMIIDX"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQ64s")
HEADER_SIZE = _HEADER.size
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
_DTYPE_CODES = {dtype: code for code, dtype in _DTYPES.items()}
UNKNOWN_SHA = "0" * 64


class ShardFormatError(ValueError):
    """A shard file is missing, truncated, or not in this format; the message names the file."""


class TokenizerMismatchError(ValueError):
    """Shards were made with a different tokenizer than the one a run uses."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest token dtype that holds every id of a vocabulary."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return _DTYPES[1] if vocab_size <= 2**16 else _DTYPES[2]


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

    Use as a context manager: on an exception the temporary files are removed and nothing is
    published.
    """

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, tokenizer_sha256: str = UNKNOWN_SHA):
        if len(tokenizer_sha256) != 64:
            raise ValueError(f"tokenizer_sha256 must be 64 hex characters, got {tokenizer_sha256!r}")
        self.bin_path, self.idx_path = shard_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self.vocab_size = vocab_size
        self.tokenizer_sha256 = tokenizer_sha256
        self.dtype = dtype_for_vocab(vocab_size)
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + ".tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._offsets: list[int] = [0]
        self._closed = False

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    @property
    def num_docs(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_bytes(self) -> int:
        return self.num_tokens * self.dtype.itemsize

    def add_document(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document's token ids (EOS, if wanted, is the caller's to include)."""
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document is a 1-D sequence of token ids, got shape {array.shape}")
        self.add_packed(array, np.array([array.size]))

    def add_packed(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append many documents at once: their ids back to back in `tokens`, their sizes in `lengths`."""
        if int(lengths.sum()) != tokens.size:
            raise ValueError(f"document lengths add up to {int(lengths.sum())} tokens, got {tokens.size}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueError(
                f"token id out of range [0, {self.vocab_size}) in documents for {self.bin_path}: "
                f"min {tokens.min()}, max {tokens.max()}"
            )
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._offsets.extend((self._offsets[-1] + np.cumsum(lengths, dtype=np.int64)).tolist())

    def add_documents(self, documents: Iterable[Sequence[int] | np.ndarray]) -> None:
        for document in documents:
            self.add_document(document)

    def close(self) -> None:
        """Write the index and publish both files (`.bin` first, `.idx` last)."""
        if self._closed:
            return
        self._bin.close()
        header = _HEADER.pack(
            MAGIC, VERSION, _DTYPE_CODES[self.dtype], self.num_docs, self.num_tokens,
            self.vocab_size, self.tokenizer_sha256.encode("ascii"),
        )
        with open(self._idx_tmp, "wb") as handle:
            handle.write(header)
            handle.write(np.asarray(self._offsets, dtype="<u8").tobytes())
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
    """A memory-mapped view of one shard; checks the header and sizes when opened."""

    def __init__(self, prefix: str | os.PathLike):
        self.bin_path, self.idx_path = shard_paths(prefix)
        self.prefix = self.bin_path.with_suffix("")
        header, offsets = _read_index(self.idx_path)
        _, _, dtype_code, self.num_docs, self.num_tokens, self.vocab_size, sha = header
        self.dtype = _DTYPES[dtype_code]
        self.tokenizer_sha256 = sha.decode("ascii")
        self.doc_offsets = offsets
        self.tokens = _map_tokens(self.bin_path, self.dtype, self.num_tokens)

    def __len__(self) -> int:
        return self.num_docs

    def document(self, index: int) -> np.ndarray:
        """Token ids of document `index` (a view into the memory map)."""
        if not 0 <= index < self.num_docs:
            raise IndexError(f"document {index} out of range for {self.idx_path} ({self.num_docs} documents)")
        return self.tokens[self.doc_offsets[index]:self.doc_offsets[index + 1]]

    def __getitem__(self, index: int) -> np.ndarray:
        return self.document(index)

    def __iter__(self):
        for index in range(self.num_docs):
            yield self.document(index)

    def __repr__(self) -> str:
        return f"ShardReader({str(self.prefix)!r}, docs={self.num_docs}, tokens={self.num_tokens})"


def _read_index(idx_path: Path) -> tuple[tuple, np.ndarray]:
    if not idx_path.exists():
        hint = " (a .bin without its .idx is an unfinished shard: re-run data preparation)" \
            if idx_path.with_suffix(".bin").exists() else ""
        raise ShardFormatError(f"shard index {idx_path} does not exist{hint}")
    raw = idx_path.read_bytes()
    if len(raw) < HEADER_SIZE:
        raise ShardFormatError(
            f"{idx_path}: truncated index ({len(raw)} bytes, the header alone is {HEADER_SIZE}); "
            "re-run data preparation for this shard"
        )
    header = _HEADER.unpack_from(raw, 0)
    magic, version, dtype_code, num_docs, num_tokens = header[:5]
    if magic != MAGIC:
        raise ShardFormatError(
            f"{idx_path}: not an ayumi shard index (magic {magic!r}, expected {MAGIC!r}); "
            "shards must be written by `ayumi data prepare`"
        )
    if version != VERSION:
        raise ShardFormatError(
            f"{idx_path}: shard format version {version}, this ayumi reads version {VERSION}; "
            "re-run data preparation with this version"
        )
    if dtype_code not in _DTYPES:
        raise ShardFormatError(f"{idx_path}: unknown token dtype code {dtype_code} (known: 1=uint16, 2=uint32)")
    expected = HEADER_SIZE + 8 * (num_docs + 1)
    if len(raw) != expected:
        raise ShardFormatError(
            f"{idx_path}: index is {len(raw)} bytes but a header for {num_docs} documents needs {expected}; "
            "the file is truncated or corrupt: re-run data preparation"
        )
    offsets = np.frombuffer(raw, dtype="<u8", offset=HEADER_SIZE, count=num_docs + 1).astype(np.int64)
    if offsets[0] != 0 or offsets[-1] != num_tokens or np.any(np.diff(offsets) < 0):
        raise ShardFormatError(f"{idx_path}: document offsets are inconsistent with {num_tokens} tokens")
    return header, offsets


def _map_tokens(bin_path: Path, dtype: np.dtype, num_tokens: int) -> np.ndarray:
    if not bin_path.exists():
        raise ShardFormatError(f"shard data {bin_path} does not exist (its .idx does): re-run data preparation")
    size = bin_path.stat().st_size
    if size != num_tokens * dtype.itemsize:
        raise ShardFormatError(
            f"{bin_path}: {size} bytes, but its index says {num_tokens} tokens of {dtype.itemsize} bytes "
            f"({num_tokens * dtype.itemsize} bytes); the file is truncated or corrupt: re-run data preparation"
        )
    if num_tokens == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(bin_path, dtype=dtype, mode="r", shape=(num_tokens,))


def find_shards(directory: str | os.PathLike) -> list[Path]:
    """Prefixes of the complete shards in a directory (those with an `.idx`), sorted by name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ShardFormatError(f"shard directory {directory} does not exist")
    return sorted(path.with_suffix("") for path in directory.glob("*.idx"))


def check_tokenizer(readers: Iterable[ShardReader], expected_sha256: str, tokenizer_path: str | os.PathLike) -> None:
    """Refuse shards made with another tokenizer than the run's (both named in the message)."""
    for reader in readers:
        if reader.tokenizer_sha256 != expected_sha256:
            raise TokenizerMismatchError(
                f"{reader.idx_path} was tokenized with tokenizer sha256 {reader.tokenizer_sha256}, "
                f"but this run's tokenizer {tokenizer_path} has sha256 {expected_sha256}; "
                "re-run `ayumi data prepare` with this tokenizer, or point the run at the tokenizer the shards were made with"
            )
