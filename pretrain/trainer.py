"""The training loop: steps, evaluation, checkpoint policy, signals, metrics.

Run length is a token budget; the step count is derived from it and announced before step 1.
Everything that must survive a restart (engine, data position, counters, RNG) goes into the
checkpoint, so a resumed run produces the same per-step losses as an uninterrupted one.
Decisions that change control flow (stop on a signal) are agreed by all ranks first.
"""
from __future__ import annotations

import math
import shutil
import signal
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from curriculum.mixer import Mixer, SkipLedger, batches_due, merge_ranges
from curriculum.schedule import eval_due
from data.packed import PackedSamples
from pretrain.checkpoint import Checkpointer, complete_tags, latest_tag, resolve_checkpoint, step_of, tag_for
from pretrain.config import AyumiConfig, tokens_per_step
from pretrain.engine import DistInfo, TrainEngine, all_reduce_tensor, any_rank, barrier, broadcast_object
from pretrain.loader import BatchLoader
from pretrain.metrics import NullLogger, format_count
from pretrain.model.flops import flops_per_token
from pretrain.hang_watchdog import HangWatchdog, StragglerMonitor
from pretrain.launcher_watch import LauncherWatch
from pretrain.model.llama import layer_groups
from pretrain.optim import lr_at
from pretrain.stability.policy import Action, ring_checkpoints_to_delete
from pretrain.stability.recovery import StabilityMonitor
from pretrain.stability.telemetry import group_grad_norms, group_metrics, log10_histogram, update_to_weight_ratios

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
    stopped_by_stability: str | None = None
    val_losses: dict[str, float] = field(default_factory=dict)


@dataclass
class StepOutcome:
    """What one turn of the run loop did, for the loop to decide whether to go on."""

    loss: float | None
    """The step's train/loss (None if the step logged none)."""
    rolled_back: bool = False
    """The stability machinery rolled the run back; the loop carries on from the restored step."""
    stability_stop: str | None = None
    """The stability machinery stopped the run (state saved); why."""
    signal_stop: bool = False
    """SIGTERM/SIGINT asked to stop (state saved)."""


