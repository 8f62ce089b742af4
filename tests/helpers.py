"""Shared test helpers: small real-text shards and environment for DeepSpeed runs on CPU."""
from __future__ import annotations

import os
from pathlib import Path

from data.shards import ShardWriter

REPO = Path(__file__).resolve().parents[1]

# Real text (public domain: the opening of Natsume Soseki's "I Am a Cat" and Jane Austen's
# "Pride and Prejudice"), encoded as UTF-8 bytes: a byte-level vocabulary needs no tokenizer.
JA_TEXT = (
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所で"
    "ニャーニャー泣いていた事だけは記憶している。吾輩はここで始めて人間というものを見た。"
)
EN_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of their daughters."
)
EOS = 256
VOCAB = 512


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8")) + [EOS]


def write_tiny_corpus(root: Path, repeats: int = 40, val_docs: int = 4) -> Path:
    """DATA_ROOT with ja/ and en/ domains (train + val) of byte tokens, repeated so loss can fall."""
    for name, text in (("ja", JA_TEXT), ("en", EN_TEXT)):
        for split, count in (("train", repeats), ("val", val_docs)):
            with ShardWriter(root / name / split / "shard_00000", vocab_size=VOCAB) as writer:
                for i in range(count):
                    writer.add_document(byte_tokens(text))
    return root


def cpu_env(**extra: str) -> dict[str, str]:
    """Environment for a DeepSpeed subprocess on CPU (no GPU, no W&B network)."""
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    env.update(extra)
    return env
