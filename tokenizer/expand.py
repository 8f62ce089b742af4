"""Vocabulary expansion for continued pretraining: a base SentencePiece tokenizer plus new pieces, base ids untouched.

Swallow added Japanese pieces to Llama 2's 32k SentencePiece vocabulary (to about 43k) and
continued pretraining; shorter Japanese sequences cost no accuracy. `ayumi tokenizer expand`
does the tokenizer half: it appends the best pieces of a source model (e.g. the Japanese model
of an `ayumi tokenizer build`) that the base lacks, up to a target size. Every base piece keeps
its id, text and score, so a model's existing embedding rows stay valid (pretrain/model/resize.py
initialises the new rows).

How pieces are appended depends on the base model type:
- unigram: new pieces take their source log-probability as score; Viterbi may then choose them
  wherever they occur (text without them tokenizes as before);
- BPE (Llama 2, Mistral): SentencePiece merges adjacent pieces whose concatenation is in the
  vocabulary, best score first. New pieces get scores below every base piece, so every base merge
  still happens first and in the same order, and a new piece is added only if it is one character
  (BPE's starting symbols) or splits into two pieces already in the vocabulary (otherwise no merge
  could ever produce it).
Byte-level BPE bases (Llama 3, Qwen: a tokenizer.json with no tokenizer.model) are not supported:
their merges live in tokenizer.json, which this does not edit.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common.files import replace_dir
from tokenizer.info import META_FILE, MODEL_FILE, TokenizerNotFoundError, tokenizer_sha256
from tokenizer.merge import load_proto
from tokenizer.proto import pb

UNIGRAM, BPE = 1, 2  # sentencepiece TrainerSpec.ModelType


class ExpandError(ValueError):
    """The base or source tokenizer cannot be expanded as asked; the message names the file and the fix."""


@dataclass(frozen=True)
class Expansion:
    """What `expand` wrote."""

    out_dir: Path
    base_size: int
    """Pieces of the base model (ids 0..base_size-1, unchanged)."""
    added: int
    """Pieces appended after them."""
    skipped_unreachable: int
    """BPE base only: source pieces left out because no merge of two vocabulary pieces makes them."""


def base_model_path(base: str | Path) -> Path:
    """The base's SentencePiece model: the path itself, or tokenizer.model inside a folder."""
    base = Path(base)
    path = base / MODEL_FILE if base.is_dir() else base
    if not path.is_file():
        hint = (" It has a tokenizer.json only: a byte-level BPE tokenizer (Llama 3, Qwen), which expand does not "
                "support (its merges live in tokenizer.json)") if (base / "tokenizer.json").is_file() else ""
        raise ExpandError(f"{path} does not exist: the base must be a SentencePiece model (Llama 2 / Mistral "
                          f"tokenizer.model, or a folder holding one).{hint}")
    return path


def source_pieces(source: Path) -> list[tuple[str, float]]:
    """The source model's NORMAL pieces, best first (unigram: highest log-prob; BPE: earliest merge)."""
    proto = load_proto(source)
    normal = pb().ModelProto.SentencePiece.NORMAL
    pieces = [(piece.piece, piece.score) for piece in proto.pieces if piece.type == normal]
    return sorted(pieces, key=lambda item: -item[1])


def appended_pieces(base_proto, candidates: list[tuple[str, float]], budget: int) -> tuple[list[tuple[str, float]], int]:
    """(piece, score) to append, at most `budget`, and how many were unreachable (BPE)."""
    vocab = {piece.piece for piece in base_proto.pieces}
    fresh = [(piece, score) for piece, score in candidates if piece not in vocab]
    if base_proto.trainer_spec.model_type == UNIGRAM:
        return fresh[:budget], 0
    lowest = min((piece.score for piece in base_proto.pieces), default=0.0)
    chosen: list[tuple[str, float]] = []
    pending = sorted(fresh, key=lambda item: len(item[0]))  # shorter first: they make longer ones reachable
    progress = True
    while pending and len(chosen) < budget and progress:
        progress, waiting = False, []
        for piece, _ in pending:
            if len(chosen) < budget and (len(piece) == 1 or any(
                    piece[:cut] in vocab and piece[cut:] in vocab for cut in range(1, len(piece)))):
                chosen.append((piece, lowest - 1.0 - len(chosen)))  # after every base merge, in this order
                vocab.add(piece)
                progress = True
            else:
                waiting.append((piece, 0.0))
        pending = waiting
    return chosen, len(pending) if len(chosen) < budget else 0


def expand(base: str | Path, source: str | Path, vocab_size: int, out_dir: str | Path) -> Expansion:
    """Write OUT_DIR (tokenizer.model, tokenizer_meta.json, HF files): the base plus the source's pieces up to vocab_size."""
    from tokenizer.export_hf import export_hf

    base_path, source = base_model_path(base), Path(source)
    if not source.is_file():
        raise ExpandError(f"{source} does not exist: give a SentencePiece model to take pieces from (e.g. "
                          "the Japanese model under an ayumi tokenizer's work folder, or any .model)")
    proto = load_proto(base_path)
    if proto.trainer_spec.model_type not in (UNIGRAM, BPE):
        raise ExpandError(f"{base_path}: SentencePiece model type {proto.trainer_spec.model_type} (word/char) is not "
                          "supported; unigram and BPE are")
    base_size = len(proto.pieces)
    if vocab_size <= base_size:
        raise ExpandError(f"--vocab {vocab_size} is not larger than the base's {base_size} pieces")
    pieces, unreachable = appended_pieces(proto, source_pieces(source), vocab_size - base_size)
    normal = pb().ModelProto.SentencePiece.NORMAL
    for piece, score in pieces:
        proto.pieces.add(piece=piece, score=score, type=normal)
    proto.trainer_spec.vocab_size = len(proto.pieces)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model_path = tmp / MODEL_FILE
        model_path.write_bytes(proto.SerializeToString())
        export_hf(model_path, tmp)
        spec = proto.trainer_spec
        meta = {"vocab_size": len(proto.pieces), "unk_id": spec.unk_id, "bos_id": spec.bos_id, "eos_id": spec.eos_id,
                "pad_id": spec.pad_id, "sha256": tokenizer_sha256(model_path),
                "expanded_from": {"base": str(base_path), "base_sha256": tokenizer_sha256(base_path),
                                  "base_size": base_size, "source": str(source), "added": len(pieces)}}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Expansion(out_dir, base_size, len(pieces), unreachable)


def expansion_record(tokenizer_dir: str | Path) -> dict | None:
    """`expanded_from` of a tokenizer folder written by `expand` (None for any other tokenizer)."""
    meta = Path(tokenizer_dir) / META_FILE
    if not meta.is_file():
        return None
    try:
        return json.loads(meta.read_text(encoding="utf-8")).get("expanded_from")
    except (OSError, json.JSONDecodeError) as err:
        raise TokenizerNotFoundError(f"{meta} cannot be read ({err})") from None
