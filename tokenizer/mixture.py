"""Unigram merge by EM and loss-based pruning on the share-weighted mixture of the domains' samples.

The rank interleave (keep the same top fraction of every domain model) gives each domain its share,
but cannot see which pieces the *mixture* needs: a piece learned by two domains counts once, a domain
model's 1,800th piece may be worth more than another's 900th, and pieces that only make sense inside
their own model's segmentation stay. Measured on real corpora it lost 5-6% chars/token on code and
math to one joint SentencePiece model of the same size.

So the merge does for the union of the domain models what SentencePiece's trainer does for one corpus:

1. Candidates: every learned piece of every domain model (trained `merge.pool_factor` times larger than
   its share, so the pool holds more than the vocabulary needs), plus the characters of the specials and
   the indentation runs.
2. EM: segment each domain's lines with the current model (SentencePiece's own Viterbi encoder), weight
   each domain's piece counts by the domain's weight per character, and set log p(piece) from the
   weighted counts.
3. Prune: a piece's loss is how much the weighted log-likelihood drops when every use of it is replaced
   by its best split into the other pieces, count x (log p(piece) - log p(split)). Drop the pieces
   that cost least (at most a `shrink` fraction per round) and go back to 2, until exactly the
   vocabulary's size is left. Single characters, the specials' characters and indentation runs are
   never dropped (coverage, special-token safety, one token per indentation run).

Domain weights (`merge.share_weight` = a): W_d ∝ chars_d^(1-a) * share_d^a, where chars_d is the
domain's share of the sample's characters (what a joint model optimises) and share_d its configured
vocab_size. a=0 is the joint model's objective on a better candidate pool; a=1 lets the configured
shares alone decide how much each domain's compression counts. Between them it trades exactly as
SentencePiece's own trainer does when a domain is up-weighted in its input (docs/tokenizer.md).
"""
from __future__ import annotations

import math
import re
import time
from collections import Counter
from itertools import chain
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from tokenizer.proto import pb

Log = Callable[[str], None]


def domain_mass(chars: dict[str, int], shares: dict[str, float], share_weight: float) -> dict[str, float]:
    """Each domain's part of the merge's objective, W_d ∝ chars_d^(1-a) * share_d^a, summing to 1."""
    total_chars = sum(chars.values()) or 1
    total_share = sum(shares.values()) or 1.0
    mass = {d: (chars[d] / total_chars) ** (1 - share_weight) * (shares[d] / total_share) ** share_weight
            for d in chars}
    norm = sum(mass.values()) or 1.0
    return {d: m / norm for d, m in mass.items()}


def domain_weights(chars: dict[str, int], shares: dict[str, float], share_weight: float) -> dict[str, float]:
    """Weight per character of each domain's EM lines: W_d / chars_d (domain_mass)."""
    return {d: m / max(1, chars[d]) for d, m in domain_mass(chars, shares, share_weight).items()}


@dataclass(frozen=True)
class WordCounts:
    """A domain's EM text as distinct space-led words and how often each occurs (SentencePiece's trainer
    works on the same: no learned piece crosses into the next word, so each word's Viterbi split is its
    split inside the line, and encoding each distinct word once gives the line counts at a fraction of the cost)."""

    words: list[str]
    """Distinct words, each with its leading spaces (the first of a line gets the dummy prefix's space)."""
    freqs: np.ndarray
    """Occurrences of each word."""
    chars: int
    """Characters of the lines they came from (the domain's weight is per character)."""


WORD = re.compile(r" *[^ ]+| +$")
"""A run of spaces with the non-space characters after it; trailing spaces stand alone."""


def word_counts(lines: Sequence[str], dummy_prefix: bool, remove_extra_whitespaces: bool = False) -> WordCounts:
    """The lines' distinct words, with the model's whitespace handling applied to the line first (dummy prefix,
    collapsed spaces), so each word is encoded exactly as it stands inside its line."""
    counter: Counter = Counter()
    prefix = " " if dummy_prefix else ""
    for line in lines:
        if remove_extra_whitespaces:
            line = re.sub(" +", " ", line).strip(" ")
        counter.update(WORD.findall(prefix + line))
    words = list(counter)
    return WordCounts(words, np.fromiter((counter[w] for w in words), dtype=np.float64, count=len(words)),
                      sum(map(len, lines)))


def crosses_words(piece: str) -> bool:
    """True for a piece with a space after a non-space character ("a▁b", "x▁"): it would span two words.
    SentencePiece's domain models never learn one (split_by_whitespace); the merge leaves any such piece out
    so that counting per word stays exact."""
    return re.search("[^▁]▁", piece) is not None


def domain_counts(proto, words_by_domain: dict[str, WordCounts], num_threads: int) -> dict[str, np.ndarray]:
    """How often each id is used in the Viterbi segmentation of each domain's text (word by word)."""
    import sentencepiece as spm

    word_proto = type(proto)()
    word_proto.CopyFrom(proto)
    word_proto.trainer_spec.vocab_size = len(proto.pieces)
    word_proto.normalizer_spec.add_dummy_prefix = False  # the words carry their own leading space
    word_proto.normalizer_spec.remove_extra_whitespaces = False  # word_counts applied it to the lines
    sp = spm.SentencePieceProcessor(model_proto=word_proto.SerializeToString())
    counts = {}
    for domain, wc in words_by_domain.items():
        total = np.zeros(len(proto.pieces), dtype=np.float64)
        for start in range(0, len(wc.words), 50_000):  # bounded memory for the id lists
            ids = sp.encode(wc.words[start:start + 50_000], num_threads=num_threads)
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
            total += np.bincount(flat, weights=np.repeat(wc.freqs[start:start + 50_000], lengths),
                                 minlength=len(proto.pieces))
        counts[domain] = total
    return counts


