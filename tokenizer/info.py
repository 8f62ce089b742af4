"""What downstream packages need to know about a built tokenizer, without importing sentencepiece.

`data/` stamps token shards with `TokenizerInfo.sha256` and `pretrain/` checks it: the sha256 of
tokenizer.model's bytes is the tokenizer's identity.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

MODEL_FILE = "tokenizer.model"
META_FILE = "tokenizer_meta.json"
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
REQUIRED_FILES = (MODEL_FILE, META_FILE) + HF_FILES


class TokenizerNotFoundError(FileNotFoundError):
    """A tokenizer folder is missing or incomplete; the message says which file and how to fix it."""


@dataclass(frozen=True)
class TokenizerInfo:
    """Identity and special ids of a built tokenizer folder."""

    path: Path
    """The tokenizer folder."""
    model_path: Path
    """Its merged SentencePiece model (tokenizer.model)."""
    sha256: str
    """sha256 hex of tokenizer.model's bytes: the identity used by data shards and training."""
    vocab_size: int
    """Number of pieces (embedding rows needed)."""
    unk_id: int
    """Id of the unknown piece."""
    bos_id: int
    """Id of beginning-of-sequence."""
    eos_id: int
    """Id of end-of-sequence."""
    pad_id: int
    """Id of padding."""


def tokenizer_sha256(model_path: str | Path) -> str:
    """sha256 hex of a model file's bytes."""
    digest = hashlib.sha256()
    with open(model_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_tokenizer_info(directory: str | Path) -> TokenizerInfo:
    """Read a folder written by `ayumi tokenizer build`; TokenizerNotFoundError if it is missing or incomplete."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TokenizerNotFoundError(
            f"tokenizer folder {directory} does not exist. Fix: build one with `ayumi tokenizer build "
            f"tokenizer=<preset> tokenizer.inputs.<domain>=...` or point to an existing folder."
        )
    missing = [name for name in REQUIRED_FILES if not (directory / name).is_file()]
    if missing:
        raise TokenizerNotFoundError(
            f"tokenizer folder {directory} is incomplete: missing {', '.join(missing)}. Fix: rebuild it with "
            "`ayumi tokenizer build` (an interrupted build never leaves a complete-looking folder)."
        )
    meta = json.loads((directory / META_FILE).read_text(encoding="utf-8"))
    model_path = directory / MODEL_FILE
    sha = tokenizer_sha256(model_path)
    if meta.get("sha256") not in (None, sha):
        raise TokenizerNotFoundError(
            f"{model_path}: sha256 {sha[:12]}… differs from {META_FILE}'s {str(meta['sha256'])[:12]}… — the model "
            "was changed after the build. Fix: rebuild, or restore the original tokenizer.model."
        )
    return TokenizerInfo(
        path=directory, model_path=model_path, sha256=sha, vocab_size=int(meta["vocab_size"]),
        unk_id=int(meta["unk_id"]), bos_id=int(meta["bos_id"]), eos_id=int(meta["eos_id"]), pad_id=int(meta["pad_id"]),
    )
