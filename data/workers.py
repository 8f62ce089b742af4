"""The worker side of `ayumi data prepare`: clean, key and tokenize chunks of documents in N processes.

`ChunkPool.map_ordered` takes a stream of work items and gives back results in the same order,
whatever the number of workers, which is what keeps the output bytes independent of it. Items
are either work (`meta, (function, *args)`), sent to a worker, or markers (`meta, None`),
passed through in their place: the parent uses markers for "domain finished" so that
one stream, and one busy pool, spans every domain of a run instead of draining between domains.

How the workers start (`start_method`, default `auto`):

- `fork` when the parent has no other Python thread: a worker is ready in milliseconds with the
  parent's imports, where a spawned one costs ~0.3 s of CPU (interpreter, numpy, sentencepiece).
  Native thread pools (OpenBLAS, OpenMP, HF tokenizers' rayon) do not stop this: the worker
  calls none of them, and sentencepiece's batch encode starts and joins its threads per call
  (checked: it works in a forked child after the parent trained and encoded with threads).
  SentencePiece *training* in a forked child after threaded training in the parent does hang:
  never fork a process that trains tokenizers.
- `forkserver` otherwise (a progress bar, W&B or a loader thread is already running): forking a
  process that holds threads can deadlock the child on a lock a vanished thread held. The fork
  server is a fresh process that imports this module once; workers are forked from it.
- `spawn` on request: a fresh interpreter per worker, the slowest and most isolated.

The processes are launched while the pool is built, so build it before starting any thread.
"""
from __future__ import annotations

import array
import collections
import contextlib
import json
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Iterable, Iterator, NamedTuple

import numpy as np

from data.clean import Cleaner
from data.config import CleanConfig
from data.prepare_profile import PrepareProfile, timed_call
from common.corpus import CorpusError, parse_jsonl_block

IN_FLIGHT_PER_WORKER = 2  # one chunk being encoded and one queued: workers never wait on the parent

_worker: dict = {}  # per-process state, set once by init_worker


def init_worker(model_path: str, encode_threads: int, eos_id: int, in_child: bool = False) -> None:
    """Load the tokenizer into this process (a worker, or the parent when workers=0): a SentencePiece
    model file, or a Hugging Face tokenizer folder (its tokenizer.json, through `tokenizers`)."""
    if in_child:  # Ctrl-C reaches the whole process group: let the parent alone handle it
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _exit_with_parent()
    _worker["encode"], vocab = _hf_encoder(model_path) if os.path.isdir(model_path) else _sp_encoder(model_path,
                                                                                                     encode_threads)
    # Ids go back to the parent pickled: as uint16 where every id fits, half the bytes of int32 to copy.
    _worker["typecode"] = "H" if vocab <= 1 << 16 else "i"  # array.array's uint16, int32
    _worker["threads"] = encode_threads
    _worker["eos"] = eos_id
    _worker["cleaners"] = {}


def _sp_encoder(model_path: str, threads: int):
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=model_path)
    if _encodes_to_numpy(processor):
        # An int32 array per document, copied from sentencepiece's C++ buffers: no Python int per token.
        # Encoding and flattening a chunk took ~25% less CPU than with lists of ints.
        return (lambda texts: processor.encode(texts, return_type="numpy", num_threads=threads),
                processor.get_piece_size())
    return lambda texts: processor.encode(texts, out_type=int, num_threads=threads), processor.get_piece_size()


def _encodes_to_numpy(processor) -> bool:
    """Whether this sentencepiece encodes to numpy arrays (`return_type="numpy"`: 0.2.3 does; older ones refuse it)."""
    try:
        processor.encode(["a"], return_type="numpy")
    except (TypeError, ValueError):
        return False
    return True


