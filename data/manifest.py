"""What a prepared data root holds: per-domain records and the root's `manifest.json`.

Layout of DATA_ROOT::

    manifest.json                  written last; its presence means every domain below is complete
    <domain>/domain.json           the domain's record (fingerprint, counts, tokenizer, shards); written
                                   before the domain folder is moved into place
    <domain>/{train,val}/part_NNNNN.{bin,idx}   Megatron indexed-dataset shards (data/shards.py)
    <domain>/{train,val}/keys.bin  16-byte content key per document, in shard order (overlap check)
    .partial/<domain>/             a domain being written; never read, removed on the next run

A domain made from existing Megatron data (data/megatron.py) has only its `domain.json`: its
shards stay where they are and the record names each prefix. So does the validation split of a
text domain that takes it from Megatron prefixes (`megatron_val`): that domain has `train/` and no
`val/` folder, and its record's val shards name their prefixes. A Megatron domain declared in a
curriculum file (data/register.py) also records the curriculum's name (`curriculum`).

The records are the shards' sidecar: Megatron's format has no room for a tokenizer, so each
record holds the tokenizer's identity (sha256, vocabulary size, EOS id), and each shard's
document and token counts, byte size, largest id and the sha256 of its `.bin`. Both JSON files
also carry `record_sha256`, a checksum of their own contents, so a record edited by hand is noticed.
Training checks all of it at start (data/integrity.py) before touching a token.

Every JSON here is written to a temporary name, fsync-ed and renamed, and holds no timestamps, so
re-running the same preparation yields byte-identical files.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from common.files import write_text_atomic
from data.shards import TokenizerMismatchError

MANIFEST_NAME = "manifest.json"
DOMAIN_RECORD_NAME = "domain.json"
KEYS_NAME = "keys.bin"
KEY_BYTES = 16
MANIFEST_FORMAT = "ayumi-data-manifest"
MANIFEST_VERSION = 2  # 2: Megatron shards, per-shard max id and sha256, tokenizer per domain, record_sha256
SEAL_KEY = "record_sha256"


class ManifestError(ValueError):
    """manifest.json or a domain record is missing or unreadable; the message names the file and the fix."""


def seal(record: dict) -> dict:
    """The record with `record_sha256`: a checksum of everything else in it."""
    body = {key: value for key, value in record.items() if key != SEAL_KEY}
    return {**body, SEAL_KEY: _digest(body)}


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode("utf-8")).hexdigest()


def check_seal(record: dict, path: Path) -> None:
    """Refuse a record whose contents no longer match its checksum (edited by hand, or damaged)."""
    body = {key: value for key, value in record.items() if key != SEAL_KEY}
    if record.get(SEAL_KEY) != _digest(body):
        raise ManifestError(f"{path} was changed after `ayumi data prepare` wrote it (its record_sha256 does not "
                            "match its contents); the counts and checksums in it cannot be trusted. "
                            "Fix: re-run `ayumi data prepare` for this data root")


def tokenizer_identity(info: Any) -> dict:
    """What records keep of a tokenizer (a TokenizerInfo or a declared tokenizer): path, sha256, vocabulary, EOS."""
    path = getattr(info, "model_path", None) or getattr(info, "path", None)
    eos = getattr(info, "eos_id", None)
    return {"sha256": info.sha256, "model_path": str(path) if path is not None else None,
            "vocab_size": int(info.vocab_size), "eos_id": eos if eos is not None else getattr(info, "eod_id", None)}


def shard_record(writer: Any) -> dict:
    """A closed ShardWriter's entry in its split's shard list: the checks training runs at start."""
    return {"name": writer.bin_path.stem, "docs": writer.num_docs, "tokens": writer.num_tokens,
            "bytes": writer.num_bytes, "max_id": writer.max_id, "sha256": writer.sha256}


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON under a temporary name, fsync, then rename: readers see the old file or the whole new one."""
    write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=False, ensure_ascii=False) + "\n")


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path} does not exist: run `ayumi data prepare` for this data root") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ManifestError(f"{path} cannot be read ({err}); re-run `ayumi data prepare`") from None