class StopSignal:
    """Records SIGTERM/SIGINT (or a launcher gone, pretrain/launcher_watch.py); the trainer finishes the
    step, saves, and exits 0."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.reason = ""
        """Why the stop was requested, for the event."""
        self._previous: dict[int, Any] = {}
        self._watch: LauncherWatch | None = None

    def install(self, handle_signals: bool = True) -> None:
        """Watch the launcher always; take over SIGTERM/SIGINT when `handle_signals` (checkpoint.save_on_signal)."""
        if handle_signals:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        self._watch = LauncherWatch(self.request).start()

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means "now"
        self.received = signum
        self.reason = f"{signal.Signals(signum).name} received"

    def request(self, reason: str) -> None:
        """Stop as on SIGTERM, for `reason` (called from the launcher watch's thread)."""
        if self.received is None:
            self.received = signal.SIGTERM
            self.reason = reason

    def restore(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class Trainer:
    """Owns the loop; built by pretrain.train.build_trainer."""

    def __init__(self, cfg: AyumiConfig, dist: DistInfo, engine: TrainEngine, loader: BatchLoader,
                 val_sets: dict[str, PackedSamples], logger: NullLogger, checkpointer: Checkpointer,
                 total_steps: int, run_meta: dict[str, Any], watchdog: HangWatchdog | None = None):
        self.cfg = cfg
        # The hang watchdog hears of progress; without one (benchmarks, tests) a disabled stand-in.
        self.watchdog = watchdog or HangWatchdog(replace(cfg.hang, enabled=False), Path(cfg.run_dir), dist.rank,
                                                 dist.world_size)
        self.stragglers = StragglerMonitor(cfg.hang, self._gather_per_rank)
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
        self.skips: list[tuple[int, int]] = [tuple(r) for r in self.skip_ledger.load()]
        if self.mixer is not None:
            self.mixer.add_skips(self.skips)
        stab = cfg.stability
        if cfg.deepspeed.precision != "fp16":  # there is no loss scale to reset (or to mention)
            stab = replace(stab, recovery=replace(stab.recovery, reset_loss_scale=False))
        self.stability = StabilityMonitor(stab, cfg.optim.grad_clip, cfg.deepspeed.min_loss_scale, knobs=_knobs(cfg))
        self.ring = Checkpointer(Path(cfg.checkpoint.dir) / "recovery", keep_last=0, rank=dist.rank, barrier=barrier,
                                 world_size=dist.world_size, zero_stage=cfg.deepspeed.zero_stage, any_rank=any_rank,
                                 expected_bytes=checkpointer.expected_bytes, async_writes=checkpointer.async_writes,
                                 write_delay_s=cfg.checkpoint.inject_write_delay_s,
                                 tensor_parallel=dist.tensor_parallel)
        self._pending: tuple[int, float] | None = None  # (step, all-reduced loss) for the update gate
        if stab.enabled:
            engine.set_update_gate(self._update_gate)
            if not engine.can_withhold_updates:
                logger.info("note: with ZeRO-Offload's CPU Adam ayumi cannot withhold single updates; "
                            "spikes still roll back, and DeepSpeed skips overflow steps itself")
        if self.stability.injector.active:
            logger.info(f"FAULT INJECTION ON (stability.inject, a fire drill, not a real run): "
                        f"{self.stability.injector.describe()}")
        self.checkpoint_steps: list[int] = []
        self.evaluations = 0

    # -- state ----------------------------------------------------------------------------------
    def shared_state(self) -> dict[str, Any]:
        shared = {"train": asdict(self.state), "loader": self.loader.state_dict(),
                  "stability": self.stability.state_dict(), "skips": [list(r) for r in self.skips]}
        if self.mixer is not None:
            shared["mixer"] = self.mixer.state_dict()
        else:  # all domains shuffled: the data's shape, so a resume notices changed data as the mixer does
            shared["data"] = self.loader.source.state_dict()
        return shared

    def load_shared_state(self, shared: dict[str, Any], with_stability: bool = True) -> None:
        """Restore counters, data position and (unless rolling back in-process) the stability history."""
        self.state = TrainState(**shared["train"])
        self.loader.load_state_dict(shared["loader"])
        self.add_skips(shared.get("skips", []))
        if self.mixer is not None and "mixer" in shared:
            self.mixer.load_state_dict(shared["mixer"])
            self.mixer.add_skips(self.skips)
        elif self.mixer is None and "data" in shared:
            self.loader.source.load_state_dict(shared["data"])
        if with_stability and "stability" in shared:
            self.stability.load_state_dict(shared["stability"])

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
        self.apply_optimizer_overrides()
        resharded = (f"; re-sharded from {meta['resharded_from']} ranks{_tp(meta['resharded_from_tensor_parallel'])} to "
                     f"{self.dist.world_size}{_tp(self.dist.tensor_parallel)} through DeepSpeed's universal checkpoint"
                     if "resharded_from" in meta else "")
        self.logger.info(f"resumed from {root / tag} at step {self.state.step} ({format_count(self.state.tokens)} tokens)"
                         f"{resharded}")
        return self.state.step

    def _gather_per_rank(self, value: float) -> list[float]:
        """Every rank's `value`, in rank order (one small all-reduce)."""
        slots = torch.zeros(self.dist.world_size, dtype=torch.float64, device=self.dist.device)
        slots[self.dist.rank] = value
        return all_reduce_tensor(slots).tolist()

    def save(self, reason: str) -> None:
        start = time.perf_counter()
        with self.watchdog.phase(self.state.step, "checkpoint save"):
            path = self.checkpointer.save(self.engine, self.state.step, self.shared_state(), self.run_meta)
        how = "staged; writing in the background" if self.checkpointer.async_writes else "saved"
        self.logger.info(f"{how} checkpoint {path} ({reason}, {time.perf_counter() - start:.1f}s)")
        self.refresh_checkpoint_steps()

    def drain_checkpoints(self, prune: bool = True) -> None:
        """Wait for background checkpoint writes (all ranks): before a rollback, a stop, the end."""
        if self.checkpointer.pending_step is None and self.ring.pending_step is None:
            return
        start = time.perf_counter()
        with self.watchdog.phase(self.state.step, "checkpoint save"):
            done = [self.checkpointer.wait(prune=prune), self.ring.wait(prune=prune)]
        for path in filter(None, done):
            self.logger.info(f"checkpoint {path} is written ({time.perf_counter() - start:.1f}s waited)")
        self.refresh_checkpoint_steps()

    def save_recovery_checkpoint(self) -> None:
        """The cheap, frequent ring that makes a rollback >= rollback_steps back always possible."""
        step = self.state.step
        if self.stability.in_episode(step):
            return  # weights taken during an outlier episode are never a rollback target
        with self.watchdog.phase(step, "checkpoint save"):
            self.ring.save(self.engine, step, self.shared_state(), self.run_meta)
        if self.dist.is_main:
            rec = self.cfg.stability.recovery
            ring_steps = [step_of(tag) for tag in complete_tags(self.ring.root)]
            for old in ring_checkpoints_to_delete(ring_steps, rec.ring_keep, step, rec.rollback_steps,
                                                  self.stability.policy.bad_steps):
                shutil.rmtree(self.ring.root / tag_for(old), ignore_errors=True)
        barrier()
        self.refresh_checkpoint_steps()

    def refresh_checkpoint_steps(self) -> None:
        """Steps of every complete checkpoint (long-term and ring), identical on all ranks."""
        steps = None
        if self.dist.is_main:
            steps = sorted({step_of(t) for root in (self.checkpointer.root, self.ring.root) for t in complete_tags(root)})
        self.checkpoint_steps = broadcast_object(steps)
        self.stability.set_checkpoints(self.checkpoint_steps)

    def checkpoint_root_of(self, step: int) -> Path:
        """Where checkpoint `step` lives (the long-term folder wins over the ring)."""
        for root in (self.checkpointer.root, self.ring.root):
            if (root / tag_for(step) / "ayumi.json").is_file():
                return root
        raise FileNotFoundError(f"no complete checkpoint for step {step} under {self.checkpointer.root}")

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        self.announce()
        self.stop.install(handle_signals=self.cfg.checkpoint.save_on_signal)
        self.logger.set_progress(self.total_steps, self.state.step)
        self.refresh_checkpoint_steps()
        self.engine.train()
        last_loss: float | None = None
        stopped = False
        stability_stop: str | None = None
        max_steps = self.cfg.train.max_steps
        start_step = self.state.step
        if start_step >= self.total_steps:
            self.logger.info(f"run {self.cfg.name} is already complete ({start_step} steps); nothing to do")
        elif start_step == 0 and self.cfg.checkpoint.save_initial and 0 not in self.checkpoint_steps:
            self.save("initial")
        try:
            while self.state.step < self.total_steps and not (max_steps and self.state.step >= max_steps):
                outcome = self.step_once()
                last_loss = outcome.loss if outcome.loss is not None else last_loss
                if outcome.stability_stop is not None:
                    stability_stop = outcome.stability_stop
                    break
                if outcome.signal_stop:
                    stopped = True
                    break
            else:
                if self.cfg.checkpoint.save_final and self.state.step > start_step:
                    self.save("final")
            val = {} if stopped or stability_stop or not self.val_sets else self.evaluate()
            self.drain_checkpoints()
        finally:
            self.stop.restore()
            self.loader.close()
        return TrainResult(self.state.step, self.state.tokens, stopped, last_loss,
                           stopped_by_stability=stability_stop, val_losses=val)

    def step_once(self) -> StepOutcome:
        """One turn of the run loop: train a step, log it, then do what it calls for (a rollback,
        a stop, an evaluation, a checkpoint). bench/step_overhead.py times exactly this."""
        metrics, stop_requested, action = self.train_step()
        outcome = StepOutcome(loss=metrics.get("train/loss"))
        step = self.state.step
        always = step == self.total_steps or action.kind != "none"
        if always or step % self.cfg.train.log_interval == 0:
            console = always or step % max(1, self.cfg.logging.console_interval) == 0
            self.logger.log(step, metrics, console=console)
        if action.kind == "rollback":
            self.roll_back(action)
            outcome.rolled_back = True
            return outcome
        if action.kind == "stop":
            self.logger.info(f"STOPPING: {action.message}")
            self.save("stability stop")
            outcome.stability_stop = action.message
            return outcome
        if self.should_evaluate(step):
            self.evaluate()
        if stop_requested:
            why = self.stop.reason or "asked on another rank: a signal, or its launcher is gone"
            self.logger.event("signal_stop", step, self.state.tokens, f"stop requested ({why}): saving and exiting cleanly")
            self.save("signal")
            outcome.signal_stop = True
            return outcome
        if self.cfg.checkpoint.interval and step % self.cfg.checkpoint.interval == 0 and step < self.total_steps:
            self.save("interval")
        elif self.ring_due(step):
            self.save_recovery_checkpoint()
        return outcome

    def ring_due(self, step: int) -> bool:
        stab = self.cfg.stability
        interval = stab.recovery.ring_interval
        return stab.enabled and stab.action == "recover" and interval > 0 and step % interval == 0 \
            and step < self.total_steps

    def announce(self) -> None:
        cfg = self.cfg
        self.logger.info(
            f"run {cfg.name}: {format_count(cfg.train.tokens)} tokens = {self.total_steps} steps x "
            f"{format_count(self.tokens_per_step)} tokens/step ({cfg.train.global_batch_size} x {cfg.train.seq_len}); "
            f"{self.dist.world_size} rank(s) on {self.dist.device.type}{self.tensor_parallel_note()}, "
            f"micro batch {cfg.train.micro_batch_size}, "
            f"grad accum {self.engine.grad_accum} (summed in {self.engine.grad_accum_dtype}), "
            f"ZeRO {cfg.deepspeed.zero_stage}, {cfg.deepspeed.precision}"
        )

    def tensor_parallel_note(self) -> str:
        """`` (tensor-parallel T x data-parallel D)`` for the start line; empty without tensor parallelism."""
        if self.dist.tensor_parallel == 1:
            return ""
        return f" (tensor-parallel {self.dist.tensor_parallel} x data-parallel {self.dist.dp_size})"

    def should_evaluate(self, step: int) -> bool:
        train = self.cfg.train
        if not self.val_sets or step >= self.total_steps:
            return False  # the final evaluation runs after the loop
        return eval_due(step, train.eval_interval, train.eval_dense_interval, train.eval_dense_until)

    # -- one step -------------------------------------------------------------------------------
    def begin_step(self, step: int) -> float:
        """LR (schedule x stage policy x cool-down x injected fault) and clip for step `step`."""
        self.skip_recorded_ranges()
        self.stability.new_step()
        lr = lr_at(step, self.cfg.optim, self.total_steps)
        if self.mixer is not None:
            lr = self.mixer.lr(lr, self.cfg.optim.min_lr)
        lr *= self.stability.lr_factor(step)
        self.engine.set_lr(lr)
        if self.cfg.stability.clip.enabled:
            self.engine.set_grad_clip(self.stability.clip_threshold())
        faults = self.stability.injector.faults_at(step)
        if faults:
            self.logger.event("fault_injected", step + 1, self.state.tokens + self.tokens_per_step,
                              f"injected {', '.join(faults)} (stability.inject fire drill)", faults=faults)
        self.engine.withhold_next_update(False)
        return lr

    def injected_delay(self) -> None:
        """Fault drill (hang.inject_delay_s): one rank works slower, as a throttled GPU or a busy host would."""
        hang = self.cfg.hang
        if hang.inject_delay_s > 0 and self.dist.rank == hang.inject_rank:
            time.sleep(hang.inject_delay_s)

    def corrupt_batches(self, step: int, batches) -> None:
        """Fault injection: replace this step's tokens with uniformly random ones."""
        if not self.stability.injector.should_randomize_batch(step):
            return
        for index, batch in enumerate(batches):
            # Seeded by the data-parallel rank: the ranks of a tensor-parallel group must see the same tokens.
            noise = self.stability.injector.random_tokens(tuple(batch.input_ids.shape), self.cfg.model.vocab_size,
                                                          step * 1000 + index, self.dist.dp_rank)
            tokens = torch.from_numpy(noise).to(batch.input_ids.device)
            batch.input_ids.copy_(tokens)
            batch.labels[:, :-1].copy_(tokens[:, 1:])

    def loss_fault(self, step: int) -> float:
        """Fault injection: the factor this step's loss is multiplied by (NaN, a fp16-overflowing 1e30, or 1)."""
        injector = self.stability.injector
        if injector.should_nan_loss(step):
            return float("nan")
        if injector.should_force_overflow(step):
            return 1e30
        return 1.0

    def _update_gate(self) -> bool:
        """Asked inside the optimizer step, once DeepSpeed knows the global grad norm."""
        if self._pending is None:
            return True
        step, loss = self._pending
        action = self.stability.judge(step, loss, self.engine.current_grad_norm(), self.checkpoint_steps)
        return self.stability.allows_update(action)

    def train_step(self) -> tuple[dict[str, Any], bool, Action]:
        """One optimizer step over grad_accum micro-batches.

        Returns (metrics, stop agreed by all ranks, the stability action to carry out). The loss
        of the whole step is all-reduced before the optimizer update, so the stability decision
        (taken inside the update, when the grad norm is known) is the same on every rank.
        """
        step = self.state.step
        self.watchdog.beat(step, "train step")
        lr = self.begin_step(step)
        start = time.perf_counter()
        batches = self.loader.next_step()
        own = time.perf_counter() - start  # this rank's own work: its batch, then its forward passes (below)
        if self.mixer is not None:
            # The mixer advances over the samples this step trains before the step is judged, so a stage that
            # begins in it has its grace period from this very step. Events carry the step's 1-based number.
            self.log_curriculum_events(self.mixer.advance(self.loader.consumed_samples), step, step + 1,
                                       self.state.tokens + self.tokens_per_step)
        self.corrupt_batches(step, batches)
        num_domains = len(self.domain_names)
        # Per-domain [loss sum, sample count], plus the total loss sum and the stop flag: one
        # all-reduce per step carries everything the ranks must agree on or report.
        # Kept on the device: a .cpu() per micro-batch would make the host wait for the GPU each time.
        device = self.dist.device
        domain_sums = torch.zeros(2 * num_domains, dtype=torch.float64, device=device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        result = None
        telemetry: dict[str, float] = {}
        reduced = None
        before = None
        mean_loss = float("nan")
        fault = self.loss_fault(step)
        delay_start = time.perf_counter()
        self.injected_delay()
        own += time.perf_counter() - delay_start
        for index, batch in enumerate(batches):
            forward_start = time.perf_counter()
            out = self.engine.forward(batch.input_ids, batch.labels)
            own += time.perf_counter() - forward_start
            self.engine.backward(out.loss if fault == 1.0 else out.loss * fault)
            # The reported loss is the cross-entropy (no z-loss); an injected NaN shows in it too.
            logged = out.ce_loss * float("nan") if math.isnan(fault) else out.ce_loss
            loss_sum += logged.double()
            sample_loss = out.sample_loss.double()
            domains = batch.domains.to(device, non_blocking=True)
            domain_sums.index_add_(0, domains, sample_loss)
            domain_sums.index_add_(0, domains + num_domains, torch.ones_like(sample_loss))
            if index == len(batches) - 1:
                stop_flag = torch.tensor([1.0 if self.stop.received is not None else 0.0], dtype=torch.float64,
                                         device=device)
                self.watchdog.beat(step, "all-reduce")
                reduced = all_reduce_tensor(torch.cat([loss_sum.reshape(1), domain_sums, stop_flag]))
                # Over all ranks: the ranks of a tensor-parallel group computed the same loss on the same samples,
                # so each data-parallel batch counts tensor_parallel times, in the sum and in the divisor alike.
                mean_loss = float(reduced[0]) / (len(batches) * self.dist.world_size)
                self._pending = (step, mean_loss)
                telemetry, before = self.pre_update_telemetry(step)
            result = self.engine.micro_step() or result
        self._pending = None
        step_time = time.perf_counter() - start

        grad_norm = result.grad_norm if result is not None else None
        applied = bool(result is not None and result.applied and not self.engine.update_was_withheld())
        # DeepSpeed skipped the update itself (fp16 overflow, non-finite bf16 grads): judge now.
        # An fp16 overflow with a finite loss is the dynamic loss scaler at work, not a spike: the
        # watchdog owns those, so the detector judges that step on its loss alone.
        overflow = self.cfg.deepspeed.precision == "fp16" and result is not None and not result.applied \
            and math.isfinite(mean_loss)
        self.stability.judge(step, mean_loss, None if overflow else grad_norm, self.checkpoint_steps)
        action, events, reset_scale = self.stability.after_step(step, self.engine.loss_scale(), applied)
        if reset_scale is not None:
            self.engine.reset_loss_scale(reset_scale)
        if before is not None and applied:
            telemetry.update(group_metrics(update_to_weight_ratios(before, self.engine.full_fp32_params()),
                                           "stability/update_ratio/"))

        self.state.step += 1
        self.state.tokens += self.tokens_per_step
        self.state.wall_time += step_time
        if not applied:
            self.state.skipped_steps += 1
        metrics = self.step_metrics(mean_loss, lr, result, step_time)
        metrics.update(self.stability.metrics(step))
        metrics.update(telemetry)
        counts = reduced[1 + num_domains:1 + 2 * num_domains]
        for index, name in enumerate(self.domain_names):
            if counts[index] > 0:
                metrics[f"train/loss/{name}"] = float(reduced[1 + index] / counts[index])
        if self.mixer is not None:
            metrics.update(self.mixer.metrics())
        for event in events:
            self.log_stability_event(event)
        self.log_histogram(step)
        self.stragglers.record(own)
        if self.stragglers.due(self.state.step):
            straggler_metrics, straggler = self.stragglers.report()
            metrics.update(straggler_metrics)
            if straggler:
                self.logger.event("straggler", self.state.step, self.state.tokens, straggler)
        return metrics, bool(reduced[-1] > 0), action

    def log_histogram(self, step: int) -> None:
        telemetry = self.cfg.stability.telemetry
        if telemetry.histogram_interval > 0 and step % telemetry.histogram_interval == 0 and step > 0:
            counts, edges = log10_histogram(self.stability.percentiles.values(), telemetry.histogram_bins)
            self.logger.histogram(self.state.step, "opt/grad_norm_log10_hist", counts, edges)

    def pre_update_telemetry(self, step: int) -> tuple[dict[str, float], dict | None]:
        """Every telemetry.group_norm_interval steps: grad norm per group, and weights before the update.

        Runs on every rank between the last backward and the update: under ZeRO the full
        gradients and fp32 weights are gathered from their partitions (collective).
        """
        interval = self.cfg.stability.telemetry.group_norm_interval
        if interval <= 0 or step % interval:
            return {}, None
        metrics = group_metrics(group_grad_norms(self.engine.named_full_grads(), layer_groups), "opt/grad_norm/")
        before = self.engine.full_fp32_params() if self.cfg.stability.telemetry.update_ratio else None
        return metrics, before

    def log_stability_event(self, event: dict[str, Any]) -> None:
        """Stability components count steps from 0 (step k runs on checkpoint k's weights); events and
        metrics report the steps done after it (k + 1), like the progress line."""
        event = dict(event)
        kind, step, message = event.pop("event"), event.pop("step"), event.pop("message")
        tokens = (step + 1) * self.tokens_per_step
        self.logger.event(kind, step + 1, tokens, message, **event)

    # -- recovery -------------------------------------------------------------------------------
    def roll_back(self, action: Action) -> None:
        """Load checkpoint `to_step`, skip the batches around the spike, cool the LR, carry on.

        The stability history (recovery count, bad steps, cool-down) stays as it is in memory:
        the checkpoint predates the spike and must not make the run forget it. Checkpoints of
        the abandoned timeline are deleted and the recovered state is saved at once, so a crash
        from here on resumes after the skip, never before it.
        """
        began = time.perf_counter()
        to_step = int(action.to_step)
        self.drain_checkpoints(prune=False)  # nothing in flight while folders are loaded and dropped
        root = self.checkpoint_root_of(to_step)
        with self.watchdog.phase(self.state.step, "checkpoint load"):
            shared, _ = self.checkpointer.load(self.engine, tag_for(to_step), root=root)
        self.load_shared_state(shared, with_stability=False)
        self.drop_checkpoints_after(to_step)
        self.skip_batches(action.skip_batches)
        if action.reset_loss_scale is not None:
            self.engine.reset_loss_scale(action.reset_loss_scale)
        self.apply_optimizer_overrides()
        self.stability.rewound(to_step)
        self.save("after rollback")
        latency = time.perf_counter() - began  # detection -> training again, the save included
        self.logger.event("recovered", to_step, self.state.tokens,
                          f"rolled back to step {to_step} ({root.name}), skipped {action.skip_batches} batches, "
                          f"LR x{action.lr_factor:g} cooling over {action.cooldown_steps} steps; "
                          f"training again after {latency:.1f}s", latency_s=latency, to_step=to_step,
                          skip_batches=action.skip_batches)
        self.logger.set_progress(self.total_steps, self.state.step)

    def drop_checkpoints_after(self, step: int) -> None:
        """Delete checkpoints of the abandoned timeline (later than the rollback target)."""
        if self.dist.is_main:
            for root in (self.checkpointer.root, self.ring.root):
                for tag in complete_tags(root):
                    if step_of(tag) > step:
                        shutil.rmtree(root / tag, ignore_errors=True)
        barrier()
        self.refresh_checkpoint_steps()

    def apply_optimizer_overrides(self) -> None:
        overrides = self.stability.policy.optimizer_overrides()
        if overrides:
            self.engine.set_adam_hparams(eps=overrides.get("eps"), beta1=overrides.get("beta1"))

    def log_curriculum_events(self, events, first_step: int, at_step: int, tokens: int) -> None:
        """Log the mixer's events at `at_step`; a stage switch starts the detector's grace period at `first_step`,
        the first step that trains the new stage (the loss jumps at a switch and settles quickly)."""
        for event in events:
            if event.kind == "stage_switch":
                self.stability.detector.note_stage_switch(first_step)
            self.logger.event(event.kind, at_step, tokens, event.message, **event.fields)

    def add_skips(self, ranges) -> None:
        self.skips = [tuple(r) for r in merge_ranges([*self.skips, *[tuple(r) for r in ranges]])]

    def skip_recorded_ranges(self) -> None:
        """After restoring a position older than a recorded skip, jump over the skipped batches again
        when the stream reaches them (checked every step: a few range comparisons)."""
        self.skip_batches(batches_due(self.skips, self.loader.consumed_samples, self.loader.global_batch))

    def skip_batches(self, num_batches: int) -> None:
        """Advance the data stream past `num_batches` global batches that will never be trained on."""
        if num_batches <= 0:
            return
        start = self.loader.consumed_samples
        self.loader.skip(num_batches)
        self.add_skips([(start, self.loader.consumed_samples)])
        if self.mixer is not None:
            self.log_curriculum_events(self.mixer.skip(num_batches), self.state.step, self.state.step, self.state.tokens)
        else:
            self.logger.event("batches_skipped", self.state.step, self.state.tokens,
                              f"skipped {num_batches} batch(es): global samples [{start:,}, "
                              f"{self.loader.consumed_samples:,}) will never be trained on",
                              skip_start=start, skip_stop=self.loader.consumed_samples, batches=num_batches)
        if self.dist.is_main:
            self.skip_ledger.save([list(r) for r in self.skips])

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

        Data-parallel rank r of W takes samples r, r+W, r+2W, ... (the ranks of a tensor-parallel group
        take the same ones: they compute one forward together); ranks with one sample fewer pad with a
        weight-0 repeat, because every rank must run the same number of forwards (ZeRO-3 gathers
        parameters collectively). The result is the same mean at any world size: the all-reduce counts
        each sample once per tensor-parallel rank, in the sums and in the weights alike.
        """
        count = min(self.cfg.train.eval_samples, available)
        world, micro = self.dist.dp_size, self.cfg.train.micro_batch_size
        mine = list(range(self.dist.dp_rank, count, world))
        per_rank = math.ceil(count / world)
        per_rank = math.ceil(per_rank / micro) * micro
        weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
        ids = mine + [0] * (per_rank - len(mine))
        return [(ids[i:i + micro], weights[i:i + micro]) for i in range(0, per_rank, micro)]

    def _validation_losses(self, forward) -> dict[str, float]:
        """Mean loss of `forward(inputs, labels)` over the first eval_samples samples of each set."""
        results: dict[str, float] = {}
        for name, samples in self.val_sets.items():
            total = torch.zeros(2, dtype=torch.float64)
            for ids, weights in self.eval_batches(len(samples)):
                tokens = torch.from_numpy(np.stack([samples.sample(i) for i in ids]).astype(np.int64))
                tokens = tokens.to(self.dist.device)
                out = forward(tokens[:, :-1], tokens[:, 1:])
                weights = torch.tensor(weights, dtype=torch.float64)
                total += torch.stack([(out.sample_loss.double().cpu() * weights).sum(), weights.sum()])
            total = all_reduce_tensor(total)
            results[name] = float(total[0] / total[1])
        return results

    def fp32_validation_losses(self) -> dict[str, float]:
        """The same evaluation with a full fp32 copy of the weights (DALL-E Mega: bf16 and fp32
        evaluations drifted apart late in training). Collective under ZeRO-3."""
        from pretrain.model.llama import Llama

        weights = self.engine.full_fp32_params()
        model = Llama(self.cfg.model).to(self.dist.device)
        missing = model.load_state_dict(weights, strict=False).missing_keys  # a tied lm_head is the embedding
        if set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"fp32 precision check: weights missing for {sorted(missing)}")
        model.eval()
        return self._validation_losses(lambda inputs, labels: model(inputs, labels))

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean loss over the first eval_samples samples of each validation set (+ the fp32 check)."""
        self.engine.eval()
        with self.watchdog.phase(self.state.step, "evaluation"):
            results = self._validation_losses(self.engine.forward)
        self.engine.train()
        self.evaluations += 1
        if results:
            metrics = {f"val/{name}/loss": value for name, value in results.items()}
            metrics["val/loss"] = sum(results.values()) / len(results)
            metrics["tokens"] = self.state.tokens
            every = self.cfg.stability.precision_check_every
            if every > 0 and self.cfg.deepspeed.precision != "fp32" and self.evaluations % every == 0:
                for name, value in self.fp32_validation_losses().items():
                    metrics[f"val/{name}/loss_fp32"] = value
                    metrics[f"val/{name}/fp32_gap"] = results[name] - value
            self.logger.log(self.state.step, metrics, console=False)
            self.logger.info("eval @ step {}: {}".format(
                self.state.step, ", ".join(f"{name} {value:.4f}" for name, value in results.items())))
        barrier()
        return results


def _tp(tensor_parallel: int) -> str:
    """` (tensor-parallel T)` after a rank count in resume messages; empty without tensor parallelism."""
    return f" (tensor-parallel {tensor_parallel})" if tensor_parallel > 1 else ""


def _knobs(cfg: AyumiConfig) -> dict[str, Any]:
    """Current values of the settings a stability stop message may advise changing."""
    return {"optim.lr": cfg.optim.lr, "optim.warmup_steps": cfg.optim.warmup_steps,
            "stability.clip.enabled": cfg.stability.clip.enabled, "optim.eps": cfg.optim.eps,
            "model.embedding_grad_alpha": cfg.model.embedding_grad_alpha, "model.z_loss": cfg.model.z_loss,
            "model.qk_norm": cfg.model.qk_norm}