def _hf_encoder(folder: str):
    """Batch encode with the folder's tokenizer.json, no special tokens added (EOS is appended per document below)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    return (lambda texts: [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)],
            tokenizer.get_vocab_size(with_added_tokens=True))


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


class ChunkResult(NamedTuple):
    """What a worker sends back for one chunk."""

    reasons: list
    """Per document: None when kept, else its drop reason."""
    keys: bytes
    """16 bytes per kept document (data.clean.Cleaner.key: the domain's dedup mode)."""
    lengths: np.ndarray
    """Tokens of each kept document, the EOS appended to it included."""
    tokens: np.ndarray
    """The kept documents' tokens back to back (uint16 when the vocabulary fits it, else int32)."""
    text_bytes: int
    """UTF-8 bytes of the chunk's documents as read."""
    lines: list | None = None
    """jsonl blocks: the line number of each document in its block, from 1 (for drop locations)."""
    docs_per_block: list | None = None
    """jsonl blocks: how many of the documents came from each block."""
    lines_per_block: list | None = None
    """jsonl blocks: how many lines each block holds (the parent numbers lines across a file's blocks)."""
    skips: tuple | list = ()
    """jsonl blocks: (block index, line number in the block, common.corpus.Skip) per record that is not a document."""
    timing: tuple | None = None
    """Under AYUMI_PREPARE_PROFILE only: (worker pid, start, end, CPU seconds) of this item (data/prepare_profile.py)."""


def encode_chunk(clean: dict, texts: list[str]) -> ChunkResult:
    """Clean, key and tokenize one chunk of documents (runs in a worker).

    Duplicates inside the chunk are dropped here, before paying for their encoding.
    """
    cleaner = _cleaner(clean)
    dedup = clean["dedup"] != "off"
    reasons: list[str | None] = []
    kept_texts: list[str] = []
    keys: list[bytes] = []
    seen: set[bytes] = set()
    text_bytes = 0
    for text in texts:
        text_bytes += len(text.encode("utf-8", "surrogatepass"))
        cleaned, reason = cleaner(text)
        if reason is None:
            key = cleaner.key(cleaned)
            if dedup and key in seen:
                reason = "duplicate"
            else:
                seen.add(key)
                keys.append(key)
                kept_texts.append(cleaned)
        reasons.append(reason)
    ids = _worker["encode"](kept_texts) if kept_texts else []
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) + 1
    return ChunkResult(reasons, b"".join(keys), lengths, _flatten(ids, _worker["eos"], _worker["typecode"]), text_bytes)


def _flatten(ids: list, eos: int, typecode: str) -> np.ndarray:
    """The documents' ids back to back, EOS after each, as uint16 (typecode "H") or int32 ("i").

    ids: int32 arrays (sentencepiece's numpy output) or lists of ints (tokenizers, older sentencepiece).
    """
    if ids and isinstance(ids[0], np.ndarray):
        eos_row = np.array([eos], dtype=np.int32)
        flat = np.concatenate([part for document in ids for part in (document, eos_row)])
        # "H" only where the vocabulary fits uint16 (init_worker), so no id wraps here.
        return flat.astype(np.uint16 if typecode == "H" else np.int32, copy=False)
    flat = array.array(typecode)  # fromlist: C speed, and an id that does not fit raises
    for document in ids:
        flat.fromlist(document)
        flat.append(eos)  # EOS after every document
    return np.frombuffer(flat, dtype=flat.typecode)


def encode_jsonl_blocks(clean: dict, blocks: list[bytes | tuple[str, int, int]], text_field: str) -> ChunkResult:
    """Parse raw jsonl blocks of whole lines, then clean, key and tokenize their documents as encode_chunk.

    A block is its bytes, or a byte range (path, start, stop) that this worker reads (data/prepare.py, jsonl_ranges).
    Reading and parsing here rather than in the parent keeps the parent's work per block, not per
    byte or document, which is what lets throughput grow with the number of workers.
    """
    texts: list[str] = []
    lines: list[int] = []
    docs_per_block: list[int] = []
    lines_per_block: list[int] = []
    skips: list[tuple] = []
    for index, block in enumerate(blocks):
        if isinstance(block, tuple):
            block = read_range(*block)
        parsed = parse_jsonl_block(block, 1, text_field)
        texts += parsed.texts
        lines += parsed.numbers
        docs_per_block.append(len(parsed.texts))
        lines_per_block.append(parsed.lines)
        skips += [(index, line, skip) for line, skip in parsed.skips]
    return encode_chunk(clean, texts)._replace(lines=lines, docs_per_block=docs_per_block,
                                               lines_per_block=lines_per_block, skips=skips)


