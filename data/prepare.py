"""Corpus → token shards: read, clean, de-duplicate, split, tokenize in N processes, pack, check.

Per domain, in the parent process::

    files ─ iter_domain ─ chunks of ~chunk_mb text ─► worker pool (clean, key, encode + EOS)
          ◄─ results in chunk order ─ de-dup (key set) ─ split (pure function of the key) ─ shards

Why the output is identical for any worker count: chunks are cut from the document stream alone,
results are consumed in chunk order, and every decision that depends on other documents
(de-duplication, the `val_count` split) is made in the parent in stream order.

Why `spawn` workers: the parent may have imported torch or other threaded libraries (tests, the
demo), and forking a process that holds threads can deadlock the child. Spawning costs a fraction
of a second per worker once per run; each worker loads the SentencePiece model once.

Memory: chunks in flight are bounded (2 per worker); the only per-document state is the set of
16-byte content keys for de-duplication (~100 bytes per kept document in a Python set), plus, for
`val_count`, the tokens of the N current validation candidates.

Atomicity and resume: a domain is written under `DATA_ROOT/.partial/<domain>/` and moved into
place when complete, with `domain.json` holding a fingerprint of (pipeline version, domain config,
input files with sizes and mtimes, tokenizer sha256, strict). A re-run skips domains whose
fingerprint matches and redoes any other from scratch. `manifest.json` is removed before any work
and written last, after the train/val overlap check passed.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import json
import logging
import multiprocessing
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from data.clean import Cleaner, DropCounts, content_key
from data.config import CleanConfig, DataPrepareConfig, DomainConfig, check_prepare_config
from data.manifest import (
    DOMAIN_RECORD_NAME, KEY_BYTES, KEYS_NAME, MANIFEST_NAME, build_manifest, read_domain_record,
    shards_intact, write_json_atomic,
)
from data.shards import ShardWriter, dtype_for_vocab
from data.sources import ReadStats, domain_files, file_fingerprints, iter_domain

log = logging.getLogger("ayumi.data")

PIPELINE_VERSION = 1  # bump when cleaning, keys or packing change: finished domains are then redone
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
# Worker side: clean, key and encode one chunk. Module-level state, set once per process.
# ----------------------------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(model_path: str, encode_threads: int, eos_id: int, ignore_sigint: bool = False) -> None:
    import sentencepiece as spm

    if ignore_sigint:  # Ctrl-C reaches the whole process group: let the parent alone handle it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _exit_with_parent()
    _worker["sp"] = spm.SentencePieceProcessor(model_file=model_path)
    _worker["threads"] = encode_threads
    _worker["eos"] = eos_id
    _worker["cleaners"] = {}


def _exit_with_parent(poll_seconds: float = 1.0) -> None:
    """End this worker when the parent dies (SIGKILL, OOM killer): orphans would otherwise wait forever."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


