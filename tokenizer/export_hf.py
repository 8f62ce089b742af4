"""Exact Hugging Face export of a merged SentencePiece model: tokenizer.json + transformers config files.

Built piece by piece instead of through transformers' generic converter, whose Metaspace
pre-tokenizer does not reproduce SentencePiece on whitespace runs. What makes the ids identical:
  - normaliser = [charsmap if any] → [collapse whitespace if configured] → Prepend("▁") → Replace(" ", "▁"),
    and no pre-tokenizer: the whole text is one lattice, as in SentencePiece;
  - user-defined pieces (newline, tags) live in the model with SentencePiece's own lattice score for
    them (length · max(FLT_MIN, max normal score) − 0.1) instead of being split out as added tokens, which
    would cut the text and re-apply the dummy prefix after every newline;
  - control and byte pieces, which SentencePiece never matches in text, get a score so low that HF's
    lattice never prefers them either (the unknown-token score moves with it, but every path over an
    unknown character shares that node, so no choice changes);
  - byte fallback on, unk fused (the bytes of a run of unknown characters are the same either way).
Text never becomes a special token, as in SentencePiece (which never matches control pieces in text):
  - bos/eos/pad/unk live in the model's vocabulary only, not in tokenizer.json's added tokens, which
    HF would cut out of the text (a regex's "(?P<s>…)" or an HTML "<s>" would become id 1 and the
    dummy prefix would be re-applied after it);
  - tokenizer_config.json names them (bos_token, …) for training code and sets
    `split_special_tokens: true`, so transformers, which registers them again on load, still reads
    them in text as characters. Add bos/eos by id (`tokenizer.bos_token_id`), never as a string;
  - their vocabulary entries get NEVER_SCORE, so HF's lattice never prefers them over the characters
    "<", "s", ">" — which the merge keeps as pieces (merge.py), since an unknown character would
    otherwise cost even less.
encode adds no bos/eos by default, so `encode(text)` equals SentencePiece's `encode(text)` for any text.
A literal "▁" in text is the same symbol as a space to both (ids identical; it decodes as " ").
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tokenizer.config import TokenizerConfig
from tokenizer.merge import load_proto
from tokenizer.proto import pb

NEVER_SCORE = -1.0e6  # control/byte pieces: never chosen over real text in HF's lattice
FLT_MIN = float(np.finfo(np.float32).tiny)


def build_hf_tokenizer(model_path: Path):
    """A `tokenizers.Tokenizer` equivalent to the SentencePiece model at model_path."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers

    proto = load_proto(model_path)
    Piece = pb().ModelProto.SentencePiece
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    normal_scores = [p.score for p in proto.pieces if p.type == Piece.NORMAL]
    max_score = max([FLT_MIN] + normal_scores)
    vocab = []
    for p in proto.pieces:
        if p.type == Piece.NORMAL:
            score = p.score
        elif p.type == Piece.USER_DEFINED:
            score = float(np.float32(len(p.piece) * max_score - 0.1))
        else:
            score = NEVER_SCORE
        vocab.append((p.piece, score))
    if spec.model_type == spec.BPE:
        model = _bpe_model(proto, Piece)
    else:
        model = models.Unigram(vocab, unk_id=spec.unk_id, byte_fallback=True)
    tok = Tokenizer(model)

    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = None
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if norm.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(dec)
    # No added tokens: they would be cut out of the text before the model sees it (see the module docstring).
    return tok


def _bpe_model(proto, Piece):
    """SentencePiece BPE as HF BPE: merges ordered by the merged piece's priority (its score)."""
    from tokenizers import models

    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    ranked = sorted(((p.score, i, p.piece) for i, p in enumerate(proto.pieces) if p.type == Piece.NORMAL and len(p.piece) > 1),
                    key=lambda t: (-t[0], t[1]))
    merges = []
    for _, _, piece in ranked:
        # Every split of the piece into two existing pieces is a merge that yields it; best-ranked parts first.
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in vocab and piece[k:] in vocab]
        splits.sort(key=lambda ab: (vocab[ab[0]], vocab[ab[1]]))
        merges += splits
    return models.BPE(vocab=vocab, merges=merges, unk_token=proto.pieces[proto.trainer_spec.unk_id].piece,
                      byte_fallback=True, fuse_unk=True)


PARITY_PROBES = [
    "<s></s><unk><pad>", "(?P<s>\\d+)</s>", "<s>text</s>", "x <pad>  <unk>\n<s>", "▁ ▁▁x▁", "a\r\nb\rc",
    "\n\t\treturn x\n", "  \n    \n\t \t", "🦜𠮷鷗", "ｆｕｌｌ　ｗｉｄｔｈ", "e\u0301\u0308",
]
"""Texts that break a naive export (special-token literals, whitespace runs, CR, rare characters): the build
reports them beside the held-out documents as "_probes"."""
SPECIAL_PROBES = PARITY_PROBES[:4]
"""The special tokens' text: every export refuses to turn it into anything but SentencePiece's ids."""


class ExportParityError(ValueError):
    """The exported tokenizer.json would give other ids than SentencePiece for some text."""


def check_probes(model_path: Path, tok) -> None:
    """Refuse an export whose ids differ from SentencePiece's on the special tokens' text (SPECIAL_PROBES). A model
    without pieces for the characters of "<s>" & co. is one: HF would read such text as the special token itself."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    for text in SPECIAL_PROBES:
        want, got = sp.encode(text), tok.encode(text, add_special_tokens=False).ids
        if want != got:
            raise ExportParityError(
                f"{model_path}: the Hugging Face export would encode {text!r} as {got}, SentencePiece as {want}. "
                "Fix: train the model with byte_fallback (or with pieces for every character of the special "
                "tokens' text, as `ayumi tokenizer build` does)")


def export_hf(model_path: Path, out_dir: Path, cfg: TokenizerConfig | None = None, model_max_length: int = 1 << 20) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json next to the model (after
    check_probes: never an export that turns text into other ids)."""
    proto = load_proto(model_path)
    spec = proto.trainer_spec
    tok = build_hf_tokenizer(model_path)
    check_probes(model_path, tok)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    names = {"unk_token": spec.unk_id, "bos_token": spec.bos_id, "eos_token": spec.eos_id, "pad_token": spec.pad_id}
    special_map = {name: proto.pieces[i].piece for name, i in names.items() if i >= 0}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_map,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "legacy": False,
        # transformers registers the tokens above as special on load; this keeps it from cutting them out
        # of text, so "<s>" typed in text stays characters (ids identical to SentencePiece).
        "split_special_tokens": True,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, ensure_ascii=False, indent=2), encoding="utf-8")
    return [out_dir / n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")]
