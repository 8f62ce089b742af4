"""The curriculum's own domains (existing Megatron data named in the curriculum file), registered into data.root.

Why at plan and training start, not as a separate `ayumi data prepare` step: declaring data in the
curriculum exists so that the curriculum file is all a user writes, and the plan cannot check
budgets and repetition before it has counted each domain's tokens, which come from the checked
record. So whatever plans a run calls `register_curriculum_domains` first: `ayumi plan`, `ayumi
train` before any rank starts, `ayumi doctor` (all through `curriculum.plan.plan_from_config` or
the launcher), and every training job before it reads the manifest (rank 0 only; the others wait).
The work is data/register.py's: the checks and records of `ayumi data prepare`'s own Megatron
registration, atomic writes, and nothing read again or written when the root is up to date, so
the repeated calls cost a few `stat`s. `data` never imports `curriculum`; this is the curriculum's
side of that arrow.
"""
from __future__ import annotations

from typing import Any

from curriculum.config import DECLARED, declared_domains
from data.megatron import MegatronDataError


def register_curriculum_domains(cfg: Any) -> dict | None:
    """Register the domains `cfg.curriculum.domains` declares into `cfg.data.root`; the manifest, or None when
    it declares none. `cfg` is a training config read by attribute (curriculum, data.root, data.tokenizer_dir).

    Raises CurriculumError for a misdeclared domain, the data errors of data/register.py otherwise.
    """
    curriculum = getattr(cfg, "curriculum", None)
    if curriculum is None or not curriculum.domains:
        return None
    domains = declared_domains(curriculum)
    if not cfg.data.tokenizer_dir:
        raise MegatronDataError(tokenizer_missing(list(domains)))
    from data.register import register_declared_domains  # reads and writes the data root: only when declared

    return register_declared_domains(cfg.data.root, domains, cfg.data.tokenizer_dir, curriculum.name)


def tokenizer_missing(names: list[str]) -> str:
    """The refusal of declared Megatron data without data.tokenizer_dir (also checked with the config, pretrain/config.py)."""
    return (f"{DECLARED} declares Megatron data ({', '.join(names)}), whose ids are checked against the tokenizer "
            "it was made with, but data.tokenizer_dir is not set. Fix: data.tokenizer_dir=DIR (an ayumi tokenizer "
            "folder, a SentencePiece .model or a Hugging Face tokenizer folder)")
