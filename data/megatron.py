"""Bring your own Megatron data: register existing `.bin/.idx` prefixes as a domain, after checking them.

Teams arrive with corpora already tokenized by Megatron-LM's `preprocess_data.py`, NeMo,
GPT-NeoX or datatrove. `ayumi data prepare` registers such a domain (`megatron: PREFIXES` in its
config) without copying or re-tokenizing anything: it reads each prefix, checks what it can
without trusting the user, and writes the domain's record (`domain.json`) naming each prefix.
Training, `ayumi plan`, the curriculum and `ayumi data inspect` then treat it like any domain.
A curriculum file can declare such a domain too (`domains:` in conf/curriculum); data/register.py
registers it with the same checks. `where` names the config section a domain came from
(`data.domains` or `curriculum.domains`), so every message names the key the user wrote.

What is checked, per prefix, against the declared tokenizer (`tokenizer_dir`):
- the index is well formed and the `.bin` has exactly the bytes it describes (data/shards.py);
- every id is below the vocabulary size: in full up to FULL_CHECK_BYTES of `.bin`, beyond that
  on SAMPLE_WINDOWS evenly spaced windows (the record says which);
- documents end with the tokenizer's EOS (checked on up to EOD_SAMPLE documents), unless the
  domain says `append_eod: true` (prepared without --append-eod: training then reads an EOS after
  each document); a mix of both is refused;
- the sha256 of files up to FULL_CHECK_BYTES, so training and `ayumi data verify` notice changes;
  a larger prefix is recorded without one (`sha256: null`): only its size, counts and ids are checked
  later, and `ayumi data verify` says so.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from data.config import DomainConfig
from data.manifest import tokenizer_identity
from data.shards import ShardFormatError, ShardReader, file_sha256, find_shards, shard_paths

FULL_CHECK_BYTES = 256 * 2**20
"""Up to this many `.bin` bytes, ids are checked in full and the file's sha256 is recorded."""
SAMPLE_WINDOWS = 256
"""Evenly spaced windows read to check ids in a larger `.bin`."""
WINDOW_TOKENS = 1 << 16
EOD_SAMPLE = 2048
"""Documents whose last token is checked for EOS, evenly spaced over the prefix."""


class MegatronDataError(ShardFormatError):
    """Declared Megatron data does not match what it claims to be; the message names the prefix and the key."""


def parse_prefixes(spec: str, key: str) -> list[tuple[float | None, Path]]:
    """`PREFIX ...`, `W PREFIX W PREFIX ...` (Megatron's --data-path) or a folder, as (weight or None, prefix)."""
    words = spec.split()
    if not words:
        raise MegatronDataError(f"{key} is empty")
    if len(words) == 1 and Path(words[0]).is_dir():
        prefixes = find_shards(words[0])
        if not prefixes:
            raise MegatronDataError(f"{key}: folder {words[0]} holds no *.idx files")
        return [(None, prefix) for prefix in prefixes]
    if _is_number(words[0]):
        if len(words) % 2 or not all(_is_number(w) for w in words[0::2]):
            raise MegatronDataError(f"{key}={spec!r}: weighted prefixes alternate a weight and a prefix "
                                    "(\"0.7 /data/a_text_document 0.3 /data/b_text_document\")")
        pairs = [(float(w), Path(p)) for w, p in zip(words[0::2], words[1::2])]
        if any(weight < 0 for weight, _ in pairs) or not sum(weight for weight, _ in pairs) > 0:
            raise MegatronDataError(f"{key}={spec!r}: weights must be >= 0 and not all 0")
        return [(weight, _prefix(path)) for weight, path in pairs]
    if any(_is_number(w) for w in words):
        raise MegatronDataError(f"{key}={spec!r}: give a weight before every prefix or before none")
    return [(None, _prefix(Path(word))) for word in words]


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _prefix(path: Path) -> Path:
    bin_path, _ = shard_paths(path)
    return bin_path.with_suffix("").resolve()


def domain_fingerprint(name: str, domain: DomainConfig, tokenizer_sha256: str, pipeline_version: int,
                       where: str = "data.domains") -> str:
    """sha256 over the config, the tokenizer and every listed file's size and mtime: a changed prefix is re-checked.

    `where` only names the key in errors: the same prefixes declared in conf/data or a curriculum have one fingerprint.
    """
    files = []
    for spec, key in ((domain.megatron, "megatron"), (domain.megatron_val, "megatron_val")):
        if spec:
            for _, prefix in parse_prefixes(spec, f"{where}.{name}.{key}"):
                for path in shard_paths(prefix):
                    stat = path.stat() if path.exists() else None
                    files.append([str(path), stat.st_size if stat else -1, stat.st_mtime_ns if stat else -1])
    payload = {"pipeline_version": pipeline_version, "megatron": [domain.megatron, domain.megatron_val],
               "append_eod": domain.append_eod, "tokenizer_sha256": tokenizer_sha256, "files": files}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def megatron_record(name: str, domain: DomainConfig, tokenizer: Any, fingerprint: str,
                    where: str = "data.domains") -> dict:
    """Check the domain's prefixes against the tokenizer and return its record (as data/prepare.py writes it)."""
    splits = {split: megatron_split(name, spec, key, tokenizer, domain.append_eod, where)
              for split, spec, key in (("train", domain.megatron, "megatron"), ("val", domain.megatron_val, "megatron_val"))
              if spec}
    docs = sum(split["docs"] for split in splits.values())
    return {
        "domain": name, "source": "megatron", "fingerprint": fingerprint,
        "config": {"megatron": domain.megatron, "megatron_val": domain.megatron_val, "append_eod": domain.append_eod},
        "inputs": [], "files_read": sum(len(split["shards"]) for split in splits.values()),
        "docs_read": docs, "text_bytes": 0, "docs_kept": docs, "dropped": {}, "drop_examples": {},
        "tokens": sum(split["tokens"] for split in splits.values()),
        "tokenizer": tokenizer_identity(tokenizer), "splits": splits,
    }


