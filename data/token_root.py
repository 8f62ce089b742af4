"""A complete data root written straight from token ids: shards, domain records and manifest.

`ayumi data prepare` makes data roots from text; benchmarks, tests and converters that already
hold token ids use this instead, and get a root that training reads and checks exactly like a
prepared one (same shard format, same records, same manifest)::

    with TokenRoot(root, vocab_size=512, eos_id=256) as out:
        with out.shard("ja", "train") as writer:
            writer.add_document(ids)
"""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from data.manifest import DOMAIN_RECORD_NAME, MANIFEST_NAME, build_manifest, seal, shard_record, write_json_atomic
from data.shards import ShardWriter


class TokenRoot:
    """Collects shards per (domain, split); `close()` writes every domain record, then the manifest."""

    def __init__(self, root: str | Path, vocab_size: int, eos_id: int | None = None, name: str = "tokens",
                 tokenizer_sha256: str | None = None):
        self.root = Path(root)
        self.vocab_size = vocab_size
        self.name = name
        self.tokenizer = {"sha256": tokenizer_sha256, "model_path": None, "vocab_size": vocab_size, "eos_id": eos_id}
        self.splits: dict[str, dict[str, list[dict]]] = {}
        (self.root / MANIFEST_NAME).unlink(missing_ok=True)

    @contextmanager
    def shard(self, domain: str, split: str = "train") -> Iterator[ShardWriter]:
        """A ShardWriter for the next shard of a domain's split (`part_NNNNN`), recorded when it closes."""
        shards = self.splits.setdefault(domain, {}).setdefault(split, [])
        if not shards:
            shutil.rmtree(self.root / domain / split, ignore_errors=True)
        with ShardWriter(self.root / domain / split / f"part_{len(shards):05d}", self.vocab_size) as writer:
            yield writer
        shards.append(shard_record(writer))

    def close(self) -> dict:
        records = {name: seal(self._record(name, splits)) for name, splits in self.splits.items()}
        for name, record in records.items():
            write_json_atomic(self.root / name / DOMAIN_RECORD_NAME, record)
        manifest = build_manifest(self.name, self.tokenizer, records, {"passed": True, "val_docs": 0,
                                                                      "train_docs_checked": 0})
        write_json_atomic(self.root / MANIFEST_NAME, manifest)
        return manifest

    def _record(self, name: str, splits: dict[str, list[dict]]) -> dict:
        summary = {split: {"docs": sum(s["docs"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                           "bytes": sum(s["bytes"] for s in shards), "shards": shards}
                   for split, shards in splits.items()}
        docs = sum(split["docs"] for split in summary.values())
        return {"domain": name, "source": "tokens", "fingerprint": "", "config": {}, "inputs": [], "files_read": 0,
                "docs_read": docs, "text_bytes": 0, "docs_kept": docs, "dropped": {}, "drop_examples": {},
                "tokens": sum(split["tokens"] for split in summary.values()), "tokenizer": self.tokenizer,
                "splits": summary}

    def __enter__(self) -> "TokenRoot":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
