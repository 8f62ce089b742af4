"""SentencePiece training of one model: a domain's, or the joint baseline on all samples.

`trainer_options` is the single place the config becomes SentencePieceTrainer arguments; the
benchmark reuses it to train the same models with bare sentencepiece.
"""
from __future__ import annotations

import re
from pathlib import Path

from tokenizer.config import DomainConfig, TokenizerConfig


class VocabTooLargeError(ValueError):
    """The requested vocabulary does not fit the sample (too large for it, or too small for its characters)."""


def trainer_options(cfg: TokenizerConfig, dcfg: DomainConfig, vocab_size: int, candidates: bool = False) -> dict:
    """SentencePieceTrainer keyword arguments for a model with dcfg's options and cfg's shared settings;
    `candidates`: a domain model the merge picks from (a soft size limit; unigram: merge.pool_options)."""
    s = cfg.specials
    options = dict(
        model_type=cfg.model_type,
        vocab_size=vocab_size,
        character_coverage=dcfg.character_coverage,
        max_sentencepiece_length=dcfg.max_piece_length,
        split_digits=dcfg.split_digits,
        allow_whitespace_only_pieces=dcfg.allow_whitespace_only_pieces,
        byte_fallback=dcfg.byte_fallback,
        normalization_rule_name=cfg.normalization_rule_name,
        add_dummy_prefix=cfg.add_dummy_prefix,
        remove_extra_whitespaces=cfg.remove_extra_whitespaces,
        unk_id=s.unk_id, bos_id=s.bos_id, eos_id=s.eos_id, pad_id=s.pad_id,
        unk_piece=s.unk, bos_piece=s.bos, eos_piece=s.eos, pad_piece=s.pad,
        user_defined_symbols=list(s.user_defined),
        num_threads=cfg.num_threads,
        # The sample is already bounded and shuffled by tokenizer.sample; let SentencePiece use all of it.
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=1 << 14,
        train_extremely_large_corpus=False,
        minloglevel=2,
    )
    if candidates:
        # A pool is "up to this many pieces": a sample that supports fewer gives what it has in one training
        # (with the hard limit SentencePiece fails only at the very end, and the retry doubled the time).
        options["hard_vocab_limit"] = False
        if cfg.model_type == "unigram":
            options.update(cfg.merge.pool_options)
    options.update(dcfg.extra_options)
    return options


def domain_training(cfg: TokenizerConfig, dcfg: DomainConfig, sample, vocab_size: int | None = None,
                    candidates: bool = False) -> tuple[list[Path], dict]:
    """The input files and trainer options of a domain's model (vocab_size: default its share) from its
    DomainSample: the training lines, or with presegment the word counts of that analyzer's segmentation
    (tokenizer/presegment.py)."""
    options = trainer_options(cfg, dcfg, vocab_size or dcfg.vocab_size, candidates)
    if dcfg.presegment == "none":
        return [sample.train_path], options
    from tokenizer.sample import presegment_sample, word_counts_path

    presegment_sample(sample, dcfg.presegment, cfg.add_dummy_prefix)
    # Every word is a line of its own: the list carries the line-initial space, so no dummy prefix per word.
    options.update(input_format="tsv", add_dummy_prefix=False)
    return [word_counts_path(sample, dcfg.presegment, cfg.add_dummy_prefix)], options


def train_domain_model(cfg: TokenizerConfig, dcfg: DomainConfig, sample, model_prefix: Path, label: str,
                       vocab_size: int | None = None, candidates: bool = False) -> Path:
    """Train a domain's model on its sample; a presegmented one gets back the normaliser the config asks for
    (trained without the dummy prefix, it encodes running text with it)."""
    inputs, options = domain_training(cfg, dcfg, sample, vocab_size, candidates)
    model = train_model(inputs, model_prefix, options, label)
    if dcfg.presegment != "none":
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        proto.ParseFromString(model.read_bytes())
        proto.normalizer_spec.add_dummy_prefix = cfg.add_dummy_prefix
        proto.trainer_spec.input_format = "text"
        model.write_bytes(proto.SerializeToString())
    return model


def too_large(label: str, asked: int, limit: int) -> VocabTooLargeError:
    """The error for a model asked for more pieces than its sample supports."""
    return VocabTooLargeError(
        f"{label}: vocab_size {asked} is more than its sample supports (at most {limit}). "
        f"Fix: lower the vocab size to ≤ {limit}, or give the domain more text "
        "(tokenizer.sample.max_bytes / more inputs).")


def baseline_domain_options(cfg: TokenizerConfig) -> DomainConfig:
    """Options of the joint baseline: what every domain can live with (lowest coverage, longest pieces)."""
    domains = list(cfg.domains.values())
    return DomainConfig(
        vocab_size=cfg.total_vocab,
        character_coverage=min(d.character_coverage for d in domains),
        max_piece_length=max(d.max_piece_length for d in domains),
        split_digits=any(d.split_digits for d in domains),
        allow_whitespace_only_pieces=any(d.allow_whitespace_only_pieces for d in domains),
        byte_fallback=True,
    )


def train_model(inputs: list[Path], model_prefix: Path, options: dict, label: str) -> Path:
    """Train one model; returns the .model path. VocabTooLargeError names `label` and the size the data allows."""
    import sentencepiece as spm

    model_prefix.parent.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(input=[str(p) for p in inputs], model_prefix=str(model_prefix), **options)
    except RuntimeError as err:
        match = re.search(r"Vocabulary size (?:is )?too high \((\d+)\)\. Please set it to a value <= (\d+)", str(err))
        if match:
            raise too_large(label, int(match.group(1)), int(match.group(2))) from None
        match = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", str(err))
        if match:
            raise VocabTooLargeError(
                f"{label}: vocab_size {match.group(1)} is below the {match.group(2)} pieces its characters and the "
                f"specials/byte pieces need. Fix: raise the vocab size above {match.group(2)}, or lower its "
                "character_coverage (e.g. 0.9995) so rare characters fall back to bytes."
            ) from None
        raise RuntimeError(f"{label}: SentencePiece training failed: {err}") from err
    return model_prefix.with_suffix(".model")