@contextlib.contextmanager
def _sigint_ignored():
    """Ignore SIGINT in this process while the block runs (children started meanwhile inherit it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _cleaner(clean: dict) -> Cleaner:
    cache_key = json.dumps(clean, sort_keys=True)
    cleaner = _worker["cleaners"].get(cache_key)
    if cleaner is None:
        cleaner = _worker["cleaners"][cache_key] = Cleaner(CleanConfig(**clean))
    return cleaner


def encode_chunk(clean: dict, texts: list[str]) -> tuple[list, bytes, np.ndarray, np.ndarray, int]:
    """Clean, key and tokenize one chunk of documents (runs in a worker).

    Returns (reasons, keys, lengths, tokens, text_bytes): `reasons[i]` is None for a kept document
    or its drop reason; `keys` holds 16 bytes per kept document; `lengths` the token count of
    each kept document including the EOS appended to it; `tokens` all of them back to back.
    Duplicates inside the chunk are dropped here, before paying for their encoding.
    """
    cleaner = _cleaner(clean)
    dedup = clean["dedup"]
    reasons: list[str | None] = []
    kept_texts: list[str] = []
    keys: list[bytes] = []
    seen: set[bytes] = set()
    text_bytes = 0
    for text in texts:
        text_bytes += len(text.encode("utf-8"))
        cleaned, reason = cleaner(text)
        if reason is None:
            key = content_key(cleaned)
            if dedup and key in seen:
                reason = "duplicate"
            else:
                seen.add(key)
                keys.append(key)
                kept_texts.append(cleaned)
        reasons.append(reason)
    ids = _worker["sp"].encode(kept_texts, out_type=int, num_threads=_worker["threads"]) if kept_texts else []
    raw_lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(raw_lengths.sum()))
    tokens = np.insert(flat, np.cumsum(raw_lengths), _worker["eos"])  # EOS after every document
    return reasons, b"".join(keys), raw_lengths + 1, tokens, text_bytes


class ChunkPool:
    """Runs `encode_chunk` over a stream of chunks, in N spawned processes or in this one (N = 0).

    Results come back in submission order with at most 2 chunks per worker in flight, so memory
    stays bounded however long the stream is. A worker that dies (or fails to load the model)
    raises BrokenProcessPool here instead of hanging the run.
    """

    def __init__(self, workers: int, model_path: str, encode_threads: int, eos_id: int):
        self.workers = workers
        init_args = (model_path, encode_threads, eos_id)
        self._executor: ProcessPoolExecutor | None = None
        if workers > 0:
            self._executor = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(*init_args, True),
            )
            with _sigint_ignored():  # children are born ignoring Ctrl-C, even during their imports
                # One no-op per worker: the executor starts a process per submit while none is idle.
                warmups = [self._executor.submit(os.getpid) for _ in range(workers)]
            for warmup in warmups:
                warmup.result()  # a model that fails to load fails here, before any reading
        else:
            _init_worker(*init_args)

    def map_ordered(self, chunks: Iterable[tuple[object, dict, list[str]]]) -> Iterator[tuple[object, tuple]]:
        """(meta, encode_chunk result) per (meta, clean config, texts) chunk, in order."""
        if self._executor is None:
            for meta, clean, texts in chunks:
                yield meta, encode_chunk(clean, texts)
            return
        pending: collections.deque = collections.deque()
        for meta, clean, texts in chunks:
            pending.append((meta, self._executor.submit(encode_chunk, clean, texts)))
            if len(pending) >= 2 * self.workers:
                meta_done, future = pending.popleft()
                yield meta_done, future.result()
        while pending:
            meta_done, future = pending.popleft()
            yield meta_done, future.result()

    def close(self) -> None:
        """Stop the workers; chunks not yet started are dropped (after an error or Ctrl-C nothing waits for them)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


# ----------------------------------------------------------------------------------------------
# Parent side: shards, splits, one domain, the whole run.
# ----------------------------------------------------------------------------------------------


class ShardSequence:
    """One split's shards (`part_00000`, …), each capped at `cap_bytes`, plus its keys file."""

    def __init__(self, directory: Path, cap_bytes: int, vocab_size: int, tokenizer_sha256: str):
        self.directory = directory
        self.cap_bytes = cap_bytes
        self.vocab_size = vocab_size
        self.sha = tokenizer_sha256
        self.itemsize = dtype_for_vocab(vocab_size).itemsize
        self.shards: list[dict] = []
        self.docs = 0
        self.tokens = 0
        self._writer: ShardWriter | None = None
        self._keys = None

    def add(self, key: bytes, tokens: np.ndarray) -> None:
        """Append one document (its tokens already end with EOS); opens the next shard when this one is full."""
        writer = self._writer
        if writer is not None and writer.num_docs and writer.num_bytes + tokens.size * self.itemsize > self.cap_bytes:
            self._finish_shard()
            writer = None
        if writer is None:
            if self._keys is None:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._keys = open(self.directory / KEYS_NAME, "wb")
            prefix = self.directory / f"part_{len(self.shards):05d}"
            writer = self._writer = ShardWriter(prefix, self.vocab_size, self.sha)
        writer.add_document(tokens)
        self._keys.write(key)
        self.docs += 1
        self.tokens += int(tokens.size)

    def _finish_shard(self) -> None:
        writer = self._writer
        writer.close()
        self.shards.append({"name": writer.bin_path.stem, "docs": writer.num_docs, "tokens": writer.num_tokens,
                            "bytes": writer.num_bytes})
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