def read_range(path: str, start: int, stop: int) -> bytes:
    """Bytes [start, stop) of an input file; one clear error when the file changed or vanished since the parent cut it."""
    fix = "Fix: leave the inputs alone while `ayumi data prepare` runs, then run it again."
    try:
        with open(path, "rb") as handle:
            handle.seek(start)
            data = handle.read(stop - start)
    except OSError as err:
        raise CorpusError(f"{path} could not be read at byte {start} ({err.strerror or err}). {fix}") from None
    if len(data) != stop - start:
        raise CorpusError(f"{path} changed while it was read: {stop - start:,} bytes expected at byte {start:,}, "
                          f"{len(data):,} found. {fix}")
    return data


def resolve_start_method(requested: str) -> str:
    """The start method `auto` stands for here and now (see the module docstring), or the one requested."""
    if requested != "auto":
        return requested
    return "fork" if threading.active_count() == 1 else "forkserver"


class ChunkPool:
    """Runs `encode_chunk` over a stream of work items, in N processes or in this one (N = 0).

    Results come back in submission order with at most IN_FLIGHT_PER_WORKER chunks per worker
    in flight, so memory stays bounded however long the stream is. A worker that dies (or fails
    to load the model) raises BrokenProcessPool here instead of hanging the run.
    """

    def __init__(self, workers: int, model_path: str, encode_threads: int, eos_id: int, start_method: str = "auto",
                 profile: PrepareProfile | None = None):
        self.workers = workers
        self.profile = profile or PrepareProfile(None)
        self.start_method = resolve_start_method(start_method) if workers > 0 else "none"
        init_args = (model_path, encode_threads, eos_id)
        self._executor: ProcessPoolExecutor | None = None
        if workers == 0:
            init_worker(*init_args)
            return
        context = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            context.set_forkserver_preload([__name__])  # imported once by the server, not once per worker
        self._executor = ProcessPoolExecutor(workers, mp_context=context, initializer=init_worker,
                                             initargs=(*init_args, True))
        with _sigint_ignored():  # children are born ignoring Ctrl-C, even during their start-up
            # The first submit launches the processes (all of them under fork, before the
            # executor starts its own threads). Nothing waits for them: the parent reads the
            # first chunks meanwhile, and a model that fails to load fails the first result.
            self._executor.submit(int)

    def map_ordered(self, items: Iterable[tuple[object, tuple | None]]) -> Iterator[tuple[object, ChunkResult | None]]:
        """(meta, result) per item, in stream order.

        An item is (meta, (function, *args)) for work (encode_chunk or encode_jsonl_blocks) or
        (meta, None) for a marker, which comes back as (meta, None) in its place.
        """
        profile = self.profile
        if profile.enabled:  # time the reading, and each item in its worker (data/prepare_profile.py)
            items = ((meta, call if call is None else (timed_call, *call)) for meta, call in _timed(items, profile))
        if self._executor is None:
            for meta, call in items:
                yield meta, None if call is None else self._noted(call[0](*call[1:]))
            return
        limit = IN_FLIGHT_PER_WORKER * self.workers
        pending: collections.deque = collections.deque()
        in_flight = 0
        for meta, call in items:
            future = None if call is None else self._executor.submit(*call)
            pending.append((meta, future))
            in_flight += future is not None
            while pending and (pending[0][1] is None or in_flight >= limit):
                meta_done, future_done = pending.popleft()
                in_flight -= future_done is not None
                yield meta_done, None if future_done is None else self._result(future_done)
        while pending:
            meta_done, future_done = pending.popleft()
            yield meta_done, None if future_done is None else self._result(future_done)

    def _result(self, future) -> ChunkResult:
        """The future's result; under a profile, the time waited for it is counted."""
        if not self.profile.enabled:
            return future.result()
        started = time.monotonic()
        result = future.result()
        self.profile.add("waiting_on_workers", time.monotonic() - started)
        return self._noted(result)

    def _noted(self, result: ChunkResult) -> ChunkResult:
        self.profile.item(result.timing)
        return result

    def close(self) -> None:
        """Stop the workers; chunks not yet started are dropped (after an error or Ctrl-C nothing waits for them)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


def _timed(items: Iterable, profile: PrepareProfile) -> Iterator:
    """The items, with the time spent producing them (the parent reading its inputs) added to the profile."""
    items = iter(items)
    while True:
        started = time.monotonic()
        try:
            item = next(items)
        except StopIteration:
            return
        finally:
            profile.add("reading", time.monotonic() - started)
        yield item
