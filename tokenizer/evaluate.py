"""Compression and fidelity of tokenizers on held-out text, per domain: a table and a JSON file.

Per domain and tokenizer: characters per token (llm-jp's length_per_token), bytes per token, the
share of byte-fallback tokens, the unknown-token rate and exact round-trip (decode(encode(x)) == x).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from common.corpus import iter_documents

BYTE_TOKEN = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


@dataclass
class Encoder:
    """A tokenizer reduced to what the evaluation needs."""

    name: str
    """Label in the table."""
    encode_batch: Callable[[list[str]], list[list[int]]]
    """Texts → ids (no bos/eos)."""
    decode: Callable[[list[int]], str]
    """Ids → text."""
    byte_ids: frozenset
    """Ids of byte-fallback pieces."""
    unk_id: int
    """Id of the unknown piece (-1 when none)."""
    vocab_size: int
    """Vocabulary size."""


def spm_encoder(name: str, model: str | Path | bytes, num_threads: int = 2) -> Encoder:
    """A SentencePiece model file (or serialized proto) as an Encoder."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model) if isinstance(model, bytes) else \
        spm.SentencePieceProcessor(model_file=str(model))
    byte_ids = frozenset(i for i in range(sp.get_piece_size()) if sp.is_byte(i))
    return Encoder(name, lambda texts: sp.encode(texts, num_threads=num_threads), sp.decode,
                   byte_ids, sp.unk_id(), sp.get_piece_size())


def hf_encoder(name: str, path: str | Path) -> Encoder:
    """An HF tokenizer (tokenizer.json, or a folder holding one) as an Encoder."""
    from tokenizers import Tokenizer

    path = Path(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    vocab = tok.get_vocab(with_added_tokens=True)
    byte_ids = frozenset(i for piece, i in vocab.items() if BYTE_TOKEN.match(piece))
    unk = getattr(tok.model, "unk_token", None)
    unk_id = vocab.get(unk, -1) if isinstance(unk, str) else (tok.model.unk_id if hasattr(tok.model, "unk_id") else -1)
    return Encoder(
        name,
        lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)],
        lambda ids: tok.decode(ids, skip_special_tokens=False),
        byte_ids, unk_id if unk_id is not None else -1, tok.get_vocab_size(with_added_tokens=True),
    )


def load_encoder(name: str, path: str | Path, num_threads: int = 2) -> Encoder:
    """A .model file → SentencePiece; a folder with tokenizer.json or a .json file → HF tokenizers."""
    path = Path(path)
    if path.is_dir() and (path / "tokenizer.model").exists() and not (path / "tokenizer.json").exists():
        return spm_encoder(name, path / "tokenizer.model", num_threads)
    if path.suffix == ".model":
        return spm_encoder(name, path, num_threads)
    if path.suffix == ".json" or (path.is_dir() and (path / "tokenizer.json").exists()):
        return hf_encoder(name, path)
    raise FileNotFoundError(
        f"tokenizer {name!r}: {path} is neither a SentencePiece .model nor an HF tokenizer.json / folder holding one. "
        "Fix: point to one of those."
    )


def measure(encoder: Encoder, texts: Sequence[str], batch: int = 512) -> dict:
    """The metrics of one tokenizer on one domain's texts."""
    chars = nbytes = tokens = byte_tokens = unk = failures = 0
    first_failure = None
    for start in range(0, len(texts), batch):
        chunk = list(texts[start:start + batch])
        for text, ids in zip(chunk, encoder.encode_batch(chunk)):
            chars += len(text)
            nbytes += len(text.encode("utf-8"))
            tokens += len(ids)
            byte_tokens += sum(1 for i in ids if i in encoder.byte_ids)
            unk += sum(1 for i in ids if i == encoder.unk_id)
            if encoder.decode(ids) != text:
                failures += 1
                first_failure = first_failure or text[:80]
    return {
        "docs": len(texts), "chars": chars, "bytes": nbytes, "tokens": tokens,
        "chars_per_token": chars / tokens if tokens else 0.0,
        "bytes_per_token": nbytes / tokens if tokens else 0.0,
        "byte_fallback_share": byte_tokens / tokens if tokens else 0.0,
        "unk_rate": unk / tokens if tokens else 0.0,
        "roundtrip_failures": failures,
        "roundtrip_ok": failures == 0,
        "first_roundtrip_failure": first_failure,
    }


