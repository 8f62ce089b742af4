"""The training loop: steps, evaluation, checkpoint policy, signals, metrics.

Run length is a token budget; the step count is derived from it and announced before step 1.
Everything that must survive a restart (engine, data position, counters, RNG) goes into the
checkpoint, so a resumed run produces the same per-step losses as an uninterrupted one.
Decisions that change control flow (stop on a signal) are agreed by all ranks first.
"""
from __future__ import annotations

import math
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curriculum.mixer import Mixer, SkipLedger
from curriculum.schedule import eval_due
from data.packed import PackedSamples
from pretrain.checkpoint import Checkpointer, latest_tag, resolve_checkpoint
from pretrain.config import AyumiConfig, tokens_per_step
from pretrain.engine import DistInfo, TrainEngine, all_reduce_tensor, barrier
from pretrain.loader import BatchLoader
from pretrain.metrics import NullLogger, format_count
from pretrain.model.flops import flops_per_token
from pretrain.optim import lr_at

# Dense bf16 peak FLOP/s per GPU, for MFU (vendor datasheets; no sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "V100": 125e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    return None


@dataclass
class TrainState:
    """Counters that survive restarts (the loader and engine hold the rest)."""

    step: int = 0
    """Optimizer steps taken (applied or skipped)."""
    tokens: int = 0
    """Tokens consumed."""
    skipped_steps: int = 0
    """Steps whose update was not applied (overflow, non-finite gradients)."""
    wall_time: float = 0.0
    """Seconds spent training over all sessions of this run."""


@dataclass
class TrainResult:
    """What `Trainer.run` reports back (also used by tests)."""

    steps: int
    tokens: int
    stopped_by_signal: bool
    final_loss: float | None
    val_losses: dict[str, float] = field(default_factory=dict)


