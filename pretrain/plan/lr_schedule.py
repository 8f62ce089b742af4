"""The learning-rate schedule: a pure function of the step, the optim config and the run's length history.

No scheduler object holds state: the trainer sets the LR from `scheduled_lr(step, ...)` before every optimizer step,
so a resume needs only the step counter and the run's `LengthHistory` (kept in every checkpoint).

A run's length can change on resume (`train.tokens` raised, with `resume.accept=[train.tokens]`). The LR never jumps
at that step:

- where the new length leaves every trained step's LR as it was (warmup not finished; WSD's stable phase not
  ended; a constant schedule), the run simply follows the longer schedule: WSD's stable phase lengthens;
- otherwise (cosine or linear decay under way, WSD's decay begun) the steps already trained keep their LR, and
  only what is ahead is stretched: the rest of the old decay is drawn over the new remaining steps, so the
  resume step's LR is the one the old schedule gave it and the decay still ends at optim.min_lr;
- a run whose schedule had already ended (its LR at min_lr) goes on at that final LR: raising it again is a new
  run's decision (checkpoint.load_from).

Torch-free: `ayumi plan` and the checks before launch compute the same LR as the ranks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def warmup_factor(step: float, warmup_steps: int) -> float:
    """Linear warmup: step 0 -> 1/warmup, reaching 1 at step warmup-1 (never an LR of exactly 0)."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def decay_progress(step: float, start: float, end: float) -> float:
    """How far `step` is through [start, end], clamped to [0, 1]."""
    if end <= start:
        return 1.0
    return min(1.0, max(0.0, (step - start) / (end - start)))


def last_step(cfg: Any, total_steps: int) -> int:
    """The step at which a schedule of `total_steps` steps reaches its end (min_lr), never inside warmup."""
    return max(total_steps - 1, cfg.warmup_steps)


def wsd_decay_start(cfg: Any, total_steps: int) -> int:
    """The first step of WSD's final decay in a run of `total_steps` steps."""
    decay_steps = max(1, round(cfg.wsd_decay_fraction * total_steps))
    return max(cfg.warmup_steps, last_step(cfg, total_steps) - decay_steps)


def lr_at(step: float, cfg: Any, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based) in a run of `total_steps` steps (`cfg`: optim)."""
    if step < cfg.warmup_steps:
        return cfg.lr * warmup_factor(step, cfg.warmup_steps)
    last = last_step(cfg, total_steps)
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        progress = decay_progress(step, cfg.warmup_steps, last)
        return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        progress = decay_progress(step, cfg.warmup_steps, last)
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    if cfg.schedule == "wsd":
        progress = decay_progress(step, wsd_decay_start(cfg, total_steps), last)
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    raise ValueError(f"optim.schedule: unknown schedule {cfg.schedule!r} (cosine, linear, constant, wsd)")


@dataclass(frozen=True)
class Length:
    """From step `from_step` on, the run is `total_steps` long; `stretched`: the old schedule's rest is drawn over the
    new remaining steps (else the schedule of `total_steps` steps is followed as it is)."""

    from_step: int
    total_steps: int
    stretched: bool = False


LengthHistory = tuple[Length, ...]
"""The run's lengths, oldest first; the first begins at step 0. Recorded in each checkpoint (ayumi.json: lengths)."""


def history_from_record(record: list | None, total_steps: int) -> LengthHistory:
    """The LengthHistory a checkpoint records (a list of [from_step, total_steps, stretched]); a run without one
    (saved before the record existed) had one length: `total_steps`, the length the config it resumed with says."""
    if not record:
        return (Length(0, total_steps),)
    return tuple(Length(int(a), int(b), bool(c)) for a, b, c in record)


def history_as_record(history: LengthHistory) -> list[list]:
    return [[length.from_step, length.total_steps, length.stretched] for length in history]


def scheduled_lr(step: float, cfg: Any, history: LengthHistory) -> float:
    """The LR of step `step` under `cfg` (optim) in a run whose length changed as `history` says."""
    *earlier, current = history
    if earlier and step < current.from_step:
        return scheduled_lr(step, cfg, tuple(earlier))
    if not current.stretched:
        return lr_at(step, cfg, current.total_steps)
    old_last, new_last = last_step(cfg, earlier[-1].total_steps), last_step(cfg, current.total_steps)
    return scheduled_lr(stretched_step(step, current.from_step, old_last, new_last), cfg, tuple(earlier))


def stretched_step(step: float, start: int, old_last: int, new_last: int) -> float:
    """The step of the old schedule that step `step` of the new one stands for: [start, new_last] drawn onto
    [start, old_last]; at or past a finished schedule's end (old_last <= start), the old schedule's last step."""
    if old_last <= start or new_last <= start:
        return float(old_last)
    return start + (step - start) * (old_last - start) / (new_last - start)


def keeps_the_past(cfg: Any, start: int, old_total: int, new_total: int) -> bool:
    """Whether following the schedule of `new_total` steps from the start leaves the LR of every step before
    `start` as the schedule of `old_total` steps gave it (then no stretch is needed)."""
    if cfg.schedule == "constant" or start <= cfg.warmup_steps:
        return True
    if cfg.schedule == "wsd":
        return start <= min(wsd_decay_start(cfg, old_total), wsd_decay_start(cfg, new_total))
    return False


def with_length(history: LengthHistory, cfg: Any, step: int, total_steps: int) -> LengthHistory:
    """`history` after the run, resumed at `step`, becomes `total_steps` long (unchanged when it already is).

    A change recorded at `step` itself (a resume that stopped before it trained a step) is replaced. Once a stretch
    is in the history, every later change stretches too: the schedule no longer is any plain one.
    """
    kept = tuple(length for length in history if length.from_step < step) or history[:1]
    current = kept[-1]
    if total_steps == current.total_steps:
        return kept
    if step <= 0:
        return (Length(0, total_steps),)
    stretched = any(length.stretched for length in kept) or \
        not keeps_the_past(cfg, step, current.total_steps, total_steps)
    return (*kept, Length(step, total_steps, stretched))
