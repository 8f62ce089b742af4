"""What the trainer says of the run: its start line and each step's metrics, as functions of what it hands them.

Kept out of pretrain/trainer.py so the loop reads in one sitting: nothing here changes the training, it only
formats and derives (tokens/s, MFU with document masking's attention span, per-domain losses from the step's
one all-reduce).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pretrain.config import AyumiConfig, tokens_per_step
from pretrain.engine.distributed import DistInfo
from pretrain.metrics import format_count
from pretrain.model.config import ModelConfig
from pretrain.model.flops import flops_per_token, peak_flops


@dataclass(frozen=True)
class StepFigures:
    """The run's constants that a step's metrics are derived from."""

    tokens_per_step: int
    flops_per_token: float
    """6N + attention at the full sequence length (pretrain/model/flops.py); document masking recounts per step."""
    model: ModelConfig
    seq_len: int
    document_end: int | None
    """The end-of-document token under document masking, else None."""
    peak_flops: float | None
    """One device's peak (None where unknown: no MFU)."""
    ranks_per_sample: int
    world_size: int

    @classmethod
    def of(cls, cfg: AyumiConfig, dist: DistInfo) -> "StepFigures":
        document_end = cfg.model.document_end_id if cfg.model.attention == "document" else None
        return cls(tokens_per_step(cfg.train), flops_per_token(cfg.model, cfg.train.seq_len), cfg.model,
                   cfg.train.seq_len, document_end, peak_flops(dist.device), dist.ranks_per_sample, dist.world_size)


def start_line(cfg: AyumiConfig, dist: DistInfo, total_steps: int, figures: StepFigures, grad_accum: int,
               grad_accum_dtype: str) -> str:
    """The line printed before step 1: length, batch geometry, layout, ZeRO and precision."""
    layout = f" (tensor-parallel {dist.tensor_parallel} x data-parallel {dist.dp_size})" \
        if dist.tensor_parallel > 1 else ""
    if dist.sequence_parallel > 1:
        layout = (f" (sequence-parallel {dist.sequence_parallel} x data-parallel {dist.dp_size}: "
                  f"{cfg.train.seq_len // dist.sequence_parallel} tokens of each sequence a rank)")
    return (f"run {cfg.name}: {format_count(cfg.train.tokens)} tokens = {total_steps} steps x "
            f"{format_count(figures.tokens_per_step)} tokens/step ({cfg.train.global_batch_size} x {cfg.train.seq_len}); "
            f"{dist.world_size} rank(s) on {dist.device.type}{layout}, micro batch {cfg.train.micro_batch_size}, "
            f"grad accum {grad_accum} (summed in {grad_accum_dtype}), "
            f"ZeRO {cfg.deepspeed.zero_stage}, {cfg.deepspeed.precision}")


def step_metrics(figures: StepFigures, loss: float, lr: float, result, step_time: float, reduced: torch.Tensor,
                 skipped_steps: int, tokens: int, domain_names: list[str], stability: dict[str, Any],
                 curriculum: dict[str, Any]) -> dict[str, Any]:
    """The step's metrics: loss (total and per domain), optimizer, throughput, stability, curriculum.

    `reduced` is the step's all-reduced sums (Trainer.train_step): [loss, per-domain loss sums, per-domain
    sample counts, document spans, stop flag]."""
    tokens_per_s = figures.tokens_per_step / step_time if step_time > 0 else 0.0
    metrics: dict[str, Any] = {
        "train/loss": loss if math.isfinite(loss) else float("nan"),
        "opt/lr": lr,
        "opt/grad_norm": result.grad_norm if result else None,
        "opt/loss_scale": result.loss_scale if result else None,
        "opt/skipped_steps": skipped_steps,
        "perf/tokens_per_s": tokens_per_s,
        "perf/step_time": step_time,
        "tokens": tokens,
    }
    flops = figures.flops_per_token
    if figures.document_end is not None:
        # Every rank of a tensor- or sequence-parallel group added the same batch's spans.
        span = float(reduced[-2]) / (figures.tokens_per_step * figures.ranks_per_sample)
        metrics["perf/attention_span"] = span
        flops = flops_per_token(figures.model, figures.seq_len, span)
    if figures.peak_flops:
        metrics["perf/mfu"] = tokens_per_s * flops / (figures.peak_flops * figures.world_size)
    metrics.update(stability)
    num_domains = len(domain_names)
    counts = reduced[1 + num_domains:1 + 2 * num_domains]
    for index, name in enumerate(domain_names):
        if counts[index] > 0:
            metrics[f"train/loss/{name}"] = float(reduced[1 + index] / counts[index])
    metrics.update(curriculum)
    return metrics
