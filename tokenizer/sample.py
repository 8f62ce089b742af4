"""Deterministic, memory-bounded sampling of each domain into training lines and held-out documents.

One pass over the inputs. Every document draws a uniform key from a RNG seeded by (seed, domain):
keys below `heldout_fraction` go to the held-out set, the rest compete for the training sample.
Each set keeps the documents with the smallest keys that fit its bounds (bytes, lines) — a uniform
random sample of whole documents whose memory never exceeds the bound, whatever the input size.
"""
from __future__ import annotations

import heapq
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from tokenizer.config import DomainConfig, SampleConfig
from tokenizer.presegment import PresegmentStats, write_word_counts
from common.corpus import CorpusError, ReadStats, iter_documents

# SentencePiece's worst case, from its documentation and the issue: ~7 GB of RAM per 1M sentences.
SPM_BYTES_PER_SENTENCE = 7_000


class SampleError(ValueError):
    """A domain yields no usable sample; the message names the domain, its inputs and the fix."""


@dataclass
class DomainSample:
    """A domain's sample on disk and what reading it saw."""

    domain: str
    """Domain name."""
    train_path: Path
    """Training text, one line (sentence) per line, in random document order."""
    heldout_path: Path
    """Held-out documents as jsonl ({"text": ...})."""
    train_docs: int = 0
    """Documents in the training sample."""
    train_lines: int = 0
    """Lines written to train_path."""
    train_bytes: int = 0
    """UTF-8 bytes written to train_path."""
    train_chars: int = 0
    """Characters written to train_path (newlines included): the domain's part of the mixture the merge sees."""
    heldout_docs: int = 0
    """Documents held out."""
    heldout_bytes: int = 0
    """UTF-8 bytes held out."""
    bytes_read: int = 0
    """UTF-8 bytes of all documents read."""
    stats: ReadStats = field(default_factory=ReadStats)
    """Files/documents read and records skipped."""
    presegmented: dict[str, PresegmentStats] = field(default_factory=dict)
    """Analyzer → the word counts of the training lines made for it (word_counts_path), made when a domain
    model with that presegment is trained, so builds sharing a sample (a sweep) each get their own."""

    def to_dict(self) -> dict:
        return {
            "train_docs": self.train_docs, "train_lines": self.train_lines, "train_bytes": self.train_bytes,
            "train_chars": self.train_chars,
            "heldout_docs": self.heldout_docs, "heldout_bytes": self.heldout_bytes, "bytes_read": self.bytes_read,
            "read": self.stats.to_dict(),
            **({"presegmented": {a: st.to_dict() for a, st in self.presegmented.items()}} if self.presegmented else {}),
        }


class _BoundedSample:
    """The documents with the smallest keys whose total bytes and lines stay within bounds."""

    def __init__(self, max_bytes: int, max_lines: int):
        self.max_bytes, self.max_lines = max_bytes, max_lines
        self.heap: list[tuple[float, int, str, int, int]] = []  # (-key, seq, text, bytes, lines): max-heap on key
        self.bytes = self.lines = 0

    def offer(self, key: float, seq: int, text: str, nbytes: int, nlines: int) -> None:
        if self.heap and self._full() and key >= -self.heap[0][0]:
            return  # larger key than everything kept while full: cannot enter
        heapq.heappush(self.heap, (-key, seq, text, nbytes, nlines))
        self.bytes += nbytes
        self.lines += nlines
        while self.heap and (self.bytes > self.max_bytes or self.lines > self.max_lines):
            _, _, _, b, n = heapq.heappop(self.heap)
            self.bytes -= b
            self.lines -= n

    def _full(self) -> bool:
        return self.bytes >= self.max_bytes or self.lines >= self.max_lines

    def texts_by_key(self) -> list[str]:
        return [item[2] for item in sorted(self.heap, key=lambda item: (-item[0], item[1]))]


def training_lines(text: str, max_chars: int):
    """A document's non-blank lines, long ones cut into max_chars pieces (SentencePiece skips over-long lines)."""
    for line in text.split("\n"):
        if not line.strip():
            continue
        for start in range(0, len(line), max_chars):
            yield line[start:start + max_chars]


