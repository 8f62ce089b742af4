"""The curriculum's configuration: ordered stages, each a token budget and a domain mixture.

`conf/curriculum/<name>.yaml` files fill `CurriculumConfig` (the `curriculum` group of the training
config). A curriculum with no stages means "no curriculum": every domain in one shuffled stream
(`data.packed.ShuffledDomains`), as `conf/curriculum/none.yaml` selects.

A curriculum may also bring its own domains (`domains:`): existing Megatron `.bin/.idx` prefixes
named in the curriculum file, in the same forms as a `megatron:` domain of conf/data. They are
registered into the data root when a run is planned or started (curriculum/declared.py); the stages
weight them like any prepared domain.

Configs hold values; `config_problems` / `validate` hold the checks that need no data (weights,
budgets vs `train.tokens`, the declared domains' fields, domain names against the prepared data
when those are known).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from data.config import ConfigError as DataConfigError
from data.config import DomainConfig, check_domain_config, check_domain_name, domain_config

DECLARED = "curriculum.domains"
"""Where a curriculum's own domains live in the training config (named in every message about them)."""


class CurriculumError(ValueError):
    """A curriculum setting is invalid or cannot be honoured; the message names the stage, field and fix."""


@dataclass
class LRPolicy:
    """A per-stage adjustment of the run's LR schedule (pure; see `curriculum.schedule.stage_lr`)."""

    scale: float = 1.0
    """Multiply the scheduled LR by this during the stage."""
    rewarmup_steps: int = 0
    """Ramp the LR linearly from ~0 back to the scheduled value over the stage's first N steps (0 = off)."""
    decay_to_min: bool = False
    """Anneal linearly from the scheduled LR to optim.min_lr over the stage (a final-stage anneal)."""


@dataclass
class Stage:
    """One stage: a token budget and the domain mixture it is trained on."""

    name: str = "stage"
    """Stage name, shown in the plan, the events and `curriculum/stage` panels."""
    tokens: int = 0
    """Tokens trained in this stage; the stages' budgets must add up to train.tokens."""
    weights: dict[str, float] = field(default_factory=dict)
    """Domain -> relative weight (normalised over the stage; 0 leaves a domain out of this stage)."""
    max_repetition: dict[str, float] = field(default_factory=dict)
    """Domain -> most epochs of it the run may have consumed by the end of this stage (default: the curriculum's)."""
    lr: LRPolicy = field(default_factory=LRPolicy)
    """LR adjustment during this stage (re-warmup, scale, final anneal)."""
    seq_len: int = 0
    """Tokens per sample in this stage, for a short-to-long schedule; 0 = train.seq_len. A multiple of
    train.seq_len (the shortest length of the run), with train.micro_batch_size a multiple of the ratio: the
    stage's micro batch holds micro_batch_size x train.seq_len / seq_len samples, so the tokens per micro
    batch, the grad accumulation and the tokens per step stay as they are. A stage whose length differs from
    the one before begins on a step boundary (its budget is rounded up to whole steps)."""
    min_document_tokens: dict[str, int] = field(default_factory=dict)
    """Domain -> read only that domain's documents of at least this many tokens (their end-of-document
    token included) in this stage, e.g. the long documents for a long-context stage. Such a domain is a
    stream of its own (its own order and epochs), as is a domain at another seq_len."""
    rope_theta: float = 0.0
    """RoPE base during this stage and after, for a context extension (0 = the model's, model.rope_theta). A
    stage that sets it (or rope_scaling) begins on a step boundary, so each step trains with one RoPE."""
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    """RoPE scaling during this stage and after, as model.rope_scaling's fields (e.g. {type: yarn, factor: 4,
    original_max_seq_len: 8192}); empty = the model's."""


@dataclass
class CurriculumConfig:
    """Ordered stages switched in-process at exact token boundaries (empty = no curriculum)."""

    name: str = "none"
    """Curriculum name (the YAML file's), recorded in the mixer state."""
    stages: list[Stage] = field(default_factory=list)
    """The stages in training order; empty means all domains in one shuffled stream."""
    default_max_repetition: float = 4.0
    """Epochs of any domain allowed by a stage's end unless the stage's max_repetition names it; without
    stages, the epochs every domain may be read in the shuffled run (raise it only on purpose)."""
    domains: dict[str, Any] = field(default_factory=dict)
    """This curriculum's own domains, by name: existing Megatron data, each with `megatron` (prefixes as in
    Megatron's --data-path: `"PREFIX ..."`, `"0.7 PREFIX 0.3 PREFIX"`, or a folder) and optionally
    `megatron_val` and `append_eod` (the fields of data/config.py's DomainConfig). Checked against
    data.tokenizer_dir (the tokenizer they were made with) and registered into data.root when `ayumi plan` or
    `ayumi train` starts, never copied; stages weight them like prepared domains."""


def enabled(cfg: CurriculumConfig | None) -> bool:
    """Whether a run uses the staged mixer (False: ShuffledDomains over every domain)."""
    return cfg is not None and len(cfg.stages) > 0


def max_repetition(cfg: CurriculumConfig, stage: Stage, domain: str) -> float:
    return float(stage.max_repetition.get(domain, cfg.default_max_repetition))