class SplitRouter:
    """Sends each kept document to train or val, deterministically from its content key.

    With `val_fraction` the decision is a pure function of the key, so adding files never moves
    a document between splits. With `val_count` the N documents with the smallest keys are held
    in memory until the end; one pushed out by a smaller key goes to train at that moment. Adding
    files can then push former validation documents into training (compare val losses only across
    preparations of the same files; prefer val_fraction for growing corpora).
    """

    def __init__(self, train: ShardSequence, val: ShardSequence, domain: DomainConfig):
        self.train, self.val = train, val
        self.threshold = split_threshold(domain.val_fraction)
        self.val_count = domain.val_count
        self._heap: list[tuple[int, int, bytes, np.ndarray]] = []  # (-key value, arrival, key, tokens)
        self._arrival = 0

    def add(self, key: bytes, tokens: np.ndarray) -> None:
        if not self.val_count:
            target = self.val if int.from_bytes(key[:8], "big") < self.threshold else self.train
            target.add(key, tokens)
            return
        self._arrival += 1
        entry = (-int.from_bytes(key, "big"), self._arrival, key, tokens)
        if len(self._heap) < self.val_count:
            heapq.heappush(self._heap, entry)
        elif entry[0] > self._heap[0][0]:  # smaller key than the largest candidate: it replaces it
            _, _, out_key, out_tokens = heapq.heapreplace(self._heap, entry)
            self.train.add(out_key, out_tokens)
        else:
            self.train.add(key, tokens)

    def finish(self) -> None:
        """Write the `val_count` candidates to val, in the order they arrived."""
        for _, _, key, tokens in sorted(self._heap, key=lambda entry: entry[1]):
            self.val.add(key, tokens)
        self._heap = []


@dataclasses.dataclass
class RunContext:
    """What every domain of one run shares."""

    cfg: DataPrepareConfig
    root: Path
    tokenizer: object  # tokenizer.TokenizerInfo
    pool_factory: Callable[[], ChunkPool]
    _pool: ChunkPool | None = None

    @property
    def pool(self) -> ChunkPool:
        if self._pool is None:  # started on first need, so a run with nothing to do spawns nothing
            self._pool = self.pool_factory()
        return self._pool


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


def _chunks(documents: Iterable, clean: dict, chunk_chars: int) -> Iterator[tuple[list[str], dict, list[str]]]:
    """(locations, clean config, texts) groups of about `chunk_chars` characters, cut from the stream alone."""
    locations: list[str] = []
    texts: list[str] = []
    size = 0
    for document in documents:
        locations.append(document.location)
        texts.append(document.text)
        size += len(document.text)
        if size >= chunk_chars:
            yield locations, clean, texts
            locations, texts, size = [], [], 0
    if texts:
        yield locations, clean, texts


def _progress(cfg: DataPrepareConfig, name: str):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    return tqdm(desc=name, unit="B", unit_scale=True, mininterval=1.0, dynamic_ncols=True)


class Deduper:
    """Drops documents whose content key was seen before in this domain (in stream order).

    The set of 16-byte keys is the only state kept per document: ~100 bytes each in a Python
    set, so about 1 GB per 10 M kept documents.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._seen: set[bytes] = set()

    def is_duplicate(self, key: bytes) -> bool:
        if not self.enabled:
            return False
        if key in self._seen:
            return True
        self._seen.add(key)
        return False


def _route_chunk(locations: list[str], result: tuple, deduper: Deduper, router: SplitRouter, drops: DropCounts) -> None:
    """Apply one chunk's worker result in document order: count drops, de-duplicate, route the rest."""
    reasons, keys, lengths, tokens, _ = result
    ends = np.cumsum(lengths)
    kept = 0
    for location, reason in zip(locations, reasons):
        if reason is not None:
            drops.add(reason, location)
            continue
        key = keys[KEY_BYTES * kept:KEY_BYTES * (kept + 1)]
        start, end = (int(ends[kept - 1]) if kept else 0), int(ends[kept])
        kept += 1
        if deduper.is_duplicate(key):
            drops.add("duplicate", location)
        else:
            router.add(key, tokens[start:end])


