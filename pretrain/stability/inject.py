"""Fault injection (`stability.inject`): make spikes, NaNs and fp16 overflows happen on purpose.

For demos and tests of the stability machinery, never for real runs; everything is off unless a
step is listed. The trainer asks, per step:

    lr_multiplier(step)          multiply this step's LR (LR x50 for 3 steps on the debug model
                                 took its loss from 1.41 to 3.3: a sustained, PaLM-like spike)
    should_randomize_batch(step) replace the batch with random tokens (random_tokens helps)
    should_nan_loss(step)        make the loss NaN before backward
    should_force_overflow(step)  fp16: make the gradients overflow (loss x inf)
    lr_set_at(step)              the LR a replay trains this step at (`ayumi replay`), else None

`feed_sample` and `lr_set` are not faults but a replay's feed (pretrain/stability/replay.py): they apply on
every pass, a rollback's replay included, and fire no `fault_injected` event.

A fault fires the first time the run reaches its step. When a rollback replays the step it does
not fire again unless `replay` is set: PaLM found that a spike did not recur once the batches
around it were skipped, and a demo that re-injects forever could only ever end in a stop (which
is what `replay: true` demonstrates). The injector remembers the highest step reached, in its
state_dict, so a restarted job does not re-inject either.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from pretrain.stability.config import InjectConfig


class FaultInjector:
    """Answers "inject a fault at this step?" from InjectConfig; see the module docstring."""

    def __init__(self, cfg: InjectConfig):
        self.cfg = cfg
        self._lr = {int(step): float(factor) for step, factor in cfg.lr_multiply.items()}
        self._random = frozenset(int(s) for s in cfg.random_batch_steps)
        self._nan = frozenset(int(s) for s in cfg.nan_loss_steps)
        self._overflow = frozenset(int(s) for s in cfg.fp16_overflow_steps)
        self._lr_set = {int(step): float(lr) for step, lr in cfg.lr_set.items()}
        self.highest_step = -1  # the furthest step run so far; lower steps are replays

    def describe(self) -> str:
        """The configured faults, at the step numbers the console and events.jsonl show (index + 1)."""
        def steps(indices) -> str:
            return ", ".join(str(i + 1) for i in sorted(indices))

        by_factor: dict[float, list[int]] = {}
        for step, factor in self._lr.items():
            by_factor.setdefault(factor, []).append(step)
        parts = [f"LR x{factor:g} at step(s) {steps(at)}" for factor, at in sorted(by_factor.items())]
        parts += [f"{what} at step(s) {steps(at)}" for what, at in (("random-token batch", self._random),
                                                                    ("NaN loss", self._nan),
                                                                    ("fp16 overflow", self._overflow)) if at]
        again = "again on every replay" if self.cfg.replay else "once (a replay after a rollback runs clean)"
        return "; ".join(parts) + f", each firing {again}"

    @property
    def active(self) -> bool:
        """True if any fault is configured (the trainer announces it loudly)."""
        return bool(self._lr or self._random or self._nan or self._overflow)

    def _fires(self, step: int, steps: Any) -> bool:
        return step in steps and (self.cfg.replay or step > self.highest_step)

    def lr_multiplier(self, step: int) -> float:
        """Factor for this step's LR: 1.0 unless lr_multiply lists the step."""
        return self._lr[step] if self._fires(step, self._lr) else 1.0

    def lr_set_at(self, step: int) -> float | None:
        """The LR a replay trains `step` at (lr_set), else None: the schedule's."""
        return self._lr_set.get(step)

    def should_randomize_batch(self, step: int) -> bool:
        return self._fires(step, self._random)

    def should_nan_loss(self, step: int) -> bool:
        return self._fires(step, self._nan)

    def should_force_overflow(self, step: int) -> bool:
        return self._fires(step, self._overflow)

    def faults_at(self, step: int) -> list[str]:
        """Names of the faults firing at `step`, for an events.jsonl entry ("fault_injected")."""
        faults = []
        if (factor := self.lr_multiplier(step)) != 1.0:
            faults.append(f"lr x{factor:g}")
        if self.should_randomize_batch(step):
            faults.append("random batch")
        if self.should_nan_loss(step):
            faults.append("NaN loss")
        if self.should_force_overflow(step):
            faults.append("fp16 overflow")
        return faults

    def step_done(self, step: int) -> None:
        """Call after each step (applied or skipped): marks it reached, so a replay runs clean."""
        self.highest_step = max(self.highest_step, step)

    def random_tokens(self, shape: tuple[int, ...], vocab_size: int, step: int, rank: int = 0) -> np.ndarray:
        """Uniformly random token ids (int64), reproducible from (seed, step, rank)."""
        rng = np.random.default_rng([self.cfg.seed, step, rank])
        return rng.integers(0, vocab_size, size=shape, dtype=np.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"highest_step": self.highest_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.highest_step = int(state["highest_step"])
