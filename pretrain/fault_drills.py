"""Fault injection for the fire drills, behind one object that the training step calls once.

Drills are configured, never accidental: `stability.inject` (a loss spike from random tokens, a NaN loss, an
fp16 overflow, at chosen steps) and `hang.inject_delay_s` (one rank slower, as a throttled GPU would be). A
run with any drill on says so at start. `FaultDrills.apply(index, batches)` does everything a drill does to
one step (logs the `fault_injected` event, replaces the tokens, sleeps on the slow rank) and returns the
factor the step's loss is multiplied by: 1, NaN, or 1e30 (an fp16 overflow). Without drills it returns 1 at
once.
"""
from __future__ import annotations

import time

import torch

from pretrain.config import AyumiConfig
from pretrain.engine.distributed import DistInfo
from pretrain.metrics import NullLogger
from pretrain.stability.inject import FaultInjector


class FaultDrills:
    """The drills of one run: the stability injector's faults and the hang drill's delay."""

    def __init__(self, cfg: AyumiConfig, dist: DistInfo, injector: FaultInjector, logger: NullLogger,
                 tokens_per_step: int):
        self.cfg = cfg
        self.dist = dist
        self.injector = injector
        self.logger = logger
        self.tokens_per_step = tokens_per_step
        self.delay_s = cfg.hang.inject_delay_s if dist.rank == cfg.hang.inject_rank else 0.0
        if injector.active:
            logger.info(f"FAULT INJECTION ON (stability.inject, a fire drill, not a real run): {injector.describe()}")

    def apply(self, index: int, batches, tokens_before: int) -> tuple[float, float]:
        """Step `index`'s drills: (the loss factor, seconds this rank was held back by the delay drill)."""
        faults = self.injector.faults_at(index)
        if faults:
            self.logger.event("fault_injected", index + 1, tokens_before + self.tokens_per_step,
                              f"injected {', '.join(faults)} (stability.inject fire drill)", faults=faults)
        self._randomize(index, batches)
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        if self.injector.should_nan_loss(index):
            return float("nan"), self.delay_s
        if self.injector.should_force_overflow(index):
            return 1e30, self.delay_s
        return 1.0, self.delay_s

    def _randomize(self, index: int, batches) -> None:
        """The spike drill: this step's tokens replaced with uniformly random ones."""
        if not self.injector.should_randomize_batch(index):
            return
        for number, batch in enumerate(batches):
            # Seeded by the data-parallel rank: the ranks of a tensor-parallel group must see the same tokens.
            noise = self.injector.random_tokens(tuple(batch.input_ids.shape), self.cfg.model.vocab_size,
                                                index * 1000 + number, self.dist.dp_rank)
            tokens = torch.from_numpy(noise).to(batch.input_ids.device)
            batch.input_ids.copy_(tokens)
            batch.labels[:, :-1].copy_(tokens[:, 1:])