def sample_domain(
    domain: str,
    patterns: list[str],
    dcfg: DomainConfig,
    scfg: SampleConfig,
    out_dir: Path,
    strict: bool = False,
) -> DomainSample:
    """Read a domain's inputs once and write its training lines and held-out documents under out_dir."""
    from tqdm import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    result = DomainSample(domain, out_dir / f"{domain}.train.txt", out_dir / f"{domain}.heldout.jsonl")
    max_bytes = dcfg.sample_bytes if dcfg.sample_bytes is not None else scfg.max_bytes
    train = _BoundedSample(max_bytes, scfg.max_sentences)
    heldout = _BoundedSample(scfg.heldout_max_bytes, 1 << 62)
    rng = random.Random(f"{scfg.seed}:{domain}")
    try:
        docs = iter_documents(patterns, fmt=dcfg.format, text_field=dcfg.text_field, strict=strict,
                              stats=result.stats, text_unit=dcfg.text_unit)
        with tqdm(desc=f"read {domain}", unit="B", unit_scale=True, disable=None, leave=False) as bar:
            for seq, doc in enumerate(docs):
                nbytes = len(doc.text.encode("utf-8"))
                result.bytes_read += nbytes
                bar.update(nbytes)
                key = rng.random()
                if key < scfg.heldout_fraction:
                    heldout.offer(key, seq, doc.text, nbytes, 0)
                else:
                    nlines = sum(1 for _ in training_lines(doc.text, scfg.max_line_chars))
                    train.offer(key, seq, doc.text, nbytes, nlines)
                if scfg.read_limit_bytes and result.bytes_read >= scfg.read_limit_bytes:
                    break
    except CorpusError as err:
        raise CorpusError(f"domain {domain!r}: {err}") from None
    if not train.heap:
        raise SampleError(
            f"domain {domain!r} has no usable training text in {patterns} ({result.stats.summary()}). "
            f"Fix: check tokenizer.inputs.{domain} and tokenizer.domains.{domain}.text_field/format, "
            "or remove the domain."
        )
    _write_train(result, train.texts_by_key(), scfg.max_line_chars)
    _write_heldout(result, heldout.texts_by_key())
    return result


def word_counts_path(sample: DomainSample, analyzer: str, dummy_prefix: bool = True) -> Path:
    """Where the word counts of the training lines segmented by `analyzer` are written (next to train_path)."""
    return sample.train_path.with_name(f"{sample.domain}.words.{analyzer}{'' if dummy_prefix else '.noprefix'}.tsv")


def presegment_sample(sample: DomainSample, analyzer: str, dummy_prefix: bool = True) -> PresegmentStats:
    """Count the sample's training lines' words as `analyzer` segments them, once per analyzer (and prefix).

    train_path itself stays as it is: the merge re-estimates scores on it and the joint baseline trains on it."""
    key = analyzer if dummy_prefix else f"{analyzer}.noprefix"
    path = word_counts_path(sample, analyzer, dummy_prefix)
    if key not in sample.presegmented or not path.exists():
        sample.presegmented[key] = write_word_counts(sample.train_path, path, analyzer, dummy_prefix)
    return sample.presegmented[key]


def _write_train(result: DomainSample, texts: list[str], max_chars: int) -> None:
    with open(result.train_path, "w", encoding="utf-8") as f:
        for text in texts:
            result.train_docs += 1
            for line in training_lines(text, max_chars):
                f.write(line + "\n")
                result.train_lines += 1
                result.train_bytes += len(line.encode("utf-8")) + 1
                result.train_chars += len(line) + 1


def _write_heldout(result: DomainSample, texts: list[str]) -> None:
    with open(result.heldout_path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            result.heldout_docs += 1
            result.heldout_bytes += len(text.encode("utf-8"))


def spm_memory_estimate(lines: int) -> int:
    """Worst-case bytes of RAM SentencePiece needs to train on `lines` sentences."""
    return lines * SPM_BYTES_PER_SENTENCE


def domain_subsets(samples: dict[str, DomainSample], max_bytes: int) -> dict[str, list[str]]:
    """Up to max_bytes of training lines in all, per domain, in the samples' proportions (a prefix of each file,
    which is already in random document order)."""
    total = sum(s.train_bytes for s in samples.values())
    subsets: dict[str, list[str]] = {}
    for domain, sample in samples.items():
        budget = max_bytes * sample.train_bytes / max(total, 1)
        lines, used = [], 0
        with open(sample.train_path, encoding="utf-8") as f:
            for line in f:
                used += len(line.encode("utf-8"))
                if used > budget:
                    break
                lines.append(line.rstrip("\n"))
        subsets[domain] = lines
    return subsets