def em_pass(proto, lines_by_domain: dict[str, WordCounts], weights: dict[str, float], smoothing: float,
            num_threads: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One Viterbi-EM step: NORMAL pieces' scores become log of their weighted relative frequency.

    Returns the weighted counts (scaled to the raw token total, so `smoothing` keeps its meaning) and
    the raw counts per domain."""
    counts = domain_counts(proto, lines_by_domain, num_threads)
    weighted = sum(counts[d] * weights[d] for d in counts)
    raw_total = sum(c.sum() for c in counts.values())
    weighted *= raw_total / max(weighted.sum(), 1e-30)
    normal_type = pb().ModelProto.SentencePiece.NORMAL
    normal = np.array([p.type == normal_type for p in proto.pieces])
    denominator = weighted[normal].sum() + smoothing * normal.sum()
    for i in np.flatnonzero(normal):
        proto.pieces[i].score = math.log((weighted[i] + smoothing) / denominator)
    return weighted, counts


def best_split_score(text: str, ids: dict[str, int], scores: Sequence[float], exclude: int,
                     max_len: int) -> float | None:
    """Best log-probability of `text` as two or more vocabulary pieces other than id `exclude` (None: no split)."""
    n = len(text)
    best: list[float | None] = [0.0] + [None] * n
    for j in range(1, n + 1):
        top = None
        for i in range(max(0, j - max_len), j):
            prefix = best[i]
            if prefix is None:
                continue
            k = ids.get(text[i:j])
            if k is None or k == exclude:
                continue
            value = prefix + scores[k]
            if top is None or value > top:
                top = value
        best[j] = top
    return best[n]


def prune_pass(proto, weighted: np.ndarray, keep: int, protected: set[str]) -> int:
    """Drop NORMAL pieces until `keep` remain, least likelihood loss first; returns how many went.

    A piece unused in the Viterbi segmentations costs nothing to drop. One with no split into other
    pieces (none of its shorter parts is a piece) is kept: dropping it would send its text to bytes."""
    normal_type = pb().ModelProto.SentencePiece.NORMAL
    ids = {p.piece: i for i, p in enumerate(proto.pieces) if p.type == normal_type}
    drop_count = len(ids) - keep
    if drop_count <= 0:
        return 0
    scores = [p.score for p in proto.pieces]
    max_len = max(len(piece) for piece in ids)
    losses = []
    for piece, i in ids.items():
        if len(piece) == 1 or piece in protected:
            continue
        if weighted[i] <= 0:
            losses.append((0.0, i))
            continue
        split = best_split_score(piece, ids, scores, i, max_len)
        if split is not None:
            losses.append((weighted[i] * (scores[i] - split), i))
    losses.sort()
    drop = {i for _, i in losses[:drop_count]}
    kept = [(p.piece, p.score, p.type) for i, p in enumerate(proto.pieces) if i not in drop]
    del proto.pieces[:]
    for piece, score, kind in kept:
        proto.pieces.add(piece=piece, score=score, type=kind)
    return len(drop)


def prune_to_size(proto, lines_by_domain: dict[str, WordCounts], weights: dict[str, float], size: int,
                  protected: set[str], *, shrink: float, em_iterations: int, smoothing: float, num_threads: int,
                  log: Log = print) -> dict[str, str]:
    """EM, prune at most a (1 - shrink) fraction, repeat until `size` pieces are left; then a last EM.

    `em_iterations` passes on the first round and the final vocabulary, one pass between prunings.

    `proto` is edited in place. The scores it ends with come from an EM pass over the final vocabulary.
    Returns each learned piece's main user (the domain whose weighted text uses it most)."""
    normal_type = pb().ModelProto.SentencePiece.NORMAL
    fixed = sum(1 for p in proto.pieces if p.type != normal_type)
    rounds = []
    while True:
        start = time.time()
        # Full passes on the first round (the interpolated scores are rough) and on the final vocabulary;
        # between prunings the scores move little, and one pass keeps them in step at a fraction of the time.
        full = not rounds or len(proto.pieces) <= size
        for _ in range(max(1, em_iterations) if full else 1):
            weighted, counts = em_pass(proto, lines_by_domain, weights, smoothing, num_threads)
        pieces = len(proto.pieces)
        rounds.append({"pieces": pieces, "tokens": {d: int(c.sum()) for d, c in counts.items()},
                       "seconds": round(time.time() - start, 2)})
        if pieces <= size:
            break
        keep = max(size, fixed + int((pieces - fixed) * shrink)) - fixed
        dropped = prune_pass(proto, weighted, keep, protected)
        if dropped == 0:
            break  # nothing more can go (every piece left is protected or unsplittable)
    log(f"[merge] EM and pruning: {' → '.join(str(r['pieces']) for r in rounds)} pieces in "
        f"{sum(r['seconds'] for r in rounds):.1f}s; tokens on the EM sample at the end: {rounds[-1]['tokens']}")
    return _owners(proto, counts, weights)


def _owners(proto, counts: dict[str, np.ndarray], weights: dict[str, float]) -> dict[str, str]:
    """Each learned piece's main user: the domain with the most weighted uses (the first domain if unused)."""
    normal_type = pb().ModelProto.SentencePiece.NORMAL
    domains = list(counts)
    stacked = np.stack([counts[d] * weights[d] for d in domains])
    best = stacked.argmax(axis=0)
    return {p.piece: domains[best[i]] for i, p in enumerate(proto.pieces) if p.type == normal_type}
