"""A tokenizer someone else made, declared by path: an ayumi folder, a SentencePiece `.model`, or a Hugging Face folder.

Existing Megatron data (data/megatron.py) was tokenized by whatever the team used; to check its
ids, decode samples and refuse a model of the wrong vocabulary, ayumi needs that tokenizer's
identity, vocabulary size and end-of-document id, whatever form it comes in. The libraries that
read it (sentencepiece, tokenizers) load only when text is encoded or decoded.

Identity (`sha256`) is the sha256 of the file that defines the tokenizer: tokenizer.model for an
ayumi folder (the same value as TokenizerInfo.sha256, so prepared and declared data agree) and for
a bare `.model`; for a Hugging Face folder, a sha256 over the names and bytes of HF_DEFINING_FILES
that are present, in that order.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tokenizer.info import META_FILE, MODEL_FILE, TokenizerNotFoundError, load_tokenizer_info, tokenizer_sha256

HF_DEFINING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                     "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt")
"""The files of a Hugging Face tokenizer folder that decide its ids (hashed in this order when present)."""


@dataclass(frozen=True)
class DeclaredTokenizer:
    """What ayumi needs of a declared tokenizer."""

    path: Path
    """What the user named (folder or .model file)."""
    kind: str
    """ayumi | sentencepiece | huggingface."""
    sha256: str
    """Identity: see the module docstring."""
    vocab_size: int
    """Embedding rows its ids need (largest id + 1, added tokens included)."""
    eod_id: int | None
    """End-of-document id (EOS); None when the tokenizer has none."""
    bos_id: int | None
    """Beginning-of-sequence id; None when the tokenizer has none."""
    _backend: list = field(default_factory=list, compare=False, repr=False)

    def _library(self) -> Any:
        if not self._backend:
            self._backend.append(_load_backend(self))
        return self._backend[0]

    def encode(self, text: str) -> list[int]:
        """Plain text to ids, no special tokens added."""
        backend = self._library()
        if self.kind == "huggingface":
            return backend.encode(text, add_special_tokens=False).ids
        return list(backend.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        """Ids to text (special tokens as the library renders them)."""
        return self._library().decode([int(i) for i in ids])


def _load_backend(tokenizer: DeclaredTokenizer) -> Any:
    if tokenizer.kind == "huggingface":
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tokenizer.path / "tokenizer.json"))
    import sentencepiece as spm

    model = tokenizer.path / MODEL_FILE if tokenizer.kind == "ayumi" else tokenizer.path
    return spm.SentencePieceProcessor(model_file=str(model))


def load_declared_tokenizer(path: str | Path) -> DeclaredTokenizer:
    """Detect the form of `path` and read its identity; TokenizerNotFoundError naming the path otherwise."""
    path = Path(path)
    if path.is_dir() and (path / META_FILE).is_file() and (path / MODEL_FILE).is_file():
        info = load_tokenizer_info(path)
        return DeclaredTokenizer(path, "ayumi", info.sha256, info.vocab_size, info.eos_id, info.bos_id)
    if path.is_file():
        return _sentencepiece(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return _huggingface(path)
    what = "does not exist" if not path.exists() else "is none of the three"
    raise TokenizerNotFoundError(
        f"tokenizer {path} {what}: give an ayumi tokenizer folder (tokenizer.model + tokenizer_meta.json), "
        "a SentencePiece .model file, or a Hugging Face tokenizer folder (with tokenizer.json)")


def _sentencepiece(path: Path) -> DeclaredTokenizer:
    import sentencepiece as spm

    try:
        processor = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as err:
        raise TokenizerNotFoundError(f"tokenizer {path} is not a SentencePiece model ({err}); give an ayumi folder, "
                                     "a .model file or a Hugging Face tokenizer folder") from None
    def known(piece_id: int) -> int | None:
        return piece_id if piece_id >= 0 else None

    tokenizer = DeclaredTokenizer(path, "sentencepiece", tokenizer_sha256(path), processor.get_piece_size(),
                                  known(processor.eos_id()), known(processor.bos_id()))
    tokenizer._backend.append(processor)  # loaded once: encode/decode reuse it
    return tokenizer


def _huggingface(path: Path) -> DeclaredTokenizer:
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as err:  # tokenizers raises its own Exception type for a malformed file
        raise TokenizerNotFoundError(f"{path / 'tokenizer.json'} cannot be read by `tokenizers` ({err})") from None
    vocab = backend.get_vocab(with_added_tokens=True)
    special = _special_tokens(path)
    missing = [f"{name}={special[name]!r}" for name in ("eos_token", "bos_token") if special.get(name) and special[name] not in vocab]
    if missing:
        raise TokenizerNotFoundError(f"{path}: the config names {', '.join(missing)}, which tokenizer.json's vocabulary "
                                     "does not hold; the folder is inconsistent. Fix: point at the tokenizer as released")
    eod, bos = (vocab.get(special[name]) if special.get(name) else None for name in ("eos_token", "bos_token"))
    tokenizer = DeclaredTokenizer(path, "huggingface", _folder_sha256(path), max(vocab.values()) + 1, eod, bos)
    tokenizer._backend.append(backend)
    return tokenizer


def _special_tokens(path: Path) -> dict[str, str]:
    """eos_token / bos_token strings from tokenizer_config.json, else special_tokens_map.json."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins: read last
        file = path / name
        if file.is_file():
            data = json.loads(file.read_text(encoding="utf-8"))
            for key in ("eos_token", "bos_token"):
                value = data.get(key)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    found[key] = value
    return found


def _folder_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for name in HF_DEFINING_FILES:
        if (path / name).is_file():
            digest.update(name.encode("utf-8") + b"\0" + (path / name).read_bytes())
    return digest.hexdigest()
