"""Structured configs of `ayumi tokenizer` (registered with Hydra's ConfigStore) and their cross-checks.

Every field has a one-line doc below it: that is the documentation. Hydra rejects unknown keys and
wrong types by name; `check_tokenizer_config` adds the checks a type cannot express (duplicate
special tokens, a domain without inputs, …) with a message that names the field and the fix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from tokenizer.errors import TokenizerConfigError


@dataclass
class DomainConfig:
    """One domain's SentencePiece model (trained on that domain's sample only)."""

    enabled: bool = True
    """false: build without this domain (tokenizer.domains.code.enabled=false drops a preset's code domain;
    its inputs are ignored and the other domains' sizes grow so their shares stay as configured)."""
    vocab_size: int = 8000
    """The domain's share of the merged vocabulary, in pieces (sizes summing to ~1.1-1.2 x total_vocab, as in
    llm-jp's ja 30k + en 20k + code 10k → 50k). Unigram: the domain model is trained merge.pool_factor times
    larger (its candidates), and the share weighs the domain in the merge by merge.share_weight; BPE: the
    merge keeps the same top fraction of every domain's pieces."""
    format: str = "auto"
    """Input format: auto (from the file name), jsonl, text, parquet or hf (a datasets.save_to_disk folder)."""
    text_field: str = "text"
    """The jsonl key / parquet column / dataset column holding the text."""
    text_unit: str = "paragraph"
    """What one document is in a plain-text file: line, paragraph (blank-line separated) or file."""
    character_coverage: float = 1.0
    """Share of characters the model must cover (the rest falls back to bytes): 0.9995 for Japanese, 1.0 otherwise."""
    max_piece_length: int = 16
    """Longest piece in characters (llm-jp: 8 for Japanese, 16 for English and code)."""
    split_digits: bool = True
    """Split numbers into single digits (helps arithmetic; standard for Llama-style vocabularies)."""
    allow_whitespace_only_pieces: bool = True
    """Allow pieces made only of space runs (the merge adds indentation runs itself: merge.indent_tabs/indent_spaces)."""
    byte_fallback: bool = True
    """Train with byte fallback (the merged model always has the 256 byte pieces)."""
    sample_bytes: Optional[int] = None
    """Override of sample.max_bytes for this domain (None: the global bound)."""
    presegment: str = "none"
    """Train this domain's model on words, so no piece spans two: none, fugashi (MeCab + UniDic short units;
    pip install fugashi unidic-lite) or sudachi (Sudachi mode C; pip install sudachipy sudachidict_core).
    Training only: encoding is plain SentencePiece. Costs Japanese compression: docs/tokenizer.md."""
    extra_options: Dict[str, Any] = field(default_factory=dict)
    """Further SentencePieceTrainer options for this domain only (e.g. {split_by_unicode_script: false})."""


@dataclass
class SpecialTokensConfig:
    """Special tokens, at fixed ids before every other piece."""

    unk: str = "<unk>"
    """Unknown piece (never produced with byte fallback, but SentencePiece needs one)."""
    bos: str = "<s>"
    """Beginning-of-sequence piece."""
    eos: str = "</s>"
    """End-of-sequence piece."""
    pad: str = "<pad>"
    """Padding piece."""
    unk_id: int = 0
    """Id of unk; unk/bos/eos/pad ids must be distinct and below 4 + len(user_defined)."""
    bos_id: int = 1
    """Id of bos."""
    eos_id: int = 2
    """Id of eos."""
    pad_id: int = 3
    """Id of pad."""
    user_defined: List[str] = field(default_factory=lambda: ["\n"])
    """Pieces always kept whole (newline, domain tags such as <ja>), at the ids after the four above."""


@dataclass
class SampleConfig:
    """The deterministic, memory-bounded sample each domain model is trained on."""

    max_bytes: int = 200_000_000
    """Upper bound of one domain's training sample in UTF-8 bytes (a uniform random sample of documents)."""
    max_sentences: int = 1_000_000
    """Upper bound of one domain's training lines. SentencePiece needs up to ~7 GB RAM per 1M lines."""
    read_limit_bytes: int = 0
    """Stop reading a domain after this many bytes of text (0: read everything the inputs hold)."""
    heldout_fraction: float = 0.02
    """Share of documents held out from training for evaluation."""
    heldout_max_bytes: int = 2_000_000
    """Upper bound of one domain's held-out text in bytes."""
    max_line_chars: int = 2000
    """Longer lines are cut into pieces of this size for training (SentencePiece skips lines over 4192 bytes)."""
    seed: int = 1234
    """Seed of the sampling; the same inputs and seed give the same sample."""


@dataclass
class MergeConfig:
    """How the domain models become one."""

    pool_factor: float = 1.5
    """Unigram: each domain model is trained with this many times the learned pieces the merge can give it (its
    share, or its part of the mixture's characters if larger; capped at what its sample supports), so the
    merge picks from more candidates than the vocabulary keeps."""
    pool_options: Dict[str, Any] = field(default_factory=lambda: {"shrinking_factor": 0.5, "num_sub_iterations": 1})
    """Unigram: SentencePieceTrainer options of the domain (candidate) models, under each domain's extra_options.
    The merge re-estimates and prunes the pool on the mixture, so a coarser schedule than SentencePiece's
    (0.75, 2) costs no compression and about half the training time (docs/tokenizer.md); {} for its defaults."""
    share_weight: float = 0.0
    """Unigram: how much the configured domain sizes, rather than the sample's character proportions, weight
    each domain's compression in the merge's EM (0: as one joint model would, every domain within 1% of it;
    raise it to favour the domains with the larger shares at the others' cost: docs/tokenizer.md)."""
    em_iterations: int = 2
    """Viterbi-EM passes per pruning round of the unigram merge (at least 1 is always run)."""
    em_sample_bytes: int = 20_000_000
    """Bytes of the domains' training lines the EM encodes (a deterministic prefix of each, in sample proportions)."""
    shrink: float = 0.75
    """Unigram: each pruning round keeps at least this fraction of the pieces (SentencePiece's shrinking_factor)."""
    smoothing: float = 0.5
    """Add-k count smoothing in the re-estimation, so that a piece unused in the sample keeps a finite score."""
    indent_tabs: int = 4
    """Keep pieces for runs of 1..indent_tabs tabs, so tab indentation after a newline costs one token (0: none)."""
    indent_spaces: int = 16
    """Keep pieces for runs of 2..indent_spaces spaces, so space indentation after a newline costs one token (0/1: none)."""
    score_quantum: float = 0.125
    """Round unigram scores to multiples of this power of two so SentencePiece's float32 and HF's float64 path sums are exact alike (identical ids); 0 = off."""


@dataclass
class EvalConfig:
    """What `build` evaluates on the held-out text."""

    baseline: bool = True
    """Also train the joint baseline (one model on the concatenated samples, same total vocab and options)."""
    compare: Dict[str, str] = field(default_factory=dict)
    """Other tokenizers to measure, name → path of a SentencePiece .model or an HF tokenizer folder/tokenizer.json."""


@dataclass
class TokenizerConfig:
    """A merged tokenizer: domains, sizes, specials, normalisation and the build steps' settings."""

    name: str = "tokenizer"
    """Name of the tokenizer (the output folder's name)."""
    model_type: str = "unigram"
    """unigram (default; scores re-estimated after the merge) or bpe."""
    total_vocab: int = 32000
    """Exact size of the merged vocabulary, specials and the 256 byte pieces included."""
    pad_to_multiple_of: int = 0
    """If > 0, grow the vocabulary with further real pieces up to a multiple of this (64/128 suit GPUs)."""
    inputs: Dict[str, Any] = field(default_factory=dict)
    """Domain → input path or glob, or a list of them (jsonl, txt, parquet, datasets folders; .gz/.zst allowed)."""
    domains: Dict[str, DomainConfig] = field(default_factory=dict)
    """Domain → its model's options; every domain needs an entry in inputs."""
    specials: SpecialTokensConfig = field(default_factory=SpecialTokensConfig)
    """Special tokens and their ids."""
    normalization_rule_name: str = "identity"
    """SentencePiece normaliser for every domain and the merged model (identity keeps exact round-trip; nmt_nfkc folds width)."""
    add_dummy_prefix: bool = True
    """Prefix the text with '▁' so a text-initial word gets the same piece as inside the text."""
    remove_extra_whitespaces: bool = False
    """Collapse whitespace runs (off: indentation and spacing survive the round-trip)."""
    sample: SampleConfig = field(default_factory=SampleConfig)
    """Sampling of the training and held-out text."""
    merge: MergeConfig = field(default_factory=MergeConfig)
    """Merge settings."""
    evaluate: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation settings."""
    num_threads: int = 2
    """Threads for SentencePiece training and encoding."""
    strict: bool = False
    """Stop at the first malformed record instead of skipping and counting it."""


@dataclass
class TokenizerBuildConfig:
    """`ayumi tokenizer build|sweep|export`: the tokenizer and where it goes."""

    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer to build."""
    output_dir: str = "${oc.env:AYUMI_DATA_ROOT,.cache}/tokenizers/${tokenizer.name}"
    """Folder the tokenizer is written to (atomically: it appears complete or not at all)."""
    overwrite: bool = False
    """Replace an existing tokenizer folder at output_dir."""
    keep_work: bool = False
    """Keep the samples and intermediate models in <output_dir>.work for inspection."""


def register_configs() -> None:
    """Make the schemas known to Hydra (conf/tokenizer_build.yaml and conf/tokenizer/*.yaml use them)."""
    store = ConfigStore.instance()
    store.store(name="tokenizer_build_schema", node=TokenizerBuildConfig)
    store.store(group="tokenizer", name="tokenizer_schema", node=TokenizerConfig)


# ----------------------------------------------------------------------------------------------
# Checks a type cannot express
# ----------------------------------------------------------------------------------------------

MODEL_TYPES = ("unigram", "bpe")
PRESEGMENT_CHOICES = ("none", "fugashi", "sudachi")
BYTE_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")
NUM_BYTE_PIECES = 256


def special_pieces(specials: SpecialTokensConfig) -> list[str]:
    """The special pieces in id order (unk/bos/eos/pad at their ids, user-defined after them)."""
    ids = {specials.unk_id: specials.unk, specials.bos_id: specials.bos,
           specials.eos_id: specials.eos, specials.pad_id: specials.pad}
    return [ids[i] for i in range(4)] + list(specials.user_defined)


def fixed_pieces(specials: SpecialTokensConfig) -> int:
    """Pieces every model holds besides its learned ones: the specials and the 256 byte pieces."""
    return NUM_BYTE_PIECES + len(special_pieces(specials))


def check_specials(specials: SpecialTokensConfig) -> None:
    """Distinct, non-empty pieces at distinct ids 0..3; user-defined pieces that are not byte pieces."""
    ids = {"unk_id": specials.unk_id, "bos_id": specials.bos_id, "eos_id": specials.eos_id, "pad_id": specials.pad_id}
    if sorted(ids.values()) != [0, 1, 2, 3]:
        raise TokenizerConfigError(
            f"tokenizer.specials ids {ids} must be 0, 1, 2 and 3 in some order (user-defined pieces follow). "
            "Fix: give each of unk/bos/eos/pad a different id below 4."
        )
    seen: dict[str, str] = {}
    names = ["unk", "bos", "eos", "pad"] + [f"user_defined[{i}]" for i in range(len(specials.user_defined))]
    pieces = [specials.unk, specials.bos, specials.eos, specials.pad] + list(specials.user_defined)
    for name, piece in zip(names, pieces):
        if not isinstance(piece, str) or piece == "":
            raise TokenizerConfigError(f"tokenizer.specials.{name} is empty. Fix: give it a non-empty string.")
        if BYTE_PIECE.match(piece):
            raise TokenizerConfigError(
                f"tokenizer.specials.{name}={piece!r} collides with the byte piece of the same name. Fix: rename it."
            )
        if piece in seen:
            raise TokenizerConfigError(
                f"tokenizer.specials.{name}={piece!r} duplicates specials.{seen[piece]}. Fix: make every special token distinct."
            )
        seen[piece] = name


def check_tokenizer_config(cfg: TokenizerConfig, inputs_required: bool = True) -> None:
    """Cross-checks of a composed TokenizerConfig; raises TokenizerConfigError naming the key and the fix.
    `inputs_required=False` (for `--cfg job`) checks every value but lets a domain's inputs be unset yet."""
    if cfg.model_type not in MODEL_TYPES:
        raise TokenizerConfigError(f"tokenizer.model_type={cfg.model_type!r}: use one of {', '.join(MODEL_TYPES)}.")
    check_specials(cfg.specials)
    if not cfg.domains:
        raise TokenizerConfigError("tokenizer.domains is empty. Fix: pick a preset (tokenizer=tiny) or add domains.")
    for domain, dcfg in cfg.domains.items():
        check_domain(cfg, domain, dcfg, inputs_required)
    removed = sorted(d for d in set(cfg.inputs) - set(cfg.domains) if not domain_patterns(cfg, d))
    if removed:
        raise TokenizerConfigError(
            f"tokenizer.domains.{removed[0]} is gone but tokenizer.inputs.{removed[0]} is still listed (by the preset). "
            f"Fix: drop a preset's domain with tokenizer.domains.{removed[0]}.enabled=false instead."
        )
    extra = sorted(set(cfg.inputs) - set(cfg.domains))
    if extra:
        raise TokenizerConfigError(
            f"tokenizer.inputs has {extra} but tokenizer.domains does not. Fix: add tokenizer.domains.{extra[0]} "
            f"(e.g. +tokenizer.domains.{extra[0]}.vocab_size=8000) or drop the input."
        )
    fixed = len(special_pieces(cfg.specials)) + NUM_BYTE_PIECES
    if cfg.total_vocab <= fixed:
        raise TokenizerConfigError(
            f"tokenizer.total_vocab={cfg.total_vocab} leaves no room for learned pieces after {fixed} specials and byte "
            "pieces. Fix: raise total_vocab."
        )
    if cfg.pad_to_multiple_of < 0:
        raise TokenizerConfigError(f"tokenizer.pad_to_multiple_of={cfg.pad_to_multiple_of} must be ≥ 0.")
    if not 0.0 <= cfg.sample.heldout_fraction < 1.0:
        raise TokenizerConfigError(f"tokenizer.sample.heldout_fraction={cfg.sample.heldout_fraction} must be in [0, 1).")
    for name in ("indent_tabs", "indent_spaces"):
        value = getattr(cfg.merge, name)
        if not 0 <= value <= 64:
            raise TokenizerConfigError(f"tokenizer.merge.{name}={value}: use 0 (no such pieces) to 64.")
    check_merge(cfg.merge)
    if cfg.num_threads < 1:
        raise TokenizerConfigError(f"tokenizer.num_threads={cfg.num_threads} must be ≥ 1.")


def check_merge(m: MergeConfig) -> None:
    """The merge's numeric knobs are in range (each message names the key and a sensible value)."""
    if m.pool_factor < 1.0:
        raise TokenizerConfigError(f"tokenizer.merge.pool_factor={m.pool_factor} must be ≥ 1 (2.0: twice the pieces to choose from).")
    if not 0.0 <= m.share_weight <= 1.0:
        raise TokenizerConfigError(f"tokenizer.merge.share_weight={m.share_weight} must be in [0, 1] (0: joint-like, 1: shares only).")
    if not 0.0 < m.shrink < 1.0:
        raise TokenizerConfigError(f"tokenizer.merge.shrink={m.shrink} must be in (0, 1) (0.75 as SentencePiece).")
    if m.em_iterations < 0 or m.em_sample_bytes <= 0:
        raise TokenizerConfigError(
            f"tokenizer.merge.em_iterations={m.em_iterations} / em_sample_bytes={m.em_sample_bytes}: use ≥ 0 passes "
            "and a positive byte budget.")


def enabled_domains(cfg: TokenizerConfig) -> TokenizerConfig:
    """cfg without its disabled domains (and their inputs), the others' vocab sizes renormalised.

    A domain's vocab size sets its share of the merged vocabulary (merge.py). Dropping a domain scales
    every remaining domain's *learned* pieces (its size less the byte pieces and specials every model
    holds) by the same factor, so the learned pieces add up to what they did with every domain: the
    remaining shares keep their configured ratios and still cover total_vocab with the usual overlap.
    A config with every domain enabled comes back unchanged (the function is idempotent)."""
    dropped = [d for d, dcfg in cfg.domains.items() if not dcfg.enabled]
    if not dropped:
        return cfg
    kept = {d: dcfg for d, dcfg in cfg.domains.items() if dcfg.enabled}
    if not kept:
        raise TokenizerConfigError(
            f"every domain of tokenizer.domains is disabled ({', '.join(dropped)}). Fix: keep at least one "
            "(tokenizer.domains.<name>.enabled=true).")
    fixed = fixed_pieces(cfg.specials)
    learned = {d: max(0, dcfg.vocab_size - fixed) for d, dcfg in cfg.domains.items()}
    factor = sum(learned.values()) / max(1, sum(learned[d] for d in kept))
    domains = {d: replace(dcfg, vocab_size=fixed + round(learned[d] * factor)) for d, dcfg in kept.items()}
    inputs = {d: v for d, v in cfg.inputs.items() if d not in dropped}
    return replace(cfg, domains=domains, inputs=inputs)


def check_domain(cfg: TokenizerConfig, domain: str, dcfg: DomainConfig, inputs_required: bool = True) -> None:
    if not re.fullmatch(r"[A-Za-z0-9_\-]+", domain):
        raise TokenizerConfigError(f"tokenizer.domains.{domain}: use letters, digits, '_' or '-' in domain names.")
    patterns = domain_patterns(cfg, domain)
    if not patterns and inputs_required:
        raise TokenizerConfigError(
            f"domain {domain!r} has no inputs. Fix: set tokenizer.inputs.{domain}=/path/to/{domain}/*.jsonl "
            f"or build without it: tokenizer.domains.{domain}.enabled=false."
        )
    if not 0.9 <= dcfg.character_coverage <= 1.0:
        raise TokenizerConfigError(
            f"tokenizer.domains.{domain}.character_coverage={dcfg.character_coverage}: use a value in [0.9, 1] "
            "(0.9995 for Japanese/Chinese, 1.0 otherwise)."
        )
    if dcfg.vocab_size < 16:
        raise TokenizerConfigError(f"tokenizer.domains.{domain}.vocab_size={dcfg.vocab_size} is too small.")
    if dcfg.max_piece_length < 1:
        raise TokenizerConfigError(f"tokenizer.domains.{domain}.max_piece_length must be ≥ 1.")
    check_presegment(cfg, domain, dcfg)


def check_presegment(cfg: TokenizerConfig, domain: str, dcfg: DomainConfig) -> None:
    """A known analyzer that loads here, checked before any text is read (a missing one names its pip install)."""
    field_name = f"tokenizer.domains.{domain}.presegment"
    if dcfg.presegment not in PRESEGMENT_CHOICES:
        raise TokenizerConfigError(f"{field_name}={dcfg.presegment!r}: use one of {', '.join(PRESEGMENT_CHOICES)}.")
    if dcfg.presegment != "none":
        if cfg.remove_extra_whitespaces:
            # Words are trained one per line, and that normaliser would strip the space each word starts with.
            raise TokenizerConfigError(
                f"{field_name}={dcfg.presegment} needs tokenizer.remove_extra_whitespaces=false (the default).")
        from tokenizer.presegment import load_analyzer

        load_analyzer(dcfg.presegment, field_name)


def domain_patterns(cfg: TokenizerConfig, domain: str) -> list[str]:
    """The input patterns of a domain as a list (a string may hold several, comma-separated)."""
    value = cfg.inputs.get(domain)
    if value is None:
        return []
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    return [str(p) for p in value if str(p).strip()]
