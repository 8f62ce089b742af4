"""Merge per-domain SentencePiece models into one `ModelProto` of an exact size.

Layout of the merged vocabulary:
  ids 0..3            unk / bos / eos / pad (ids configurable within 0..3)
  next                user-defined pieces (newline, domain tags), always kept whole
  next 256            byte pieces <0x00>..<0xFF> (byte fallback)
  the rest            learned pieces.

Unigram (the default): `candidate_proto` pools every domain model's learned pieces (deduplicated; "▁the"
word-initial and "the" inside a word are distinct), the characters of the specials and the indentation
runs (tabs 1..4, spaces 2..16), scored as a mixture of the domain models, log Σ_d w_d·p_d(piece); then
`mixture.prune_to_size` re-estimates the scores by EM on the share-weighted mixture of the domains'
samples and prunes the pieces that cost least, until exactly the configured size is left (see
tokenizer/mixture.py for why and how).

BPE: multi-character pieces are interleaved by *relative* rank — piece r of domain d ranks at
r / vocab_size_d, so every domain keeps the same top fraction of its pieces — after every domain's
single characters; the score is the merge priority, -position in that order (a piece's parts, learned
earlier in its own domain, always rank above it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tokenizer.proto import pb
from tokenizer.config import NUM_BYTE_PIECES, TokenizerConfig, special_pieces


class MergeError(ValueError):
    """The domain models cannot fill the requested vocabulary; the message says by how much and the fix."""


@dataclass(frozen=True)
class DomainPieces:
    """A trained domain model's learned pieces, best first."""

    domain: str
    """Domain name."""
    pieces: list[tuple[str, float]]
    """(piece, score) of NORMAL pieces, best first (unigram: highest log-prob; bpe: earliest merge)."""
    weight: float
    """The domain's share of the mixed training sample (for the interpolated scores)."""
    vocab_size: int
    """The domain model's configured size (its relative-rank denominator)."""


def load_proto(path: str | Path):
    proto = pb().ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def domain_pieces(domain: str, model_path: Path, weight: float, vocab_size: int) -> DomainPieces:
    proto = load_proto(model_path)
    normal = pb().ModelProto.SentencePiece.NORMAL
    pieces = [(p.piece, p.score) for p in proto.pieces if p.type == normal]
    pieces.sort(key=lambda item: -item[1])  # stable: bpe scores are already -order
    return DomainPieces(domain, pieces, weight, vocab_size)