def _pack_domain(name: str, domain: DomainConfig, files: list[Path], out: Path, ctx: RunContext) -> dict:
    """Read, clean, encode and write one domain under `out`; returns its counts and split records."""
    info = ctx.tokenizer
    cap = max(1, int(domain.shard_max_mb * 2**20))
    train = ShardSequence(out / "train", cap, info.vocab_size, info.sha256)
    val = ShardSequence(out / "val", cap, info.vocab_size, info.sha256)
    router, deduper = SplitRouter(train, val, domain), Deduper(domain.clean.dedup)
    stats, drops = ReadStats(), DropCounts()
    chunk_chars = max(1, int(ctx.cfg.chunk_mb * 2**20))
    bar = _progress(ctx.cfg, name)
    docs_done, text_bytes, started = 0, 0, time.monotonic()
    try:
        documents = iter_domain(files, domain, ctx.cfg.strict, stats)
        for locations, result in ctx.pool.map_ordered(_chunks(documents, dataclasses.asdict(domain.clean), chunk_chars)):
            _route_chunk(locations, result, deduper, router, drops)
            docs_done += len(locations)
            text_bytes += result[-1]
            if bar is not None:
                bar.update(result[-1])
                bar.set_postfix_str(f"{docs_done / max(time.monotonic() - started, 1e-9):,.0f} docs/s", refresh=False)
        router.finish()
        splits = {"train": train.close(), "val": val.close()}
    except BaseException:
        train.abort()
        val.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    seconds = time.monotonic() - started
    log.info("%s: %s docs, %.1f MB of text in %.1fs (%.2f MB/s)", name, f"{docs_done:,}", text_bytes / 1e6,
             seconds, text_bytes / 1e6 / max(seconds, 1e-9))
    return {"stats": stats, "drops": drops, "splits": splits, "text_bytes": text_bytes}


def _domain_record(name: str, domain: DomainConfig, fingerprint: str, inputs: list[dict], packed: dict) -> dict:
    stats: ReadStats = packed["stats"]
    drops: DropCounts = packed["drops"]
    dropped = dict(sorted({**stats.skipped, **drops.counts}.items()))
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
        "drop_examples": examples,
        "tokens": sum(record["tokens"] for record in splits.values()),
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
        for reason, count in sorted(record["dropped"].items(), key=lambda item: -item[1])
    ) or "nothing was dropped: the inputs hold no documents"
    raise EmptyDomainError(
        f"domain {name!r} is empty: {record['files_read']} files read, {record['docs_read']} documents, none kept. "
        f"Dropped by: {reasons}. Fix: check {key}.inputs/format/text_field, or loosen those filters."
    )


def _log_domain(name: str, domain: DomainConfig, record: dict) -> None:
    """One line of counts per domain, and a warning when a requested validation split came out empty."""
    dropped = ", ".join(f"{reason}={count:,}" for reason, count in record["dropped"].items()) or "nothing"
    splits = record["splits"]
    log.info("%s: kept %s of %s docs (dropped: %s); train %s tokens, val %s docs / %s tokens", name,
             f"{record['docs_kept']:,}", f"{record['docs_read']:,}", dropped, f"{splits['train']['tokens']:,}",
             f"{splits.get('val', {}).get('docs', 0):,}", f"{splits.get('val', {}).get('tokens', 0):,}")
    if (domain.val_fraction > 0 or domain.val_count > 0) and "val" not in splits:
        log.warning("%s: no document fell into the validation split (val_fraction=%s of %d docs); "
                    "raise data.domains.%s.val_fraction or use val_count", name, domain.val_fraction,
                    record["docs_kept"], name)


def _finished_record(out: Path, fingerprint: str) -> dict | None:
    """The record of a finished domain folder with this fingerprint whose files are all there, else None."""
    record = read_domain_record(out)
    if record is None or record.get("fingerprint") != fingerprint or not shards_intact(out, record):
        return None
    return record


