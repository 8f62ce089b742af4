"""Optimizer parameter groups and learning-rate schedules as pure functions of the step.

The schedule is not a stateful scheduler object: the trainer sets the LR from `lr_at(step)`
before every optimizer step, so resuming needs only the step counter and can never drift.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from pretrain.config import OptimConfig
from pretrain.model.llama import no_weight_decay


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warmup: step 0 -> 1/warmup, reaching 1 at step warmup-1 (never an LR of exactly 0)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def decay_progress(step: int, start: int, end: int) -> float:
    """How far `step` is through [start, end], clamped to [0, 1]."""
    if end <= start:
        return 1.0
    return min(1.0, max(0.0, (step - start) / (end - start)))


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based) in a run of `total_steps` steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * warmup_factor(step, cfg.warmup_steps)
    last = max(total_steps - 1, cfg.warmup_steps)
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        progress = decay_progress(step, cfg.warmup_steps, last)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        progress = decay_progress(step, cfg.warmup_steps, last)
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    if cfg.schedule == "wsd":
        decay_steps = max(1, round(cfg.wsd_decay_fraction * total_steps))
        decay_start = max(cfg.warmup_steps, last - decay_steps)
        progress = decay_progress(step, decay_start, last)
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    raise ValueError(f"optim.schedule: unknown schedule {cfg.schedule!r} (cosine, linear, constant, wsd)")


def param_groups(named_parameters: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices and undecayed norms/biases (named for telemetry)."""
    decay, no_decay = [], []
    for name, param in named_parameters:
        if not param.requires_grad:
            continue
        (no_decay if no_weight_decay(name, param) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "name": "no_decay"})
    return groups


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
