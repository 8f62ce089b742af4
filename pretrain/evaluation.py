"""Evaluation during training: the validation loss (`Evaluator`) and downstream tasks (`DownstreamEvaluator`).

`Evaluator.due(step)` follows `train.eval_interval` (denser early on: `eval_dense_interval` until
`eval_dense_until`); `Evaluator.run(step, tokens)` computes the mean loss of the first `train.eval_samples`
samples of each domain's validation set, logs `val/<domain>/loss` and `val/loss`, and, every
`stability.precision_check_every` evaluations of a bf16/fp16 run, the same loss with a full fp32 copy of the
weights (`val/<domain>/fp32_gap`). Samples are spread over the data-parallel ranks so that the result does
not depend on how many there are. Every rank calls `run` together (ZeRO-3 gathers parameters collectively).

`DownstreamEvaluator` scores `eval.downstream`'s tasks (downstream/) before a fresh run's first step, every
`interval` steps and after the last one, logging `eval/<task>/<metric>`, the seconds it took and its share of the run's time so far; what each
example got (choices' log-likelihoods, generated answers) goes to RUN_DIR/eval/downstream/step_NNNNNNN.json.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from curriculum.schedule import eval_due
from data.packed import PackedSamples
from common.files import write_text_atomic
from downstream.evaluate import PreparedTask, TaskScores, flat_metrics, score_tasks
from downstream.prompts import Tokenizer
from downstream.scoring import Share
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


def eager_only():
    """Compiled blocks run eagerly inside: downstream batches come in many lengths, and blocks compiled with static
    shapes (model.compile) would compile a variant per length, minutes each on a GPU and past torch's recompile
    limit. Scoring is a small share of a run; eager gives the same numbers as `ayumi eval`, which never compiles."""
    set_stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@dataclass
class DownstreamTasks:
    """eval.downstream's tasks as prepared before training (pretrain/train.py), with the tokenizer they need."""

    tasks: list[PreparedTask] = field(default_factory=list)
    tokenizer: Tokenizer | None = None
    end_ids: tuple[int, ...] = ()
    """Tokens that end a generation (the tokenizer's EOS)."""


class DownstreamEvaluator:
    """`eval.downstream`'s tasks, scored on the training model (every rank together)."""

    def __init__(self, cfg: AyumiConfig, dist: DistInfo, engine: TrainEngine, downstream: DownstreamTasks,
                 logger: NullLogger, watchdog: HangWatchdog, total_steps: int):
        self.settings = cfg.eval.downstream
        self.folder = Path(cfg.run_dir) / "eval" / "downstream"
        self.dist = dist
        self.engine = engine
        self.tasks = downstream.tasks
        self.tokenizer = downstream.tokenizer
        self.end_ids = downstream.end_ids
        self.pad_id = self.end_ids[0] if self.end_ids else 0
        self.vocab = getattr(self.tokenizer, "vocab_size", None)  # greedy decoding picks a real token
        self.logger = logger
        self.watchdog = watchdog
        self.total_steps = total_steps
        self.seconds = 0.0
        self.started = time.perf_counter()  # the run's time so far, for the share spent here
        self.last_step: int | None = None

    def due(self, step: int) -> bool:
        """Every `interval` steps before the last (the final scoring runs after the loop: `final`)."""
        interval = self.settings.interval
        return bool(self.tasks) and interval > 0 and step % interval == 0 and step < self.total_steps

    def at_start(self, step: int) -> bool:
        """Before the first step of a fresh run, so the curves start from the untrained (or initial) model."""
        return bool(self.tasks) and self.settings.interval > 0 and step == 0

    def final(self, step: int, tokens: int) -> dict[str, float]:
        """After the loop: score unless this step was just scored."""
        return self.run(step, tokens) if self.tasks and self.last_step != step else {}

    @torch.no_grad()
    def run(self, step: int, tokens: int) -> dict[str, float]:
        """Score every task, log `eval/<task>/<metric>` with the time spent; returns the metrics."""
        began = time.perf_counter()
        self.engine.eval()
        share = Share(self.dist.dp_rank, self.dist.dp_size, all_reduce_tensor)
        with self.watchdog.phase(step, "downstream evaluation"), eager_only():
            scores = score_tasks(self.tasks, self.engine.logits, self.tokenizer, share, self.settings.batch_size,
                                 self.dist.device, self.pad_id, self.end_ids, self.vocab)
        self.engine.train()
        elapsed = time.perf_counter() - began
        self.seconds += elapsed
        self.last_step = step
        metrics = flat_metrics(scores)
        if self.dist.is_main:
            self.write_examples(step, tokens, scores)
        record = {**metrics, "tokens": tokens, "eval/downstream_seconds": elapsed}
        if step > 0:  # before any training the share would be nearly all of a run that has not begun
            record["eval/time_share"] = self.seconds / max(time.perf_counter() - self.started, 1e-9)
        self.logger.log(step, record, console=False)
        self.logger.info("downstream @ step {}: {} ({:.1f} s)".format(step, ", ".join(
            f"{s.name} " + " ".join(f"{m} {v:.4f}" for m, v in s.metrics.items()) for s in scores), elapsed))
        return metrics

    def write_examples(self, step: int, tokens: int, scores: list[TaskScores]) -> None:
        """What every example got at this step, as `ayumi eval` writes it (rank 0)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        body = {"step": step, "tokens": tokens,
                "tasks": {s.name: {"kind": s.kind, "metrics": s.metrics, "examples": s.examples} for s in scores}}
        write_text_atomic(self.folder / f"step_{step:07d}.json", json.dumps(body, ensure_ascii=False, indent=1))