def evaluate(encoders: Sequence[Encoder], texts_by_domain: dict[str, Sequence[str]]) -> dict:
    """{tokenizer: {domain: metrics, "all": totals}} for every encoder on every domain."""
    results: dict[str, dict] = {}
    for encoder in encoders:
        per_domain = {domain: measure(encoder, texts) for domain, texts in texts_by_domain.items()}
        results[encoder.name] = {"vocab_size": encoder.vocab_size, "domains": per_domain, "all": _totals(per_domain)}
    return results


def _totals(per_domain: dict[str, dict]) -> dict:
    keys = ("docs", "chars", "bytes", "tokens", "roundtrip_failures")
    total = {k: sum(m[k] for m in per_domain.values()) for k in keys}
    tokens = total["tokens"] or 1
    total["chars_per_token"] = total["chars"] / tokens
    total["bytes_per_token"] = total["bytes"] / tokens
    total["byte_fallback_share"] = sum(m["byte_fallback_share"] * m["tokens"] for m in per_domain.values()) / tokens
    total["unk_rate"] = sum(m["unk_rate"] * m["tokens"] for m in per_domain.values()) / tokens
    total["roundtrip_ok"] = total["roundtrip_failures"] == 0
    return total


def comparison(results: dict, ours: str = "merged", baseline: str = "joint_baseline",
               mix: dict[str, float] | None = None) -> dict | None:
    """Merged vs baseline: total-token ratios and chars/token ratio per domain (None without a baseline).

    total_tokens_ratio counts the held-out text as it is; total_tokens_ratio_mix weights each domain's
    tokens-per-byte by `mix` (the domains' shares of the training sample), i.e. a held-out text mixed
    in the sample's proportions whatever the held-out sizes are."""
    if ours not in results or baseline not in results:
        return None
    a, b = results[ours], results[baseline]

    def mixed(result: dict) -> float:
        weights = mix or {d: m["bytes"] for d, m in result["domains"].items()}
        return sum(w * result["domains"][d]["tokens"] / max(1, result["domains"][d]["bytes"]) for d, w in weights.items())

    return {
        "total_tokens_ratio": a["all"]["tokens"] / max(1, b["all"]["tokens"]),
        "total_tokens_ratio_mix": mixed(a) / max(1e-12, mixed(b)),
        "chars_per_token_ratio": {
            d: a["domains"][d]["chars_per_token"] / max(1e-9, b["domains"][d]["chars_per_token"]) for d in a["domains"]
        },
    }


def format_table(results: dict) -> str:
    """Console table: one row per (tokenizer, domain)."""
    header = f"{'tokenizer':<18} {'vocab':>7} {'domain':<10} {'chars/tok':>9} {'bytes/tok':>9} {'tokens':>10} " \
             f"{'bytefb%':>8} {'unk%':>6} {'roundtrip':>9}"
    lines = [header, "-" * len(header)]
    for name, result in results.items():
        rows = list(result["domains"].items()) + [("all", result["all"])]
        for domain, m in rows:
            lines.append(
                f"{name:<18} {result['vocab_size']:>7} {domain:<10} {m['chars_per_token']:>9.3f} {m['bytes_per_token']:>9.3f} "
                f"{m['tokens']:>10} {100 * m['byte_fallback_share']:>8.3f} {100 * m['unk_rate']:>6.3f} "
                f"{'ok' if m['roundtrip_ok'] else str(m['roundtrip_failures']) + ' bad':>9}"
            )
    return "\n".join(lines)


def read_texts(spec: dict[str, str | list[str]], text_field: str = "text") -> dict[str, list[str]]:
    """domain → held-out documents, from jsonl/txt/parquet/datasets paths (text files: one doc per paragraph)."""
    texts = {}
    for domain, patterns in spec.items():
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        texts[domain] = [d.text for d in iter_documents(patterns, text_field=text_field, text_unit="paragraph")]
    return texts


def write_json(results: dict, path: Path, extra: dict | None = None) -> None:
    payload = {"results": results, **(extra or {})}
    path.write_text(json.dumps(payload, ensure_ascii=False, indent=2), encoding="utf-8")