class StopSignal:
    """Records SIGTERM/SIGINT; the trainer finishes the step, saves, and exits 0."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means "now"
        self.received = signum

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class Trainer:
    """Owns the loop; built by pretrain.train.build_trainer."""

    def __init__(self, cfg: AyumiConfig, dist: DistInfo, engine: TrainEngine, loader: BatchLoader,
                 val_sets: dict[str, PackedSamples], logger: NullLogger, checkpointer: Checkpointer,
                 total_steps: int, run_meta: dict[str, Any]):
        self.cfg = cfg
        self.dist = dist
        self.engine = engine
        self.loader = loader
        self.val_sets = val_sets
        self.logger = logger
        self.checkpointer = checkpointer
        self.total_steps = total_steps
        self.run_meta = run_meta
        self.state = TrainState()
        self.domain_names = list(loader.source.domain_names)
        self.tokens_per_step = tokens_per_step(cfg.train)
        self.flops_per_token = flops_per_token(cfg.model, cfg.train.seq_len)
        self.peak_flops = peak_flops(dist.device)
        self.stop = StopSignal()
        self.mixer = loader.source if isinstance(loader.source, Mixer) else None
        # Skipped sample ranges also live outside checkpoints, so that resuming from a checkpoint
        # older than a skip still never replays the skipped batches.
        self.skip_ledger = SkipLedger(Path(cfg.run_dir) / "skipped_samples.json")
        if self.mixer is not None:
            self.mixer.add_skips(self.skip_ledger.load())

    # -- state ----------------------------------------------------------------------------------
    def shared_state(self) -> dict[str, Any]:
        shared = {"train": asdict(self.state), "loader": self.loader.state_dict()}
        if self.mixer is not None:
            shared["mixer"] = self.mixer.state_dict()
        return shared

    def load_shared_state(self, shared: dict[str, Any]) -> None:
        self.state = TrainState(**shared["train"])
        self.loader.load_state_dict(shared["loader"])
        if self.mixer is not None and "mixer" in shared:
            self.mixer.load_state_dict(shared["mixer"])

    def resume_if_possible(self) -> int | None:
        """Load `latest` (or checkpoint.load_from); returns the resumed step, None for a fresh start."""
        ckpt = self.cfg.checkpoint
        if ckpt.load_from:
            root, tag = resolve_checkpoint(ckpt.load_from)
        elif ckpt.resume and (tag := latest_tag(self.checkpointer.root)) is not None:
            root = self.checkpointer.root
        else:
            return None
        shared, meta = self.checkpointer.load(self.engine, tag, root=root)
        self.load_shared_state(shared)
        self.logger.info(f"resumed from {root / tag} at step {self.state.step} ({format_count(self.state.tokens)} tokens)")
        return self.state.step

    def save(self, reason: str) -> None:
        start = time.perf_counter()
        path = self.checkpointer.save(self.engine, self.state.step, self.shared_state(), self.run_meta)
        self.logger.info(f"saved checkpoint {path} ({reason}, {time.perf_counter() - start:.1f}s)")

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        self.announce()
        if self.cfg.checkpoint.save_on_signal:
            self.stop.install()
        self.logger.set_progress(self.total_steps, self.state.step)
        self.engine.train()
        last_loss: float | None = None
        stopped = False
        max_steps = self.cfg.train.max_steps
        start_step = self.state.step
        if start_step >= self.total_steps:
            self.logger.info(f"run {self.cfg.name} is already complete ({start_step} steps); nothing to do")
        try:
            while self.state.step < self.total_steps and not (max_steps and self.state.step >= max_steps):
                metrics, stop_requested = self.train_step()
                last_loss = metrics.get("train/loss", last_loss)
                step = self.state.step
                if step % self.cfg.train.log_interval == 0 or step == self.total_steps:
                    self.logger.log(step, metrics)
                if self.should_evaluate(step):
                    self.evaluate()
                if stop_requested:
                    self.logger.event("signal_stop", step, self.state.tokens,
                                      "stop requested by signal: saving and exiting cleanly")
                    self.save("signal")
                    stopped = True
                    break
                if self.cfg.checkpoint.interval and step % self.cfg.checkpoint.interval == 0 \
                        and step < self.total_steps:
                    self.save("interval")
            else:
                if self.cfg.checkpoint.save_final and self.state.step > start_step:
                    self.save("final")
            val = {} if stopped or not self.val_sets else self.evaluate()
        finally:
            self.stop.restore()
            self.loader.close()
        return TrainResult(self.state.step, self.state.tokens, stopped, last_loss, val)

    def announce(self) -> None:
        cfg = self.cfg
        self.logger.info(
            f"run {cfg.name}: {format_count(cfg.train.tokens)} tokens = {self.total_steps} steps x "
            f"{format_count(self.tokens_per_step)} tokens/step ({cfg.train.global_batch_size} x {cfg.train.seq_len}); "
            f"{self.dist.world_size} rank(s) on {self.dist.device.type}, micro batch {cfg.train.micro_batch_size}, "
            f"grad accum {self.engine.grad_accum}, ZeRO {cfg.deepspeed.zero_stage}, {cfg.deepspeed.precision}"
        )

    def should_evaluate(self, step: int) -> bool:
        train = self.cfg.train
        if not self.val_sets or step >= self.total_steps:
            return False  # the final evaluation runs after the loop
        return eval_due(step, train.eval_interval, train.eval_dense_interval, train.eval_dense_until)

    def train_step(self) -> tuple[dict[str, Any], bool]:
        """One optimizer step over grad_accum micro-batches; returns (metrics, stop agreed by all ranks)."""
        self.skip_recorded_ranges()
        lr = lr_at(self.state.step, self.cfg.optim, self.total_steps)
        if self.mixer is not None:
            lr = self.mixer.lr(lr, self.cfg.optim.min_lr)
        self.engine.set_lr(lr)
        start = time.perf_counter()
        batches = self.loader.next_step()
        num_domains = len(self.domain_names)
        # Per-domain [loss sum, sample count], plus the total loss sum and the stop flag: one
        # all-reduce per step carries everything the ranks must agree on or report. The sums stay
        # on the training device until then: a .cpu() per micro-batch would make the host wait
        # for the GPU after every backward (bench/step_overhead.py).
        device = self.dist.device
        domain_sums = torch.zeros(2 * num_domains, dtype=torch.float64, device=device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        result = None
        for batch in batches:
            out = self.engine.forward(batch.input_ids, batch.labels)
            self.engine.backward(out.loss)
            result = self.engine.micro_step() or result
            loss_sum += out.ce_loss.double()
            sample_loss = out.sample_loss.double()
            domains = batch.domains.to(device, non_blocking=True)
            domain_sums.index_add_(0, domains, sample_loss)
            domain_sums.index_add_(0, domains + num_domains, torch.ones_like(sample_loss))
        stop_flag = torch.tensor([1.0 if self.stop.received is not None else 0.0], dtype=torch.float64, device=device)
        reduced = all_reduce_tensor(torch.cat([loss_sum.reshape(1), domain_sums, stop_flag])).cpu()
        step_time = time.perf_counter() - start

        self.state.step += 1
        self.state.tokens += self.tokens_per_step
        self.state.wall_time += step_time
        if result is not None and not result.applied:
            self.state.skipped_steps += 1
        loss = float(reduced[0]) / (len(batches) * self.dist.world_size)
        metrics = self.step_metrics(loss, lr, result, step_time)
        if self.mixer is not None:
            self.log_curriculum_events(self.mixer.advance(self.loader.consumed_samples))
            metrics.update(self.mixer.metrics())
        counts = reduced[1 + num_domains:1 + 2 * num_domains]
        for index, name in enumerate(self.domain_names):
            if counts[index] > 0:
                metrics[f"train/loss/{name}"] = float(reduced[1 + index] / counts[index])
        return metrics, bool(reduced[-1] > 0)

    def log_curriculum_events(self, events) -> None:
        for event in events:
            self.logger.event(event.kind, self.state.step, self.state.tokens, event.message, **event.fields)

    def skip_recorded_ranges(self) -> None:
        """After restoring a position older than a recorded skip, jump over the skipped batches again."""
        if self.mixer is None:
            return
        due = self.mixer.skip_due(self.loader.consumed_samples)
        if due:
            self.skip_batches(due)

    def skip_batches(self, num_batches: int) -> None:
        """Advance the data stream past `num_batches` global batches that will never be trained on."""
        self.loader.skip(num_batches)
        if self.mixer is not None:
            events = self.mixer.skip(num_batches)
            if self.dist.is_main:
                self.skip_ledger.save(self.mixer.skips)
            self.log_curriculum_events(events)

    def step_metrics(self, loss: float, lr: float, result, step_time: float) -> dict[str, Any]:
        tokens_per_s = self.tokens_per_step / step_time if step_time > 0 else 0.0
        metrics: dict[str, Any] = {
            "train/loss": loss,
            "opt/lr": lr,
            "opt/grad_norm": result.grad_norm if result else None,
            "opt/loss_scale": result.loss_scale if result else None,
            "opt/skipped_steps": self.state.skipped_steps,
            "perf/tokens_per_s": tokens_per_s,
            "perf/step_time": step_time,
            "tokens": self.state.tokens,
        }
        if self.peak_flops:
            metrics["perf/mfu"] = tokens_per_s * self.flops_per_token / (self.peak_flops * self.dist.world_size)
        if not math.isfinite(loss):
            metrics["train/loss"] = float("nan")
        return metrics

    # -- evaluation -----------------------------------------------------------------------------
    def eval_batches(self, available: int) -> list[tuple[list[int], list[float]]]:
        """This rank's share of the evaluation samples as micro-batches of (ids, weights).

        Rank r takes samples r, r+W, r+2W, ...; ranks with one sample fewer pad with a weight-0
        repeat, because every rank must run the same number of forwards (ZeRO-3 gathers
        parameters collectively). The result is the same mean at any world size.
        """
        count = min(self.cfg.train.eval_samples, available)
        world, micro = self.dist.world_size, self.cfg.train.micro_batch_size
        mine = list(range(self.dist.rank, count, world))
        per_rank = math.ceil(count / world)
        per_rank = math.ceil(per_rank / micro) * micro
        weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
        ids = mine + [0] * (per_rank - len(mine))
        return [(ids[i:i + micro], weights[i:i + micro]) for i in range(0, per_rank, micro)]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over the first eval_samples samples of each validation set."""
        self.engine.eval()
        results: dict[str, float] = {}
        for name, samples in self.val_sets.items():
            total = torch.zeros(2, dtype=torch.float64)
            for ids, weights in self.eval_batches(len(samples)):
                tokens = torch.from_numpy(np.stack([samples.sample(i) for i in ids]).astype(np.int64))
                tokens = tokens.to(self.dist.device)
                out = self.engine.forward(tokens[:, :-1], tokens[:, 1:])
                weights = torch.tensor(weights, dtype=torch.float64)
                total += torch.stack([(out.sample_loss.double().cpu() * weights).sum(), weights.sum()])
            total = all_reduce_tensor(total)
            results[name] = float(total[0] / total[1])
        self.engine.train()
        if results:
            metrics = {f"val/{name}/loss": value for name, value in results.items()}
            metrics["val/loss"] = sum(results.values()) / len(results)
            self.logger.log(self.state.step, metrics, console=False)
            self.logger.info("eval @ step {}: {}".format(
                self.state.step, ", ".join(f"{name} {value:.4f}" for name, value in results.items())))
        barrier()
        return results
