"""What a prepared data root holds: per-domain records and the root's `manifest.json`.

Layout of DATA_ROOT::

    manifest.json                  written last; its presence means every domain below is complete
    <domain>/domain.json           the domain's record (fingerprint, counts, shards); written before
                                   the domain folder is moved into place
    <domain>/{train,val}/part_NNNNN.{bin,idx}
    <domain>/{train,val}/keys.bin  16-byte content key per document, in shard order (overlap check)
    .partial/<domain>/             a domain being written; never read, removed on the next run

Every JSON here is written to a temporary name, fsync-ed and renamed, and holds no timestamps, so
re-running the same preparation yields byte-identical files. The trainer reads the manifest with
`load_manifest` and calls `check_manifest_tokenizer` before touching any shard.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from data.shards import TokenizerMismatchError
from common.files import write_text_atomic

MANIFEST_NAME = "manifest.json"
DOMAIN_RECORD_NAME = "domain.json"
KEYS_NAME = "keys.bin"
KEY_BYTES = 16
MANIFEST_FORMAT = "ayumi-data-manifest"
MANIFEST_VERSION = 1


class ManifestError(ValueError):
    """manifest.json or a domain record is missing or unreadable; the message names the file and the fix."""


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
    """The record of a finished domain folder, or None when the folder is not a finished domain."""
    path = Path(domain_dir) / DOMAIN_RECORD_NAME
    if not path.is_file():
        return None
    try:
        return read_json(path)
    except ManifestError:
        return None  # an unreadable record means unfinished work: the caller redoes the domain


def shards_intact(domain_dir: Path, record: dict) -> bool:
    """Whether every shard and key file a record lists is on disk with the size the record says."""
    for split, info in record.get("splits", {}).items():
        split_dir = Path(domain_dir) / split
        keys = split_dir / KEYS_NAME
        if not keys.is_file() or keys.stat().st_size != KEY_BYTES * info["docs"]:
            return False
        for shard in info["shards"]:
            bin_path, idx_path = split_dir / f"{shard['name']}.bin", split_dir / f"{shard['name']}.idx"
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
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "name": name,
        "tokenizer": tokenizer,
        "domains": records,
        "totals": totals,
        "overlap_check": overlap,
    }


def load_manifest(root: str | os.PathLike) -> dict:
    """The manifest of a prepared data root; raises ManifestError when missing (preparation unfinished)."""
    path = Path(root) / MANIFEST_NAME
    manifest = read_json(path)
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("version") != MANIFEST_VERSION:
        raise ManifestError(
            f"{path}: not an ayumi data manifest of version {MANIFEST_VERSION} "
            f"(format {manifest.get('format')!r}, version {manifest.get('version')!r}); re-run `ayumi data prepare`"
        )
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
