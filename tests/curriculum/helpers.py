"""Helpers for curriculum tests (and the lead's multi-rank stage-switch test).

`write_domains` makes a DATA_ROOT whose samples say where they came from: every token of domain
number k is in [k * 1000, (k + 1) * 1000), and documents carry their running number, so a test can
tell the domain and the exact sample a mixer returned.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from curriculum.config import CurriculumConfig, LRPolicy, Stage
from data.packed import PackedSamples
from data.token_root import TokenRoot

VOCAB = 8000


def write_domains(root: Path, tokens: dict[str, int], doc_len: int = 50, shards: int = 2, val_tokens: int = 0) -> Path:
    """DATA_ROOT/<domain>/train (and val when val_tokens > 0) holding about `tokens[name]` tokens per domain."""
    with TokenRoot(root, vocab_size=VOCAB) as out:
        for k, (name, count) in enumerate(tokens.items()):
            for split, total in (("train", count), ("val", val_tokens)):
                if total <= 0:
                    continue
                docs = max(1, total // doc_len)
                per_shard = -(-docs // shards)
                doc = 0
                for shard in range(shards):
                    with out.shard(name, split) as writer:
                        for _ in range(min(per_shard, docs - doc)):
                            writer.add_document(k * 1000 + (doc + np.arange(doc_len)) % 1000)
                            doc += 1
    return root


def packed(root: Path, seq_len: int, split: str = "train") -> dict[str, PackedSamples]:
    return {path.name: PackedSamples.from_directory(path / split, seq_len, path.name)
            for path in sorted(root.iterdir()) if (path / split).is_dir()}


def three_stage(seq_len: int = 16) -> CurriculumConfig:
    """Three stages over a, b, c: b is used in stages 1 and 3 (cursor persistence), c only later."""
    return CurriculumConfig(name="three", default_max_repetition=50.0, stages=[
        Stage("first", 300 * seq_len + 5, {"a": 0.7, "b": 0.3}),
        Stage("second", 200 * seq_len, {"a": 0.2, "c": 0.8}),
        Stage("third", 500 * seq_len - 5, {"a": 1.0, "b": 2.0, "c": 1.0}, lr=LRPolicy(rewarmup_steps=3)),
    ])
