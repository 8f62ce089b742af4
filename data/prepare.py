"""Corpus → token shards: read, clean, de-duplicate, split, tokenize in N processes, pack, check.

In the parent process, one stream over every domain that needs work::

    files ─ blocks of ~chunk_mb ───────────────► worker pool (jsonl: parse; all: clean, key, encode + EOS)
          (jsonl raw; other formats as documents)  (data/workers.py)
          ◄─ results in chunk order ─ de-dup (key set) ─ split (pure function of the key) ─ shards
    (a marker after each domain's last chunk: its writer closes and publishes it)

Why the output is identical for any worker count: chunks are cut from the document stream alone,
results are consumed in chunk order, and every decision that depends on other documents
(de-duplication, the `val_count` split) is made in the parent in stream order.

Why one stream for all domains: a pool that drained at every domain boundary left a worker idle
while the other finished the domain's last chunk; with several domains per run that idle time
was most of what kept 2 workers from being twice as fast as one.

Memory: chunks in flight are bounded (2 per worker); the only per-document state is the set of
16-byte content keys for de-duplication (16 bytes per kept document, data/keyset.py), plus, for
`val_count`, the tokens of the N current validation candidates.

Atomicity and resume: a domain is written under `DATA_ROOT/.partial/<domain>/` and moved into
place when complete, with `domain.json` holding a fingerprint of (pipeline version, domain config,
input files with sizes and mtimes, tokenizer sha256, strict). A re-run skips domains whose
fingerprint matches and redoes any other from scratch. `manifest.json` is removed before any work
and written last, after the train/val overlap check passed.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from data.clean import DropCounts
from data.config import DataPrepareConfig, DomainConfig, check_prepare_config
from data.keyset import KeySet, split_keys
from data.manifest import (
    DOMAIN_RECORD_NAME, KEY_BYTES, KEYS_NAME, MANIFEST_NAME, build_manifest, read_domain_record, seal,
    shard_record, shards_intact, tokenizer_identity, write_json_atomic,
)
from data.prepare_profile import PrepareProfile
from data.shards import ShardWriter, dtype_for_vocab
from data.sources import ReadStats, domain_files, file_fingerprints
from data.workers import ChunkPool, ChunkResult, encode_chunk, encode_jsonl_blocks
from common.files import replace_dir
from common.corpus import COMPRESSION_SUFFIXES, READ_ERRORS, Recorder, detect_format, iter_file, read_jsonl_blocks

log = logging.getLogger("ayumi.data")

PIPELINE_VERSION = 2  # bump when cleaning, keys, packing or the shard format change: finished domains are then redone
# 2: Megatron's .bin/.idx format (was ayumi's AYUMIIDX); per-shard max id and sha256 in domain.json
PARTIAL_DIR = ".partial"
SPLITS = ("train", "val")
# Config keys behind each drop reason, for the message when filters empty a domain.
REASON_KEYS = {
    "too_short": "clean.min_chars", "too_long": "clean.max_chars", "duplicate": "clean.dedup",
    "low_script_share": "clean.min_script_share", "too_many_symbols": "clean.max_symbol_share",
    "empty_after_clean": "clean.tidy_whitespace", "missing_field": "text_field", "not_a_string": "text_field",
}


class PrepareError(RuntimeError):
    """Data preparation cannot produce a correct result; the message says which domain and why."""


class EmptyDomainError(PrepareError):
    """A domain has no training document left after reading and filtering."""


class OverlapError(PrepareError):
    """A validation document also sits in training data (the DALL·E Mega leak)."""


# ----------------------------------------------------------------------------------------------
# Shards and splits
# ----------------------------------------------------------------------------------------------


class ShardSequence:
    """One split's shards (`part_00000`, …), each capped at `cap_bytes`, plus its keys file."""

    def __init__(self, directory: Path, cap_bytes: int, vocab_size: int):
        self.directory = directory
        self.cap_bytes = cap_bytes
        self.vocab_size = vocab_size
        self.itemsize = dtype_for_vocab(vocab_size).itemsize
        self.shards: list[dict] = []
        self.docs = 0
        self.tokens = 0
        self._writer: ShardWriter | None = None
        self._keys = None

    def add_docs(self, keys: np.ndarray, lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Append documents in order: one 16-byte key row and one length per document, their tokens
        (each ending with EOS) back to back. A shard is closed when the next document would take it
        over the cap; a document larger than the cap gets a shard of its own."""
        ends = np.cumsum(lengths, dtype=np.int64)
        first, count = 0, len(lengths)
        while first < count:
            writer = self._writer or self._open_shard()
            start = int(ends[first - 1]) if first else 0
            room = (self.cap_bytes - writer.num_bytes) // self.itemsize  # tokens that still fit
            fit = int(np.searchsorted(ends, start + room, side="right")) - first
            if fit <= 0:
                if writer.num_docs:
                    self._finish_shard()
                    continue
                fit = 1
            self._write(writer, keys[first:first + fit], lengths[first:first + fit],
                        tokens[start:int(ends[first + fit - 1])])
            first += fit

    def add(self, key: bytes, tokens: np.ndarray) -> None:
        """Append one document (its tokens already end with EOS)."""
        self.add_docs(np.frombuffer(key, dtype=np.uint8).reshape(1, KEY_BYTES), np.array([tokens.size]), tokens)

    def _write(self, writer: ShardWriter, keys: np.ndarray, lengths: np.ndarray, tokens: np.ndarray) -> None:
        writer.add_packed(tokens, lengths)
        self._keys.write(keys.tobytes())
        self.docs += len(lengths)
        self.tokens += int(tokens.size)

    def _open_shard(self) -> ShardWriter:
        if self._keys is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._keys = open(self.directory / KEYS_NAME, "wb")
        prefix = self.directory / f"part_{len(self.shards):05d}"
        self._writer = ShardWriter(prefix, self.vocab_size)
        return self._writer

    def _finish_shard(self) -> None:
        writer = self._writer
        writer.close()
        self.shards.append(shard_record(writer))
        self._writer = None

    def close(self) -> dict:
        """Publish the last shard and return the split's record."""
        if self._writer is not None:
            self._finish_shard()
        if self._keys is not None:
            self._keys.close()
        return {"docs": self.docs, "tokens": self.tokens, "bytes": self.tokens * self.itemsize, "shards": self.shards}

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
        if self._keys is not None:
            self._keys.close()


def split_threshold(val_fraction: float) -> int:
    """Keys whose first 8 bytes (big-endian) are below this go to validation."""
    return int(val_fraction * 2**64)


def _select(mask: np.ndarray, keys: np.ndarray, lengths: np.ndarray, tokens: np.ndarray) -> tuple:
    """The documents of a chunk where `mask` is set: (keys, lengths, tokens back to back)."""
    if mask.all():
        return keys, lengths, tokens
    return keys[mask], lengths[mask], tokens[np.repeat(mask, lengths)]


class SplitRouter:
    """Sends each kept document to train or val, deterministically from its content key.

    With `val_fraction` the decision is a pure function of the key, so adding files never moves
    a document between splits; a chunk is routed with a few array operations. With `val_count`
    the N documents with the smallest keys are held in memory until the end; one pushed out by a
    smaller key goes to train at that moment. Adding files can then push former validation
    documents into training (compare val losses only across preparations of the same files;
    prefer val_fraction for growing corpora).
    """

    def __init__(self, train: ShardSequence, val: ShardSequence, domain: DomainConfig):
        self.train, self.val = train, val
        self.threshold = split_threshold(domain.val_fraction)
        self.val_count = domain.val_count
        self._heap: list[tuple[int, int, bytes, np.ndarray]] = []  # (-key value, arrival, key, tokens)
        self._arrival = 0

    def add_chunk(self, keys: np.ndarray, lengths: np.ndarray, tokens: np.ndarray, keep: np.ndarray) -> None:
        """Route a chunk's documents where `keep` is set (key rows, lengths and tokens as ShardSequence.add_docs)."""
        if self.val_count:
            ends = np.cumsum(lengths)
            for row in np.flatnonzero(keep):
                self._add_counted(keys[row].tobytes(), tokens[ends[row] - lengths[row]:ends[row]])
            return
        if self.threshold >= 2**64:
            to_val = np.ones(len(lengths), dtype=bool)
        else:
            to_val = split_keys(keys)[0] < np.uint64(self.threshold)  # the key's first 8 bytes, big-endian
        for target, mask in ((self.train, keep & ~to_val), (self.val, keep & to_val)):
            if mask.any():
                target.add_docs(*_select(mask, keys, lengths, tokens))

    def _add_counted(self, key: bytes, tokens: np.ndarray) -> None:
        self._arrival += 1
        negated = -int.from_bytes(key, "big")
        if len(self._heap) == self.val_count and negated <= self._heap[0][0]:  # not among the N smallest
            self.train.add(key, tokens)
            return
        # A copy: a view would keep its whole chunk's token array alive while the document waits here.
        entry = (negated, self._arrival, key, tokens.copy())
        if len(self._heap) < self.val_count:
            heapq.heappush(self._heap, entry)
        else:  # smaller key than the largest candidate: it replaces it
            _, _, out_key, out_tokens = heapq.heapreplace(self._heap, entry)
            self.train.add(out_key, out_tokens)

    def finish(self) -> None:
        """Write the `val_count` candidates to val, in the order they arrived."""
        for _, _, key, tokens in sorted(self._heap, key=lambda entry: entry[1]):
            self.val.add(key, tokens)
        self._heap = []


# ----------------------------------------------------------------------------------------------
# One run: a stream of chunks over every domain to do, results routed per domain
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DomainJob:
    """A domain this run must (re)write: what to read and what its output must match."""

    name: str
    domain: DomainConfig
    files: list[Path]
    inputs: list[dict]
    """(path, size, mtime) of every input file, from file_fingerprints."""
    fingerprint: str
    stats: ReadStats = dataclasses.field(default_factory=ReadStats)
    """Reader counts, filled in as the stream reads the domain's files."""
    spans: list | None = None
    """Per file, the byte range (start, stop) to read, or None for all of it: a task's piece of a large jsonl file
    (data/task_plan.py). A piece is counted as a file read only when it ends the file."""


def domain_fingerprint(domain: DomainConfig, files: list[dict], tokenizer_sha256: str, strict: bool) -> str:
    """sha256 over everything that determines a domain's output bytes."""
    payload = {
        "pipeline_version": PIPELINE_VERSION,
        "domain": dataclasses.asdict(domain),
        "files": files,
        "tokenizer_sha256": tokenizer_sha256,
        "strict": strict,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class JsonlBatch:
    """Stream meta of raw jsonl blocks sent to a worker together: the file of each block (its label: PATH, or
    PATH@BYTE for a task's piece of a file)."""

    paths: list[Path]


@dataclasses.dataclass(frozen=True)
class FileEnd:
    """Stream marker: a jsonl file read in blocks was read to its end (after the item with its last block)."""

    path: Path


class _ItemBuilder:
    """Groups one domain's input into work items of about `chunk_bytes`, across file boundaries.

    Documents (from the non-jsonl readers) and raw jsonl blocks go into separate items; switching
    between the two flushes, so items follow the file order. Grouping across files keeps a corpus
    of many small files from turning into as many tiny items, each paying a round trip to a worker.
    A jsonl block is its bytes (compressed files, read here) or a byte range the worker reads (jsonl_ranges).
    """

    def __init__(self, job: DomainJob, chunk_bytes: int):
        self.job, self.chunk_bytes = job, chunk_bytes
        self.clean = dataclasses.asdict(job.domain.clean)
        self._reset()

    def _reset(self) -> None:
        self.locations: list[str] = []
        self.texts: list[str] = []
        self.blocks: list[bytes | tuple[str, int, int]] = []
        self.block_paths: list[Path] = []
        self.ended: list[Path] = []
        self.size = 0

    def add_document(self, document) -> Iterator[tuple]:
        if self.blocks:
            yield from self.flush()
        self.locations.append(document.location)
        self.texts.append(document.text)
        self.size += len(document.text)
        if self.size >= self.chunk_bytes:
            yield from self.flush()

    def add_block(self, label: Path, block: bytes | tuple[str, int, int]) -> Iterator[tuple]:
        if self.texts:
            yield from self.flush()
        self.blocks.append(block)
        self.block_paths.append(label)
        self.size += len(block) if isinstance(block, bytes) else block[2] - block[1]
        if self.size >= self.chunk_bytes:
            yield from self.flush()

    def end_file(self, path: Path) -> None:
        """`path`, read in blocks, is complete: its FileEnd follows the item holding its last block."""
        self.ended.append(path)

    def flush(self) -> Iterator[tuple]:
        name = self.job.name
        if self.texts:
            yield (name, self.locations), (encode_chunk, self.clean, self.texts)
        if self.blocks:
            yield (name, JsonlBatch(self.block_paths)), (encode_jsonl_blocks, self.clean, self.blocks, self.job.domain.text_field)
        for path in self.ended:
            yield (name, FileEnd(path)), None
        self._reset()


def _file_items(builder: _ItemBuilder, path: Path, strict: bool, span: tuple[int, int] | None = None
                ) -> Iterator[tuple]:
    """One input file (or its byte range `span`, jsonl only) into the builder: raw blocks for jsonl (parsed by the
    workers), documents otherwise."""
    domain, stats = builder.job.domain, builder.job.stats
    fmt = detect_format(path) if domain.format == "auto" else domain.format
    if fmt != "jsonl":
        for document in iter_file(path, fmt=fmt, text_field=domain.text_field, strict=strict, stats=stats,
                                  text_unit=domain.text_unit):
            yield from builder.add_document(document)
        return
    # A piece from inside a file numbers its lines from its first byte: locations read PATH@BYTE:LINE.
    label = Path(f"{path}@{span[0]}") if span and span[0] else path
    try:
        if path.name.lower().endswith(COMPRESSION_SUFFIXES):  # no byte ranges in a compressed stream: read here
            blocks = (block for _, block in read_jsonl_blocks(path, builder.chunk_bytes, span))
        else:
            blocks = jsonl_ranges(path, builder.chunk_bytes, span)
        for block in blocks:
            yield from builder.add_block(label, block)
    except READ_ERRORS as err:
        Recorder(path, stats, strict).unreadable(err)
        return
    if span is None or span[1] >= _size(path):
        builder.end_file(label)


def jsonl_ranges(path: Path, block_bytes: int, span: tuple[int, int] | None = None) -> Iterator[tuple[str, int, int]]:
    """An uncompressed jsonl file (or its byte range `span`, cut at line starts) as (path, start, stop) ranges of
    ~block_bytes of whole lines, cut where common.corpus.read_jsonl_blocks cuts its blocks.

    The workers read the ranges themselves (data/workers.py). The parent reads only the line each cut falls in.
    Shipping every byte to a worker through a pipe cost the parent CPU, and kept the worker waiting on it.
    """
    with open(path, "rb") as handle:
        start, stop = span or (0, os.fstat(handle.fileno()).st_size)
        while start < stop:
            cut = start + block_bytes
            if cut >= stop:
                end = stop
            else:  # to the end of the line holding the cut's last byte (the cut itself, when that byte is a newline)
                handle.seek(cut - 1)
                end = cut - 1 + len(handle.readline())
            yield str(path), start, end
            start = end


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def work_stream(jobs: list[DomainJob], strict: bool, chunk_bytes: int) -> Iterator[tuple]:
    """Work items for ChunkPool.map_ordered: each job's items `((name, meta), (function, *args))`
    and markers `((name, FileEnd), None)`, then its end marker `((name, None), None)`.

    One stream for all domains keeps every worker busy across domain boundaries. A reading error
    (strict mode, an unreadable file) ends the stream with `((name, error), None)` in its place,
    so the domains before it still finish and are published before the error is raised.
    """
    for job in jobs:
        builder = _ItemBuilder(job, chunk_bytes)
        try:
            for path, span in zip(job.files, job.spans or [None] * len(job.files)):
                yield from _file_items(builder, path, strict, span)
            yield from builder.flush()
        except Exception as err:  # Ctrl-C is not deferred: it stops the run where it is
            # What was read before the error goes first: in strict mode an earlier bad record
            # must be the one reported, as when reading and parsing were one step.
            yield from builder.flush()
            yield (job.name, err), None
            return
        yield (job.name, None), None


def _progress(cfg: DataPrepareConfig, name: str):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(desc=name, unit="B", unit_scale=True, mininterval=1.0, dynamic_ncols=True)


class Deduper:
    """Drops documents whose content key was seen before in this domain (in stream order).

    The keys seen are the only state kept per document: 16 bytes each in a KeySet, so about
    1.6 GB per 100 M kept documents (a Python set took ~83 bytes each).
    """

    def __init__(self, mode: str):
        self.enabled = mode != "off"  # the domain's clean.dedup; the keys come in that mode from the workers
        self._seen = KeySet()

    def first_seen(self, keys: np.ndarray) -> np.ndarray:
        """A bool per key row of one chunk (distinct within it, as workers send them): True where new."""
        if not self.enabled:
            return np.ones(len(keys), dtype=bool)
        return self._seen.add_new(keys)


def _route_chunk(locate: Callable[[int], str], result: ChunkResult, deduper: Deduper, router: SplitRouter,
                 drops: DropCounts) -> None:
    """Apply one chunk's worker result in document order: count drops, de-duplicate, route the rest.

    `locate(i)` names the chunk's document i; it is only called for dropped ones.
    """
    keys = np.frombuffer(result.keys, dtype=np.uint8).reshape(-1, KEY_BYTES)
    keep = deduper.first_seen(keys)
    kept = 0
    for index, reason in enumerate(result.reasons):
        if reason is not None:
            drops.add(reason, locate(index))
            continue
        if not keep[kept]:
            drops.add("duplicate", locate(index))
        kept += 1
    router.add_chunk(keys, result.lengths, result.tokens, keep)


class DomainWriter:
    """The parent's side of one domain: routes its chunk results into `.partial/<name>/`, then
    publishes the folder (`finish`) or removes it (`abort`)."""

    def __init__(self, job: DomainJob, root: Path, cfg: DataPrepareConfig, tokenizer):
        self.job = job
        self.tokenizer = tokenizer
        self.out, self.partial = self._places(root)
        shutil.rmtree(self.partial, ignore_errors=True)
        self.partial.mkdir(parents=True)
        self._open_outputs(max(1, int(job.domain.shard_max_mb * 2**20)))
        self.deduper, self.drops = Deduper(job.domain.clean.dedup), DropCounts()
        self.docs, self.text_bytes, self.started = 0, 0, time.monotonic()
        self.file_docs: dict[Path, int] = {}  # documents so far of jsonl files read in blocks (empty_file check)
        self.file_lines: dict[Path, int] = {}  # lines so far of jsonl files read in blocks (workers number per block)
        self.strict = cfg.strict
        self._announce()
        self.bar = _progress(cfg, job.name)  # after the log line: a bar left open would share its line

    def _places(self, root: Path) -> tuple[Path, Path]:
        """(where the finished domain goes, where it is written meanwhile); a task's writer (data/tasks.py) differs."""
        return root / self.job.name, root / PARTIAL_DIR / self.job.name

    def _announce(self) -> None:
        log.info("%s: %d input files", self.job.name, len(self.job.files))

    def _open_outputs(self, cap: int) -> None:
        """The train and val shard sequences and the router that fills them."""
        self.train = ShardSequence(self.partial / "train", cap, self.tokenizer.vocab_size)
        self.val = ShardSequence(self.partial / "val", cap, self.tokenizer.vocab_size)
        self.router = SplitRouter(self.train, self.val, self.job.domain)

    def route(self, meta: list[str] | JsonlBatch | FileEnd, result: ChunkResult | None) -> None:
        """Take one stream item of this domain: a chunk's result, or the end of a jsonl file."""
        stats = self.job.stats
        if isinstance(meta, FileEnd):
            Recorder(meta.path, stats, self.strict).file_done(self.file_docs.pop(meta.path, 0))
            self.file_lines.pop(meta.path, None)
            return
        if isinstance(meta, JsonlBatch):
            # The worker numbered lines from 1 in each block: lines before the block, per file, are counted here.
            before = []
            for path, count in zip(meta.paths, result.lines_per_block):
                before.append(self.file_lines.get(path, 0))
                self.file_lines[path] = before[-1] + count
            # The worker parsed the blocks: their bad records and documents are counted here, in order.
            for block, line, skip in result.skips:
                path = meta.paths[block]
                Recorder(path, stats, self.strict).record(skip.reason, f"{path}:{before[block] + line}", skip.problem,
                                                          skip.fix)
            for path, count in zip(meta.paths, result.docs_per_block):
                self.file_docs[path] = self.file_docs.get(path, 0) + count
            stats.docs_read += len(result.reasons)
            block_ends = list(itertools.accumulate(result.docs_per_block))

            def locate(index: int) -> str:
                block = bisect.bisect_right(block_ends, index)
                return f"{meta.paths[block]}:{before[block] + result.lines[index]}"
        else:
            locate = meta.__getitem__
        _route_chunk(locate, result, self.deduper, self.router, self.drops)
        self.docs += len(result.reasons)
        self.text_bytes += result.text_bytes
        if self.bar is not None:
            self.bar.update(result.text_bytes)
            self.bar.set_postfix_str(f"{self.docs / max(time.monotonic() - self.started, 1e-9):,.0f} docs/s", refresh=False)

    def finish(self) -> dict:
        """Close the splits, check and record the domain, move it into place; returns its record."""
        job = self.job
        self.router.finish()
        packed = {"stats": job.stats, "drops": self.drops, "text_bytes": self.text_bytes,
                  "splits": {"train": self.train.close(), "val": self.val.close()}}
        self._close_bar()
        seconds = time.monotonic() - self.started
        log.info("%s: %s docs, %.1f MB of text in %.1fs (%.2f MB/s)", job.name, f"{self.docs:,}", self.text_bytes / 1e6,
                 seconds, self.text_bytes / 1e6 / max(seconds, 1e-9))
        record = _domain_record(job.name, job.domain, job.fingerprint, job.inputs, packed, self.tokenizer)
        if job.domain.megatron_val:  # validation from existing Megatron data, checked like a Megatron domain's
            from data.megatron import megatron_split

            record["splits"]["val"] = megatron_split(job.name, job.domain.megatron_val, "megatron_val", self.tokenizer,
                                                     job.domain.append_eod)
            record["tokens"] += record["splits"]["val"]["tokens"]
        record = seal(record)
        _check_not_empty(job.name, job.domain, record)
        _log_domain(job.name, job.domain, record)
        write_json_atomic(self.partial / DOMAIN_RECORD_NAME, record)
        replace_dir(self.partial, self.out)
        return record

    def abort(self) -> None:
        """Remove everything written so far: nothing half-written survives an error or Ctrl-C."""
        self.train.abort()
        self.val.abort()
        self._close_bar()
        shutil.rmtree(self.partial, ignore_errors=True)

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def prepare_domains(jobs: list[DomainJob], pool: ChunkPool, root: Path, cfg: DataPrepareConfig, tokenizer,
                    writer_class: type | None = None) -> dict[str, dict]:
    """Write every job's domain from one stream of chunks; returns their records by name.

    Results arrive in stream order, so a domain's end marker comes after all its chunks and
    before any chunk of the next domain: one DomainWriter is open at a time. `writer_class`
    (default DomainWriter) is what an array task writes its share with (data/tasks.py).
    """
    writer_class = writer_class or DomainWriter
    by_name = {job.name: job for job in jobs}
    records: dict[str, dict] = {}
    writer: DomainWriter | None = None
    chunk_bytes = max(1, int(cfg.chunk_mb * 2**20))
    try:
        for (name, meta), result in pool.map_ordered(work_stream(jobs, cfg.strict, chunk_bytes)):
            if writer is None:
                writer = writer_class(by_name[name], root, cfg, tokenizer)
            if isinstance(meta, Exception):
                raise meta
            if meta is None:
                with pool.profile.phase("finishing_domains"):
                    records[name] = writer.finish()
                writer = None
            else:
                writer.route(meta, result)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return records


def _domain_record(name: str, domain: DomainConfig, fingerprint: str, inputs: list[dict], packed: dict, tokenizer) -> dict:
    stats: ReadStats = packed["stats"]
    drops: DropCounts = packed["drops"]
    # Documents: docs_read == docs_kept + sum(dropped). Reader skips (bad records, empty or broken
    # files) never became documents: counted apart in `skipped`; their locations share drop_examples.
    dropped = dict(sorted(drops.counts.items()))
    examples = dict(sorted({**stats.examples, **drops.examples}.items()))
    splits = {split: record for split, record in packed["splits"].items() if record["docs"]}
    return {
        "domain": name,
        "fingerprint": fingerprint,
        "config": dataclasses.asdict(domain),
        "inputs": [{"path": item["path"], "size": item["size"]} for item in inputs],
        "files_read": stats.files_read,
        "docs_read": stats.docs_read,
        "text_bytes": packed["text_bytes"],
        "docs_kept": sum(record["docs"] for record in splits.values()),
        "dropped": dropped,
        "skipped": dict(sorted(stats.skipped.items())),
        "drop_examples": examples,
        "tokens": sum(record["tokens"] for record in splits.values()),
        "tokenizer": tokenizer_identity(tokenizer),
        "splits": splits,
    }


def _check_not_empty(name: str, domain: DomainConfig, record: dict) -> None:
    """Raise EmptyDomainError when a domain has no training documents, naming what emptied it."""
    train_docs = record["splits"].get("train", {}).get("docs", 0)
    if train_docs:
        return
    key = f"data.domains.{name}"
    if record["docs_kept"]:
        raise EmptyDomainError(
            f"domain {name!r}: all {record['docs_kept']} kept documents went to validation "
            f"(val_fraction={domain.val_fraction}, val_count={domain.val_count}). Fix: lower {key}.val_count/val_fraction or add inputs."
        )
    reasons = ", ".join(
        f"{reason}={count}" + (f" ({key}.{REASON_KEYS[reason]})" if reason in REASON_KEYS else "")
        for reason, count in sorted({**record["skipped"], **record["dropped"]}.items(), key=lambda item: -item[1])
    ) or "nothing was dropped: the inputs hold no documents"
    raise EmptyDomainError(
        f"domain {name!r} is empty: {record['files_read']} files read, {record['docs_read']} documents, none kept. "
        f"Dropped or skipped by: {reasons}. Fix: check {key}.inputs/format/text_field, or loosen those filters."
    )


def _log_domain(name: str, domain: DomainConfig, record: dict) -> None:
    """One line of counts per domain, and a warning when a requested validation split came out empty.

    The counts add up: kept + dropped = docs read; reader skips are not documents and are listed apart.
    """
    def counts(by_reason: dict) -> str:  # "3: duplicate=1, too_short=2", or "0"
        listed = ", ".join(f"{reason}={count:,}" for reason, count in by_reason.items())
        return f"{sum(by_reason.values()):,}: {listed}" if listed else "0"

    skipped = record["skipped"]
    skipped = f"; readers skipped {counts(skipped)} (bad records/files, not docs)" if skipped else ""
    splits = record["splits"]
    log.info("%s: kept %s of %s docs (dropped %s)%s; train %s tokens, val %s docs / %s tokens", name,
             f"{record['docs_kept']:,}", f"{record['docs_read']:,}", counts(record["dropped"]), skipped,
             f"{splits['train']['tokens']:,}", f"{splits.get('val', {}).get('docs', 0):,}",
             f"{splits.get('val', {}).get('tokens', 0):,}")
    if (domain.val_fraction > 0 or domain.val_count > 0) and "val" not in splits:
        log.warning("%s: no document fell into the validation split (val_fraction=%s of %d docs); "
                    "raise data.domains.%s.val_fraction or use val_count", name, domain.val_fraction,
                    record["docs_kept"], name)


def finished_record(out: Path, fingerprint: str) -> dict | None:
    """The record of a finished domain folder with this fingerprint whose files are all there, else None."""
    record = read_domain_record(out)
    if record is None or record.get("fingerprint") != fingerprint or not shards_intact(out, record):
        return None
    return record

def check_overlap(root: Path, names: Iterable[str], chunk_rows: int = 1 << 20) -> dict:
    """Fail if any validation document's content key is also in any domain's training data.

    Within a domain the split already rules this out; across domains (ja_raw and ja_clean built
    from the same crawl, say) it does not, so every domain's train keys are checked against the
    union of all validation keys. Reads keys.bin files in chunks: memory is bounded by the val set.
    """
    names = list(names)
    val_keys: dict[bytes, str] = {}
    for name in names:
        for key in _iter_keys(root / name / "val" / KEYS_NAME, chunk_rows, as_bytes=True):
            val_keys.setdefault(key, name)
    train_checked = 0
    leaks: list[str] = []
    leak_count = 0
    if val_keys:
        val_prefixes = np.array(sorted({int.from_bytes(key[:8], "little") for key in val_keys}), dtype=np.uint64)
        for name in names:
            position = 0
            for block in _iter_keys(root / name / "train" / KEYS_NAME, chunk_rows, as_bytes=False):
                candidates = np.flatnonzero(np.isin(block.view("<u8")[:, 0], val_prefixes))
                for row in candidates:  # the first 8 bytes match: confirm on all 16
                    key = block[row].tobytes()
                    if key in val_keys:
                        leak_count += 1
                        if len(leaks) < 5:
                            leaks.append(f"{key.hex()} (val of {val_keys[key]!r}, train of {name!r} document #{position + row})")
                position += len(block)
                train_checked += len(block)
    if leak_count:
        raise OverlapError(
            f"{leak_count} validation documents also sit in training data: {'; '.join(leaks)}. "
            "Validation must never be trained on. Fix: give the domains that share documents the same "
            "val_fraction (the split is a function of the content, so a shared document then lands in "
            "the same split everywhere), or remove the duplicated inputs from one of the domains."
        )
    return {"passed": True, "val_docs": len(val_keys), "train_docs_checked": train_checked}


def _iter_keys(path: Path, chunk_rows: int, as_bytes: bool):
    """The 16-byte keys of a keys.bin file, in blocks of rows (or one by one as bytes)."""
    if not path.is_file():
        return
    total = path.stat().st_size // KEY_BYTES
    with open(path, "rb") as handle:
        for _ in range(0, total, chunk_rows):
            block = np.frombuffer(handle.read(chunk_rows * KEY_BYTES), dtype=np.uint8).reshape(-1, KEY_BYTES)
            if as_bytes:
                yield from (row.tobytes() for row in block)
            else:
                yield block


def _load_tokenizer(cfg: DataPrepareConfig):
    """The declared tokenizer (an ayumi folder, a SentencePiece .model or a Hugging Face folder), checked
    for what this config's domains need: corpus text is encoded with SentencePiece and ends every document with EOS."""
    from tokenizer.declared import load_declared_tokenizer

    tokenizer = load_declared_tokenizer(cfg.tokenizer_dir)
    corpus = [name for name, domain in cfg.data.domains.items() if not domain.megatron]
    if corpus and (tokenizer.eod_id is None or tokenizer.eod_id < 0):
        raise PrepareError(
            f"tokenizer {cfg.tokenizer_dir} has no EOS piece; documents are separated by EOS. "
            "Fix: train the tokenizer with an EOS piece (sentencepiece eos_id >= 0).")
    return tokenizer


def _encoder_path(tokenizer) -> str:
    """What the workers load: a SentencePiece model file, or a Hugging Face folder (data/workers.py)."""
    path = Path(tokenizer.path)
    return str(path / "tokenizer.model" if tokenizer.kind == "ayumi" else path)


def prepare(cfg: DataPrepareConfig) -> dict:
    """Prepare every domain of `cfg` (skipping finished ones), check train/val overlap, write the manifest."""
    profile = PrepareProfile.from_env()
    check_prepare_config(cfg)
    info = _load_tokenizer(cfg)
    root = Path(cfg.data.root)
    root.mkdir(parents=True, exist_ok=True)
    records: dict[str, dict] = {}
    jobs: list[DomainJob] = []
    for name, (files, inputs, fingerprint, record) in _plan(cfg, root, info).items():
        if record is None and cfg.data.domains[name].megatron:
            (root / MANIFEST_NAME).unlink(missing_ok=True)  # from here on, the root is not complete
            records[name] = register_megatron_domain(root, name, cfg.data.domains[name], info, fingerprint)
        elif record is None:
            jobs.append(DomainJob(name, cfg.data.domains[name], files, inputs, fingerprint))
        else:
            log.info("%s: up to date (%s docs, %s tokens), skipped", name, f"{record['docs_kept']:,}", f"{record['tokens']:,}")
            records[name] = record
    if jobs:
        (root / MANIFEST_NAME).unlink(missing_ok=True)  # from here on, the root is not complete
        # Built before any progress bar: under `fork` the workers must start while this process
        # has no other thread (data/workers.py).
        pool = ChunkPool(cfg.workers, _encoder_path(info), cfg.encode_threads, info.eod_id, cfg.start_method, profile)
        profile.phases["start"] = time.monotonic() - profile.started
        try:
            with profile.phase("stream"):
                records.update(prepare_domains(jobs, pool, root, cfg, info))
        finally:
            with profile.phase("closing_pool"):
                pool.close()
            with contextlib.suppress(OSError):
                (root / PARTIAL_DIR).rmdir()  # only when empty: an interrupted domain has cleaned up after itself
    shutil.rmtree(root / PARTIAL_DIR, ignore_errors=True)
    records = {name: records[name] for name in cfg.data.domains}  # config order, as before
    with profile.phase("overlap_and_manifest"):
        overlap = check_overlap(root, records)
        manifest = build_manifest(cfg.data.name, tokenizer_identity(info), records, overlap)
        write_json_atomic(root / MANIFEST_NAME, manifest)
    _note_stray_domains(root, records)
    profile.write()
    return manifest


def register_megatron_domain(root: Path, name: str, domain: DomainConfig, tokenizer, fingerprint: str,
                             where: str = "data.domains", curriculum: str | None = None) -> dict:
    """Check a Megatron domain's prefixes and publish its folder (just domain.json); returns its record.

    `where` names the config section in messages; `curriculum` (data/register.py) records which curriculum
    file declared the domain, so fixes name the command that registers it again.
    """
    from data.megatron import megatron_record

    started = time.monotonic()
    record = megatron_record(name, domain, tokenizer, fingerprint, where)
    if curriculum is not None:
        record["curriculum"] = curriculum
    record = seal(record)
    partial = root / PARTIAL_DIR / name
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_json_atomic(partial / DOMAIN_RECORD_NAME, record)
    replace_dir(partial, root / name)
    splits = record["splits"]
    log.info("%s: Megatron data, %d prefixes checked in %.1fs; train %s docs / %s tokens, val %s docs / %s tokens%s",
             name, record["files_read"], time.monotonic() - started, f"{splits['train']['docs']:,}",
             f"{splits['train']['tokens']:,}", f"{splits.get('val', {}).get('docs', 0):,}",
             f"{splits.get('val', {}).get('tokens', 0):,}", " (EOD appended when read)" if domain.append_eod else "")
    return record


def _plan(cfg: DataPrepareConfig, root: Path, info) -> dict[str, tuple]:
    """Per domain: (files, input fingerprints, fingerprint, finished record or None when work is needed)."""
    from data import megatron

    plan = {}
    for name, domain in cfg.data.domains.items():
        if domain.megatron:
            fingerprint = megatron.domain_fingerprint(name, domain, info.sha256, PIPELINE_VERSION)
            files, inputs = [], []
        else:
            files = domain_files(name, domain)
            inputs = file_fingerprints(files)
            fingerprint = domain_fingerprint(domain, inputs, info.sha256, cfg.strict)
            if domain.megatron_val:  # a changed validation prefix redoes the domain too
                fingerprint = hashlib.sha256((fingerprint + megatron.domain_fingerprint(
                    name, domain, info.sha256, PIPELINE_VERSION)).encode("ascii")).hexdigest()
        record = None if cfg.force else finished_record(root / name, fingerprint)
        plan[name] = (files, inputs, fingerprint, record)
    return plan


def _note_stray_domains(root: Path, records: dict) -> None:
    stray = sorted(path.name for path in root.iterdir()
                   if path.is_dir() and not path.name.startswith(".") and path.name not in records)
    if stray:
        log.warning("folders under %s that are not domains of this config (not in manifest.json): %s",
                    root, ", ".join(stray))