def megatron_split(name: str, spec: str, key: str, tokenizer: Any, append_eod: bool,
                   where: str = "data.domains") -> dict:
    """One split's record from Megatron prefixes (`WHERE.NAME.KEY`), each checked against the tokenizer.

    Also how a text domain takes its validation set from Megatron data (`megatron_val` beside `inputs`).
    """
    eod = getattr(tokenizer, "eod_id", None)
    if eod is None:
        eod = getattr(tokenizer, "eos_id", None)
    full_key = f"{where}.{name}.{key}"
    shards = [_check_prefix(prefix, weight, tokenizer, eod, append_eod, full_key)
              for weight, prefix in parse_prefixes(spec, full_key)]
    return {"docs": sum(s["docs"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards), "shards": shards}


def _check_prefix(prefix: Path, weight: float | None, tokenizer: Any, eod: int | None, append_eod: bool,
                  key: str) -> dict:
    try:
        reader = ShardReader(prefix, fix=f"check the prefix in {key}, or restore or re-preprocess {prefix}")
    except ShardFormatError as err:
        raise MegatronDataError(f"{key}: {err}") from None
    if reader.num_docs == 0 or reader.num_tokens == 0:
        raise MegatronDataError(f"{key}: {prefix} holds no tokens ({reader.num_docs} documents)")
    small = reader.num_tokens * reader.dtype.itemsize <= FULL_CHECK_BYTES
    low, high = _id_range(reader, small)
    if low < 0 or high >= tokenizer.vocab_size:
        raise MegatronDataError(
            f"{key}: {prefix}.bin holds id {high if high >= tokenizer.vocab_size else low}, outside the vocabulary "
            f"[0, {tokenizer.vocab_size}) of the declared tokenizer {tokenizer_identity(tokenizer)['model_path']}. "
            "Fix: set tokenizer_dir to the tokenizer these shards were made with")
    _check_eod(reader, eod, append_eod, key)
    return {"name": prefix.name, "prefix": str(prefix), "weight": weight, "append_eod": append_eod,
            "eod_id": eod, "docs": reader.num_docs,
            "sequences": reader.num_sequences, "tokens": reader.num_tokens,
            "bytes": reader.num_tokens * reader.dtype.itemsize, "idx_bytes": reader.idx_path.stat().st_size,
            "max_id": high, "ids_checked": "full" if small else f"sampled {SAMPLE_WINDOWS} windows",
            "sha256": file_sha256(reader.bin_path) if small else None}


def _id_range(reader: ShardReader, full: bool) -> tuple[int, int]:
    """(smallest, largest) id: of every token, or of SAMPLE_WINDOWS evenly spaced windows."""
    if full:
        return reader.min_id(), reader.max_id()
    starts = np.linspace(0, max(0, reader.num_tokens - WINDOW_TOKENS), SAMPLE_WINDOWS).astype(np.int64)
    windows = [reader.tokens[start:start + WINDOW_TOKENS] for start in starts]
    return min(int(w.min()) for w in windows), max(int(w.max()) for w in windows)


def _check_eod(reader: ShardReader, eod: int | None, append_eod: bool, key: str) -> None:
    """Documents must all end with EOD (append_eod false) or none of them (true)."""
    picks = np.unique(np.linspace(0, reader.num_docs - 1, min(EOD_SAMPLE, reader.num_docs)).astype(np.int64))
    ends = reader.doc_offsets[picks + 1]
    nonempty = ends > reader.doc_offsets[picks]
    if eod is None:
        raise MegatronDataError(f"{key}: the declared tokenizer has no EOS/EOD token, so documents in {reader.prefix} "
                                "cannot be told apart. Fix: declare the tokenizer they were made with")
    ending = int(np.count_nonzero(reader.tokens[ends[nonempty] - 1] == eod))
    checked = int(np.count_nonzero(nonempty))
    if not append_eod and ending < checked:
        raise MegatronDataError(
            f"{key}: {checked - ending} of {checked} documents checked in {reader.prefix} do not end with EOD id "
            f"{eod}, so documents would run together. Fix: if they were prepared without --append-eod, set "
            f"{key.rsplit('.', 1)[0]}.append_eod=true (training then reads EOD after each document); otherwise "
            "declare the tokenizer they were made with")
    if append_eod and ending:
        raise MegatronDataError(
            f"{key}: {ending} of {checked} documents checked in {reader.prefix} already end with EOD id {eod}, "
            f"but append_eod=true would add a second one. Fix: set {key.rsplit('.', 1)[0]}.append_eod=false")