def domains_used(cfg: CurriculumConfig) -> list[str]:
    """Domains with a positive weight in some stage, in order of first appearance (a stable order)."""
    names: list[str] = []
    for stage in cfg.stages:
        for name, weight in stage.weights.items():
            if weight > 0 and name not in names:
                names.append(name)
    return names


def declared_domains(cfg: CurriculumConfig) -> dict[str, DomainConfig]:
    """The curriculum's own domains as checked DomainConfigs; CurriculumError listing every problem."""
    domains, problems = _declared(cfg)
    if problems:
        raise CurriculumError(f"curriculum {cfg.name!r} is invalid:\n  " + "\n  ".join(problems))
    return domains


def _declared(cfg: CurriculumConfig) -> tuple[dict[str, DomainConfig], list[str]]:
    """(the domains that passed, one problem per domain that did not), by data/config.py's checks."""
    domains: dict[str, DomainConfig] = {}
    problems: list[str] = []
    for name, node in (cfg.domains or {}).items():
        name, key = str(name), f"{DECLARED}.{name}"
        try:
            check_domain_name(name, DECLARED)
            domain = domain_config(name, node, DECLARED)
            if domain.inputs:
                raise DataConfigError(f"{key}.inputs: a curriculum declares existing Megatron data only. Fix: prepare "
                                      "corpus files from conf/data (`ayumi data prepare`) and weight that domain here")
            if not domain.megatron:
                raise DataConfigError(
                    f"{key}.megatron is not set: a curriculum declares existing Megatron data only. Fix: "
                    f"{key}.megatron='0.7 /data/a_text_document 0.3 /data/b_text_document' (Megatron's --data-path "
                    "form, or a folder of prefixes)")
            check_domain_config(name, domain, DECLARED)
        except DataConfigError as err:
            problems.append(str(err))
            continue
        domains[name] = domain
    return domains, problems


def config_problems(cfg: CurriculumConfig, train_tokens: int | None = None,
                    known_domains: Iterable[str] | None = None) -> list[str]:
    """Every problem of a curriculum that can be seen without reading data, each a full sentence."""
    problems: list[str] = _declared(cfg)[1]
    if cfg.default_max_repetition <= 0:
        problems.append(f"curriculum.default_max_repetition={cfg.default_max_repetition} must be > 0")
    seen_names: set[str] = set()
    for index, stage in enumerate(cfg.stages):
        where = f"curriculum.stages[{index}] ({stage.name!r})"
        if stage.name in seen_names:
            problems.append(f"{where}: duplicate stage name; give every stage its own name")
        seen_names.add(stage.name)
        if stage.tokens <= 0:
            problems.append(f"{where}.tokens={stage.tokens}: a stage needs a positive token budget")
        negative = {d: w for d, w in stage.weights.items() if w < 0}
        if negative:
            problems.append(f"{where}.weights: negative weight(s) {negative}; weights must be >= 0")
        elif sum(stage.weights.values()) <= 0:
            problems.append(f"{where}.weights: all weights are zero (or none given); give at least one domain a positive weight")
        for domain, limit in stage.max_repetition.items():
            if limit <= 0:
                problems.append(f"{where}.max_repetition.{domain}={limit} must be > 0")
        if stage.lr.scale <= 0 or stage.lr.rewarmup_steps < 0:
            problems.append(f"{where}.lr: scale must be > 0 and rewarmup_steps >= 0 (got {stage.lr})")
        if stage.seq_len < 0:
            problems.append(f"{where}.seq_len={stage.seq_len} must be >= 0 (0 = train.seq_len)")
        if stage.rope_theta < 0:
            problems.append(f"{where}.rope_theta={stage.rope_theta} must be >= 0 (0 = model.rope_theta)")
        for domain, tokens in stage.min_document_tokens.items():
            if int(tokens) < 1:
                problems.append(f"{where}.min_document_tokens.{domain}={tokens} must be >= 1 (or leave the domain out)")
            elif stage.weights.get(domain, 0) <= 0:
                problems.append(f"{where}.min_document_tokens.{domain}: the stage does not read {domain} (give it a "
                                "weight or drop the filter)")
    if known_domains is not None:
        known = list(known_domains)
        for index, stage in enumerate(cfg.stages):
            unknown = sorted(set(stage.weights) - set(known))
            if unknown:
                problems.append(
                    f"curriculum.stages[{index}] ({stage.name!r}).weights: unknown domain(s) {', '.join(unknown)}; "
                    f"the prepared data has {', '.join(known) or 'no domains'} (fix the name, run `ayumi data prepare` for it, "
                    f"or declare its Megatron data under {DECLARED})"
                )
    if train_tokens is not None and cfg.stages:
        total = sum(stage.tokens for stage in cfg.stages)
        if total != train_tokens:
            budgets = " + ".join(f"{stage.tokens:,}" for stage in cfg.stages)
            problems.append(
                f"stage budgets add up to {total:,} tokens ({budgets}) but train.tokens={train_tokens:,}; "
                "make them equal (change a stage's tokens or train.tokens)"
            )
    return problems


def validate(cfg: CurriculumConfig, train_tokens: int | None = None,
             known_domains: Iterable[str] | None = None) -> None:
    """Raise CurriculumError listing every problem `config_problems` finds."""
    problems = config_problems(cfg, train_tokens, known_domains)
    if problems:
        raise CurriculumError(f"curriculum {cfg.name!r} is invalid:\n  " + "\n  ".join(problems))