def prepare_domain(name: str, domain: DomainConfig, ctx: RunContext, files: list[Path], inputs: list[dict],
                   fingerprint: str) -> dict:
    """Write one domain from scratch under `.partial/`, then move it into place; returns its record."""
    out = ctx.root / name
    partial = ctx.root / PARTIAL_DIR / name
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        packed = _pack_domain(name, domain, files, partial, ctx)
        record = _domain_record(name, domain, fingerprint, inputs, packed)
        _check_not_empty(name, domain, record)
        _log_domain(name, domain, record)
        write_json_atomic(partial / DOMAIN_RECORD_NAME, record)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # nothing half-written survives an error or Ctrl-C
        raise
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
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


def _load_tokenizer(tokenizer_dir: str):
    from tokenizer import load_tokenizer_info

    info = load_tokenizer_info(tokenizer_dir)
    if info.eos_id is None or info.eos_id < 0:
        raise PrepareError(
            f"tokenizer {info.model_path} has no EOS piece (eos_id={info.eos_id}); documents are separated by EOS. "
            "Fix: train the tokenizer with an EOS piece (sentencepiece eos_id >= 0)."
        )
    return info


def prepare(cfg: DataPrepareConfig) -> dict:
    """Prepare every domain of `cfg` (skipping finished ones), check train/val overlap, write the manifest."""
    check_prepare_config(cfg)
    info = _load_tokenizer(cfg.tokenizer_dir)
    root = Path(cfg.data.root)
    root.mkdir(parents=True, exist_ok=True)
    ctx = RunContext(cfg, root, info, lambda: ChunkPool(cfg.workers, str(info.model_path), cfg.encode_threads, info.eos_id))
    plan = _plan(cfg, root, info)
    if any(record is None for *_, record in plan.values()):
        (root / MANIFEST_NAME).unlink(missing_ok=True)  # from here on, the root is not complete
    records: dict[str, dict] = {}
    try:
        for name, (files, inputs, fingerprint, record) in plan.items():
            domain = cfg.data.domains[name]
            if record is not None:
                log.info("%s: up to date (%s docs, %s tokens), skipped", name, f"{record['docs_kept']:,}", f"{record['tokens']:,}")
            else:
                log.info("%s: %d input files", name, len(files))
                record = prepare_domain(name, domain, ctx, files, inputs, fingerprint)
            records[name] = record
    finally:
        if ctx._pool is not None:
            ctx._pool.close()
        with contextlib.suppress(OSError):
            (root / PARTIAL_DIR).rmdir()  # only when empty: an interrupted domain has cleaned up after itself
    shutil.rmtree(root / PARTIAL_DIR, ignore_errors=True)
    overlap = check_overlap(root, records)
    tokenizer = {"sha256": info.sha256, "model_path": str(info.model_path), "vocab_size": info.vocab_size,
                 "eos_id": info.eos_id}
    manifest = build_manifest(cfg.data.name, tokenizer, records, overlap)
    write_json_atomic(root / MANIFEST_NAME, manifest)
    _note_stray_domains(root, records)
    return manifest


def _plan(cfg: DataPrepareConfig, root: Path, info) -> dict[str, tuple]:
    """Per domain: (files, input fingerprints, fingerprint, finished record or None when work is needed)."""
    plan = {}
    for name, domain in cfg.data.domains.items():
        files = domain_files(name, domain)
        inputs = file_fingerprints(files)
        fingerprint = domain_fingerprint(domain, inputs, info.sha256, cfg.strict)
        record = None if cfg.force else _finished_record(root / name, fingerprint)
        plan[name] = (files, inputs, fingerprint, record)
    return plan


def _note_stray_domains(root: Path, records: dict) -> None:
    stray = sorted(path.name for path in root.iterdir()
                   if path.is_dir() and not path.name.startswith(".") and path.name not in records)
    if stray:
        log.warning("folders under %s that are not domains of this config (not in manifest.json): %s",
                    root, ", ".join(stray))