def target_size(cfg: TokenizerConfig) -> int:
    """total_vocab, rounded up to pad_to_multiple_of when set."""
    multiple = cfg.pad_to_multiple_of
    return cfg.total_vocab if multiple <= 0 else -(-cfg.total_vocab // multiple) * multiple


def byte_piece(value: int) -> str:
    return f"<0x{value:02X}>"


SPECIAL_CHARS_OWNER = "specials"
"""Owner of a character piece kept only because a special token is spelled with it."""


def special_chars(specials: Sequence[str]) -> list[str]:
    """Characters of the control/unknown pieces (unk/bos/eos/pad), in order, each once.

    The HF export keeps these pieces in its vocabulary at a score no text piece reaches, yet an
    unknown character costs even less there (HF prices it below the lowest score); a literal "<s>"
    whose "<" were not a piece would then become id 1 in HF but bytes in SentencePiece. With every
    character of the specials a piece, the characters always win (export_hf.py)."""
    return list(dict.fromkeys(ch for piece in specials for ch in piece))


INDENT_OWNER = "indentation"
"""Owner of an indentation-run piece the merge adds whether or not a domain learned it."""


def indentation_pieces(tabs: int, spaces: int) -> list[str]:
    """Runs of 1..tabs tabs and 2..spaces spaces (as "▁", SentencePiece's space symbol), longest first.

    Every domain model learns its whitespace pieces from training lines that each start with the dummy
    prefix, so they all begin with "▁" ("▁\t\t"); after a newline inside a document there is no "▁",
    and two tabs cost two tokens. These pieces fit there; their scores come from the re-estimation."""
    return ["\t" * n for n in range(tabs, 0, -1)] + ["▁" * n for n in range(spaces, 1, -1)]


def select_pieces(domains: Sequence[DomainPieces], budget: int, reserved: set[str],
                  required_chars: Sequence[str] = (), forced: Sequence[str] = ()) -> list[tuple[str, str]]:
    """`budget` distinct (piece, domain) pairs: all single characters (required_chars included, whether or
    not a domain learned them), the `forced` pieces (indentation runs), then the interleaved multi-character pieces."""
    chosen: dict[str, str] = {}
    for d in domains:
        for piece, _ in d.pieces:
            if len(piece) == 1 and piece not in reserved:
                chosen.setdefault(piece, d.domain)
    for ch in required_chars:
        if ch not in reserved:
            chosen.setdefault(ch, SPECIAL_CHARS_OWNER)
    for piece in forced:
        if piece not in reserved:
            chosen.setdefault(piece, INDENT_OWNER)
    if len(chosen) > budget:
        raise MergeError(
            f"the domain models need {len(chosen)} single-character pieces but only {budget} places are left "
            "after specials and bytes. Fix: raise tokenizer.total_vocab or lower character_coverage of the domains."
        )
    ranked = []
    for index, d in enumerate(domains):
        multi = [piece for piece, _ in d.pieces if len(piece) > 1]
        ranked += [(rank / d.vocab_size, index, piece, d.domain) for rank, piece in enumerate(multi)]
    ranked.sort(key=lambda item: (item[0], item[1]))
    reserved_chars = {symbol for symbol in reserved if len(symbol) == 1}  # once, not per candidate
    for _, _, piece, domain in ranked:
        if len(chosen) == budget:
            break
        if piece not in reserved and not any(symbol in piece for symbol in reserved_chars):
            chosen.setdefault(piece, domain)
    if len(chosen) < budget:
        missing = budget - len(chosen)
        raise VocabShortfall(missing, 
            f"the domain models hold {len(chosen)} distinct pieces after de-duplication, {missing} short of the "
            f"{budget} needed to fill the vocabulary. Fix: raise tokenizer.domains.*.vocab_size by about "
            f"{math.ceil(100 * missing / max(1, sum(d.vocab_size for d in domains)))+5}% or lower tokenizer.total_vocab."
        )
    singles = [(p, d) for p, d in chosen.items() if len(p) == 1]
    multis = [(p, d) for p, d in chosen.items() if len(p) > 1]
    return multis + singles  # order only matters for BPE priorities; characters last, as SentencePiece does


def interpolated_scores(domains: Sequence[DomainPieces], pieces: Sequence[str]) -> list[float]:
    """log Σ_d w_d p_d(piece): the domain models as a mixture, weighted by sample share."""
    total_weight = sum(d.weight for d in domains) or 1.0
    tables = [(d.weight / total_weight, dict(d.pieces)) for d in domains]
    floor = min(score for d in domains for _, score in d.pieces) - 1.0
    scores = []
    for piece in pieces:
        mass = sum(w * math.exp(table[piece]) for w, table in tables if piece in table)
        scores.append(math.log(mass) if mass > 0 else floor)
    return scores


def _base_proto(cfg: TokenizerConfig, template_model: Path):
    """A ModelProto holding only the specials (ids 0..3, then user-defined) and the 256 byte pieces."""
    Piece = pb().ModelProto.SentencePiece
    proto = load_proto(template_model)
    del proto.pieces[:]
    specials = special_pieces(cfg.specials)
    s = cfg.specials
    for index, piece in enumerate(specials):
        kind = Piece.UNKNOWN if index == s.unk_id else Piece.CONTROL if index < 4 else Piece.USER_DEFINED
        proto.pieces.add(piece=piece, score=0.0, type=kind)
    for value in range(NUM_BYTE_PIECES):
        proto.pieces.add(piece=byte_piece(value), score=0.0, type=Piece.BYTE)
    return proto, specials


def build_proto(cfg: TokenizerConfig, template_model: Path, domains: Sequence[DomainPieces]):
    """BPE: the merged ModelProto of the rank-interleaved pieces, scores = merge priorities."""
    proto, specials = _base_proto(cfg, template_model)
    size = target_size(cfg)
    reserved = set(specials) | {byte_piece(v) for v in range(NUM_BYTE_PIECES)}
    forced = indentation_pieces(cfg.merge.indent_tabs, cfg.merge.indent_spaces)
    selected = select_pieces(domains, size - len(proto.pieces), reserved, special_chars(specials[:4]), forced)
    Piece = pb().ModelProto.SentencePiece
    for index, (piece, _) in enumerate(selected):
        proto.pieces.add(piece=piece, score=-float(index), type=Piece.NORMAL)
    _set_trainer_spec(proto, cfg, size)
    return proto, dict(selected)


def candidate_proto(cfg: TokenizerConfig, template_model: Path, domains: Sequence[DomainPieces]):
    """Unigram: every domain's learned pieces (deduplicated), the specials' characters and the indentation
    runs, scored by the domain models as a mixture, for `mixture.prune_to_size` to cut to the exact size.

    Returns the proto and the pieces pruning must keep (characters of the specials, indentation runs);
    a VocabShortfall when the pool is already smaller than the vocabulary."""
    from tokenizer.mixture import crosses_words

    proto, specials = _base_proto(cfg, template_model)
    reserved = {p.piece for p in proto.pieces}
    reserved_chars = {symbol for symbol in reserved if len(symbol) == 1}
    pool: dict[str, None] = {}
    for d in domains:
        for piece, _ in d.pieces:
            if piece not in reserved and (len(piece) == 1 or not any(ch in piece for ch in reserved_chars)) \
                    and not crosses_words(piece):
                pool.setdefault(piece)
    protected = [ch for ch in special_chars(specials[:4]) if ch not in reserved]
    protected += [run for run in indentation_pieces(cfg.merge.indent_tabs, cfg.merge.indent_spaces) if run not in reserved]
    for piece in protected:
        pool.setdefault(piece)
    size = target_size(cfg)
    if len(proto.pieces) + len(pool) < size:
        missing = size - len(proto.pieces) - len(pool)
        raise VocabShortfall(missing,
            f"the domain models hold {len(pool)} distinct pieces after de-duplication, {missing} short of the "
            f"{size - len(proto.pieces)} learned pieces the vocabulary needs. Fix: raise tokenizer.merge.pool_factor "
            f"or tokenizer.domains.*.vocab_size by about "
            f"{math.ceil(100 * missing / max(1, sum(d.vocab_size for d in domains))) + 5}%, or lower tokenizer.total_vocab.")
    pieces = list(pool)
    Piece = pb().ModelProto.SentencePiece
    for piece, score in zip(pieces, interpolated_scores(domains, pieces)):
        proto.pieces.add(piece=piece, score=score, type=Piece.NORMAL)
    _set_trainer_spec(proto, cfg, size)
    return proto, set(protected)


def _set_trainer_spec(proto, cfg: TokenizerConfig, size: int) -> None:
    """Make the trainer/normalizer specs describe the merged model (SentencePiece reads ids and flags from them)."""
    spec, s = proto.trainer_spec, cfg.specials
    spec.model_type = spec.UNIGRAM if cfg.model_type == "unigram" else spec.BPE
    spec.vocab_size = size
    spec.unk_id, spec.bos_id, spec.eos_id, spec.pad_id = s.unk_id, s.bos_id, s.eos_id, s.pad_id
    spec.unk_piece, spec.bos_piece, spec.eos_piece, spec.pad_piece = s.unk, s.bos, s.eos, s.pad
    spec.byte_fallback = True
    del spec.user_defined_symbols[:]
    spec.user_defined_symbols.extend(s.user_defined)
    spec.ClearField("input")
    spec.model_prefix = ""
    proto.normalizer_spec.add_dummy_prefix = cfg.add_dummy_prefix
    proto.normalizer_spec.remove_extra_whitespaces = cfg.remove_extra_whitespaces


class VocabShortfall(MergeError):
    """The domain models hold too few distinct pieces to fill the vocabulary (`missing` more needed)."""

    def __init__(self, missing: int, message: str):
        super().__init__(message)
        self.missing = missing


def quantize_scores(proto, quantum: float) -> int:
    """Round NORMAL pieces' scores to multiples of `quantum` (a power of two); returns how many changed.

    SentencePiece adds path scores in float32, Hugging Face's tokenizers in float64. With scores on
    a coarse binary grid every partial sum is exactly representable in both (up to |sum| <
    2^24 * quantum, e.g. ~200k tokens at 1/8), so both Viterbi searches compare the same numbers
    and, iterating candidates in the same order, pick the same segmentation, ties included. Without
    it, long documents can round differently in float32 and split differently. A 1/8 step in log
    probability (a 13% probability ratio) costs well under 0.1% compression here.
    """
    if quantum <= 0:
        return 0
    if math.log2(quantum) != int(math.log2(quantum)):
        raise ValueError(f"tokenizer.merge.score_quantum={quantum} must be a power of two (e.g. 0.125), or 0 for off")
    normal_type = pb().ModelProto.SentencePiece.NORMAL
    changed = 0
    for piece in proto.pieces:
        if piece.type == normal_type:
            rounded = round(piece.score / quantum) * quantum
            changed += rounded != piece.score
            piece.score = rounded
    return changed


def promote_runs(proto, runs: Sequence[str], margin: float) -> int:
    """Give each indentation run a score `margin` above its best split into shorter pieces; returns how
    many changed.

    Viterbi EM cannot discover such a piece: once "▁" alone is frequent, "▁▁" is never chosen, gets
    only the smoothing count and stays below two "▁". Raised above every split of its own characters,
    a run is one token wherever it stands; it cannot win anywhere else, as only those characters match
    it. Shortest runs first, so a longer run's best split already sees the raised shorter ones."""
    ids = {p.piece: i for i, p in enumerate(proto.pieces)}
    changed = 0
    for run in sorted((r for r in runs if r in ids), key=len):
        best = _best_split(run, ids, proto)
        piece = proto.pieces[ids[run]]
        if best is not None and piece.score <= best:
            piece.score = best + margin
            changed += 1
    return changed


def _best_split(text: str, ids: dict[str, int], proto) -> float | None:
    """The best score of `text` cut into two or more vocabulary pieces (None if it cannot be)."""
    n = len(text)
    best: list[float | None] = [0.0] + [None] * n  # best[j]: best score of text[:j] in pieces
    for j in range(1, n + 1):
        for i in range(0 if j < n else 1, j):  # the whole text as one piece is not a split
            piece, prefix = text[i:j], best[i]
            if prefix is not None and piece in ids and (i > 0 or j < n):
                score = prefix + proto.pieces[ids[piece]].score
                if best[j] is None or score > best[j]:
                    best[j] = score
    return best[n]