def read_domain_record(domain_dir: Path) -> dict | None:
    """The record of a finished domain folder, or None when the folder is not a finished domain (an unreadable or
    edited record means unfinished work: the caller redoes the domain)."""
    return read_sealed(Path(domain_dir) / DOMAIN_RECORD_NAME)


def read_sealed(path: Path) -> dict | None:
    """A sealed JSON record, or None when it is missing, unreadable or edited."""
    if not path.is_file():
        return None
    try:
        record = read_json(path)
        check_seal(record, path)
    except ValueError:
        return None
    return record


def shard_prefix(root: Path, domain: str, split: str, shard: dict) -> Path:
    """Where a listed shard lives: under the domain folder, or (Megatron data) the prefix its record names."""
    return Path(shard["prefix"]) if shard.get("prefix") else Path(root) / domain / split / shard["name"]


def shards_intact(domain_dir: Path, record: dict) -> bool:
    """Whether every shard and key file a record lists is on disk with the size the record says."""
    domain_dir = Path(domain_dir)
    for split, info in record.get("splits", {}).items():
        keys = domain_dir / split / KEYS_NAME
        native = not any(shard.get("prefix") for shard in info["shards"])  # Megatron prefixes have no keys file
        if native and (not keys.is_file() or keys.stat().st_size != KEY_BYTES * info["docs"]):
            return False
        for shard in info["shards"]:
            prefix = shard_prefix(domain_dir.parent, domain_dir.name, split, shard)
            bin_path, idx_path = prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")
            if not idx_path.is_file() or not bin_path.is_file() or bin_path.stat().st_size != shard["bytes"]:
                return False
    return True


def build_manifest(name: str, tokenizer: dict, records: dict[str, dict], overlap: dict) -> dict:
    """The root manifest: tokenizer, per-domain records (config, counts, shards), totals, overlap check."""
    totals = {"docs_read": 0, "docs_kept": 0, "tokens": 0, "bytes": 0, "shards": 0}
    for record in records.values():
        totals["docs_read"] += record["docs_read"]
        totals["docs_kept"] += record["docs_kept"]
        for split in record["splits"].values():
            totals["tokens"] += split["tokens"]
            totals["bytes"] += split["bytes"]
            totals["shards"] += len(split["shards"])
    return seal({
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "name": name,
        "tokenizer": tokenizer,
        "domains": records,
        "totals": totals,
        "overlap_check": overlap,
    })


def load_manifest(root: str | os.PathLike) -> dict:
    """The manifest of a prepared data root; raises ManifestError when missing (preparation unfinished)."""
    path = Path(root) / MANIFEST_NAME
    if not path.is_file() and Path(root).is_dir():
        raise ManifestError(
            f"{path} does not exist: {root} is not a finished data root (preparation was interrupted, or the shards "
            "were put there by hand). Fix: run `ayumi data prepare` for it; for existing Megatron shards, declare "
            "them as a domain with `megatron:` prefixes (README, Data)")
    if not path.is_file():
        raise ManifestError(f"data root {root} does not exist: run `ayumi data prepare` or set data.root")
    manifest = read_json(path)
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != MANIFEST_VERSION:
        raise ManifestError(
            f"{path}: not an ayumi data manifest of version {MANIFEST_VERSION} "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r}); "
            "re-run `ayumi data prepare` with the same config (it rewrites every domain in the current format)"
        )
    check_seal(manifest, path)
    return manifest


def check_manifest_tokenizer(manifest: dict, expected_sha256: str, tokenizer_path: str | os.PathLike, root: str = "") -> None:
    """Refuse a data root prepared with another tokenizer than the run's, naming both."""
    recorded = manifest["tokenizer"]["sha256"]
    if recorded != expected_sha256:
        raise TokenizerMismatchError(
            f"data root {root or '(manifest)'} was tokenized with {manifest['tokenizer'].get('model_path')} "
            f"(sha256 {recorded}), but this run's tokenizer {tokenizer_path} has sha256 {expected_sha256}. "
            "Fix: re-run `ayumi data prepare` with this run's tokenizer_dir, or train with the tokenizer the shards were made with."
        )
