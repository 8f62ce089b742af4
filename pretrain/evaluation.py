"""Validation loss during training: when it runs, and the run itself.

`Evaluator.due(step)` follows `train.eval_interval` (denser early on: `eval_dense_interval` until
`eval_dense_until`); `Evaluator.run(step, tokens)` computes the mean loss of the first `train.eval_samples`
samples of each domain's validation set, logs `val/<domain>/loss` and `val/loss`, and, every
`stability.precision_check_every` evaluations of a bf16/fp16 run, the same loss with a full fp32 copy of the
weights (`val/<domain>/fp32_gap`). Samples are spread over the data-parallel ranks so that the result does
not depend on how many there are. Every rank calls `run` together (ZeRO-3 gathers parameters collectively).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch

from curriculum.schedule import eval_due
from data.packed import PackedSamples
from pretrain.config import AyumiConfig
from pretrain.engine.distributed import DistInfo, all_reduce_tensor, barrier
from pretrain.engine.train_engine import TrainEngine
from pretrain.job.hang_watchdog import HangWatchdog
from pretrain.metrics import NullLogger


def eval_batches(count: int, dp_rank: int, dp_size: int, micro: int) -> list[tuple[list[int], list[float]]]:
    """This rank's share of `count` evaluation samples as micro-batches of (ids, weights).

    Data-parallel rank r of W takes samples r, r+W, r+2W, ... (the ranks of a tensor-parallel group take the
    same ones: they compute one forward together); ranks with one sample fewer pad with a weight-0 repeat,
    because every rank must run the same number of forwards. The result is the same mean at any world size:
    the all-reduce counts each sample once per tensor-parallel rank, in the sums and in the weights alike.
    """
    mine = list(range(dp_rank, count, dp_size))
    per_rank = math.ceil(math.ceil(count / dp_size) / micro) * micro
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    ids = mine + [0] * (per_rank - len(mine))
    return [(ids[i:i + micro], weights[i:i + micro]) for i in range(0, per_rank, micro)]


class Evaluator:
    """The validation loss of the training run, at the steps the config asks for."""

    def __init__(self, cfg: AyumiConfig, dist: DistInfo, engine: TrainEngine, val_sets: dict[str, PackedSamples],
                 logger: NullLogger, watchdog: HangWatchdog, total_steps: int):
        self.cfg = cfg
        self.dist = dist
        self.engine = engine
        self.val_sets = val_sets
        self.logger = logger
        self.watchdog = watchdog
        self.total_steps = total_steps
        self.evaluations = 0

    def due(self, step: int) -> bool:
        """Whether to evaluate after `step` steps (the final evaluation runs after the loop, not here)."""
        train = self.cfg.train
        if not self.val_sets or step >= self.total_steps:
            return False
        return eval_due(step, train.eval_interval, train.eval_dense_interval, train.eval_dense_until)

    @torch.no_grad()
    def run(self, step: int, tokens: int) -> dict[str, float]:
        """Mean loss over the first eval_samples samples of each validation set (+ the fp32 check), logged."""
        self.engine.eval()
        with self.watchdog.phase(step, "evaluation"):
            results = self.losses(self.engine.forward)
        self.engine.train()
        self.evaluations += 1
        if results:
            metrics = {f"val/{name}/loss": value for name, value in results.items()}
            metrics["val/loss"] = sum(results.values()) / len(results)
            metrics["tokens"] = tokens
            if self._precision_check_due():
                for name, value in self.fp32_losses().items():
                    metrics[f"val/{name}/loss_fp32"] = value
                    metrics[f"val/{name}/fp32_gap"] = results[name] - value
            self.logger.log(step, metrics, console=False)
            self.logger.info("eval @ step {}: {}".format(
                step, ", ".join(f"{name} {value:.4f}" for name, value in results.items())))
        barrier()
        return results

    def _precision_check_due(self) -> bool:
        every = self.cfg.stability.precision_check_every
        return every > 0 and self.cfg.deepspeed.precision != "fp32" and self.evaluations % every == 0

    def losses(self, forward: Callable) -> dict[str, float]:
        """Mean loss of `forward(inputs, labels)` over the first eval_samples samples of each set."""
        results: dict[str, float] = {}
        for name, samples in self.val_sets.items():
            total = torch.zeros(2, dtype=torch.float64)
            count = min(self.cfg.train.eval_samples, len(samples))
            for ids, weights in eval_batches(count, self.dist.dp_rank, self.dist.dp_size,
                                             self.cfg.train.micro_batch_size):
                tokens = torch.from_numpy(np.stack([samples.sample(i) for i in ids]).astype(np.int64))
                tokens = tokens.to(self.dist.device)
                out = forward(tokens[:, :-1], tokens[:, 1:])
                weights = torch.tensor(weights, dtype=torch.float64)
                total += torch.stack([(out.sample_loss.double().cpu() * weights).sum(), weights.sum()])
            total = all_reduce_tensor(total)
            results[name] = float(total[0] / total[1])
        return results

    def fp32_losses(self) -> dict[str, float]:
        """The same evaluation with a full fp32 copy of the weights (bf16 and fp32 evaluations can drift apart
        late in training). Collective under ZeRO-3."""
        from pretrain.model.llama import Llama

        weights = self.engine.full_fp32_params()
        model = Llama(self.cfg.model).to(self.dist.device)
        missing = model.load_state_dict(weights, strict=False).missing_keys  # a tied lm_head is the embedding
        if set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"fp32 precision check: weights missing for {sorted(missing)}")
        model.eval()
        return self.losses(lambda inputs, labels: model(inputs, labels))
