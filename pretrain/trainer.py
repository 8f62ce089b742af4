"""The training loop: steps, the stability machinery's actions, checkpoints, signals, metrics.

Run length is a token budget; the step count is derived from it and announced before step 1.
Everything that must survive a restart (engine, data position, counters, RNG) goes into the
checkpoint, so a resumed run produces the same per-step losses as an uninterrupted one.
Decisions that change control flow (stop on a signal) are agreed by all ranks first.

What plugs in: the validation `Evaluator` and the `DownstreamEvaluator` (pretrain/evaluation.py), per-step hooks (pretrain/hooks.py:
telemetry, histograms, stragglers), the fire drills (pretrain/fault_drills.py) and the run's checkpoints with
their rollback ring (pretrain/checkpoint/ring.py). The update gate stays here: the stability machinery judges
a step inside DeepSpeed's optimizer step, once the global grad norm is known.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from curriculum.mixer import Mixer
from data.packed import PackedSamples
from pretrain.checkpoint.checkpointer import Checkpointer, resharded_note
from pretrain.checkpoint.ring import RunCheckpoints
from pretrain.checkpoint.trust import Loaded, report
from pretrain.config import AyumiConfig, advisable_settings
from pretrain.engine.distributed import DistInfo, all_reduce_tensor, barrier, broadcast_object
from pretrain.engine.train_engine import TrainEngine
from pretrain.evaluation import DownstreamEvaluator, DownstreamTasks, Evaluator
from pretrain.fault_drills import FaultDrills
from pretrain.hooks import HistogramHook, StepHook, StepReport, StragglerHook, TelemetryHook
from pretrain.job.hang_watchdog import HangWatchdog, StragglerMonitor
from pretrain.job.signals import StopSignal
from pretrain.loader import BatchLoader
from pretrain.metrics import NullLogger, format_count
from pretrain.model.documents import span_sum
from pretrain.model.flops import flops_per_token
from pretrain.plan.lr_schedule import LengthHistory, history_as_record, history_from_record, scheduled_lr, with_length
from pretrain.progress import StepFigures, start_line, step_metrics
from pretrain.stability.policy import Action, ring_checkpoints_to_delete
from pretrain.excluded import ExcludedData
from pretrain.skips import SkippedData
from pretrain.stages import model_in_stage, rope_fields
from pretrain.stability.recovery import StabilityMonitor


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
    lengths: list = field(default_factory=list)
    """The run's lengths so far (pretrain/plan/lr_schedule.py's LengthHistory as recorded): the LR schedule's
    history. Empty in a checkpoint saved before it was recorded."""


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


class Trainer:
    """Owns the loop; built by pretrain.train.build_trainer. `hooks` add per-step concerns (pretrain/hooks.py)."""

    def __init__(self, cfg: AyumiConfig, dist: DistInfo, engine: TrainEngine, loader: BatchLoader,
                 val_sets: dict[str, PackedSamples], logger: NullLogger, checkpointer: Checkpointer,
                 total_steps: int, run_meta: dict[str, Any], watchdog: HangWatchdog | None = None,
                 hooks: list[StepHook] | None = None, downstream: DownstreamTasks | None = None):
        self.cfg = cfg
        # The hang watchdog hears of progress; without one (benchmarks, tests) a disabled stand-in.
        self.watchdog = watchdog or HangWatchdog(replace(cfg.hang, enabled=False), Path(cfg.run_dir), dist.rank,
                                                 dist.world_size)
        self.dist = dist
        self.engine = engine
        self.loader = loader
        self.logger = logger
        self.total_steps = total_steps
        self.run_meta = run_meta
        self.state = TrainState()
        self.lengths: LengthHistory = history_from_record(None, total_steps)  # a fresh run's; a resume's below
        self.state.lengths = history_as_record(self.lengths)
        self.domain_names = list(loader.source.domain_names)
        self.figures = StepFigures.of(cfg, dist)  # what the step's metrics derive from (pretrain/progress.py)
        self.stop = StopSignal()
        self.mixer = loader.source if isinstance(loader.source, Mixer) else None
        self.skipped = SkippedData(Path(cfg.run_dir), loader, self.mixer, dist.is_main)
        self.excluded = ExcludedData(Path(cfg.run_dir), loader.source, dist.is_main)
        stab = cfg.stability
        if cfg.deepspeed.precision != "fp16":  # there is no loss scale to reset (or to mention)
            stab = replace(stab, recovery=replace(stab.recovery, reset_loss_scale=False))
        self.stability = StabilityMonitor(stab, cfg.optim.grad_clip, cfg.deepspeed.min_loss_scale,
                                          knobs=advisable_settings(cfg))
        ring_interval = stab.recovery.ring_interval if stab.enabled and stab.action == "recover" else 0
        self.checkpoints = RunCheckpoints(checkpointer, dist.is_main, barrier, broadcast_object, ring_interval,
                                          self.stability, cfg.checkpoint.on_corrupt)
        self.evaluator = Evaluator(cfg, dist, engine, val_sets, logger, self.watchdog, total_steps)
        self.downstream = DownstreamEvaluator(cfg, dist, engine, downstream or DownstreamTasks(), logger, self.watchdog,
                                              total_steps)
        self.drills = FaultDrills(cfg, dist, self.stability.injector, logger, self.figures.tokens_per_step)
        stragglers = StragglerMonitor(cfg.hang, self._gather_per_rank)
        self.hooks: list[StepHook] = [TelemetryHook(cfg, engine), HistogramHook(cfg, logger, self.stability.percentiles),
                                      StragglerHook(stragglers, logger), *(hooks or [])]
        self._pending: tuple[int, float, dict] | None = None  # (step, all-reduced loss, domain losses) for the gate
        self._stage: int | None = None  # the curriculum stage the last step began in (follow_stage)
        self._batch_losses: tuple[int, list] = (0, [])  # (the step's first sample, [(micro batch's first, losses)])
        if stab.enabled:
            engine.set_update_gate(self._update_gate)
            if not engine.can_withhold_updates:
                logger.info("note: with ZeRO-Offload's CPU Adam ayumi cannot withhold single updates; "
                            "spikes still roll back, and DeepSpeed skips overflow steps itself")

    # -- state ----------------------------------------------------------------------------------
    def shared_state(self) -> dict[str, Any]:
        shared = {"train": asdict(self.state), "loader": self.loader.state_dict(),
                  "stability": self.stability.state_dict(), "skips": self.skipped.state(),
                  "excluded": self.excluded.state()}
        if self.mixer is not None:
            shared["mixer"] = self.mixer.state_dict()
        else:  # all domains shuffled: the data's shape, so a resume notices changed data as the mixer does
            shared["data"] = self.loader.source.state_dict()
        return shared

    def load_shared_state(self, shared: dict[str, Any], with_stability: bool = True) -> None:
        """Restore counters, data position and (unless rolling back in-process) the stability history. A rollback
        keeps the run's lengths as they are: a change made at this session's resume stays the run's schedule."""
        lengths = self.state.lengths
        self.state = TrainState(**shared["train"])
        if not with_stability:
            self.state.lengths = lengths
        self.loader.load_state_dict(shared["loader"])
        self.skipped.add(shared.get("skips", []))
        self.excluded.add(shared.get("excluded", []))
        if self.mixer is not None and "mixer" in shared:
            self.mixer.load_state_dict(shared["mixer"])
            self.skipped.add([])  # the mixer's state holds its own ranges: the run's join them
        elif self.mixer is None and "data" in shared:
            self.loader.source.load_state_dict(shared["data"])
        if with_stability and "stability" in shared:
            self.stability.load_state_dict(shared["stability"])

    def resume_if_possible(self, resumed: Loaded | None, lengths: list | None = None) -> int | None:
        """Take over what pretrain.checkpoint.trust.resume_start loaded; the resumed step, None for a fresh start.

        `lengths`: the run's lengths as decided before launch (pretrain/startup/resume.py), for a checkpoint that
        predates their record. A changed train.tokens becomes a new length from this step on (no LR jump)."""
        if resumed is None:
            return None
        self.load_shared_state(resumed.shared)
        self.settle_lengths(lengths)
        self.apply_optimizer_overrides()
        self.checkpoints.note_resume(resumed)
        report(resumed.notes, self.logger, self.state.step, self.state.tokens)
        self.logger.info(f"resumed from {resumed.path} at step {self.state.step} ({format_count(self.state.tokens)} "
                         f"tokens){resharded_note(resumed.meta, self.dist.world_size, self.dist.tensor_parallel)}")
        return self.state.step

    def settle_lengths(self, lengths: list | None) -> None:
        """The run's LR schedule history after a resume: the checkpoint's, this config's length added at this step.
        A run started from another run's checkpoint (checkpoint.load_from) has a schedule of its own."""
        recorded = None if self.cfg.checkpoint.load_from else (self.state.lengths or lengths)
        history = history_from_record(recorded, self.total_steps)
        self.lengths = with_length(history, self.cfg.optim, self.state.step, self.total_steps)
        self.state.lengths = history_as_record(self.lengths)

    def checkpoint_meta(self, shared: dict[str, Any]) -> dict[str, Any]:
        """ayumi.json's description of a checkpoint: the run's (model, layout, tokenizer, config) and where it
        stands, what a resume decides from before any rank starts (pretrain/startup/resume.py)."""
        started = len(shared["mixer"]["stages"]) if "mixer" in shared else 0
        return {**self.run_meta, "tokens": self.state.tokens, "lengths": self.state.lengths, "started_stages": started}

    def _gather_per_rank(self, value: float) -> list[float]:
        """Every rank's `value`, in rank order (one small all-reduce)."""
        slots = torch.zeros(self.dist.world_size, dtype=torch.float64, device=self.dist.device)
        slots[self.dist.rank] = value
        return all_reduce_tensor(slots).tolist()

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, reason: str) -> None:
        start = time.perf_counter()
        with self.watchdog.phase(self.state.step, "checkpoint save"):
            shared = self.shared_state()
            path = self.checkpoints.save(self.engine, self.state.step, shared, self.checkpoint_meta(shared))
        how = "staged; writing in the background" if self.checkpoints.long_term.async_writes else "saved"
        self.logger.info(f"{how} checkpoint {path} ({reason}, {time.perf_counter() - start:.1f}s)")

    def drain_checkpoints(self, prune: bool = True) -> None:
        """Wait for background checkpoint writes (all ranks): before a rollback, a stop, the end."""
        if not self.checkpoints.writing():
            return
        with self.watchdog.phase(self.state.step, "checkpoint save"):
            done = self.checkpoints.drain(prune=prune)
        for path, waited in done:
            self.logger.info(f"checkpoint {path} is written ({waited:.1f}s waited)")

    def save_recovery_checkpoint(self) -> None:
        """The cheap, frequent ring that makes a rollback >= rollback_steps back always possible."""
        step = self.state.step
        if self.stability.in_episode(step):
            return  # weights taken during an outlier episode are never a rollback target
        rec = self.cfg.stability.recovery

        def to_delete(ring_steps: list[int]) -> list[int]:
            return ring_checkpoints_to_delete(ring_steps, rec.ring_keep, step, rec.rollback_steps,
                                              self.stability.policy.bad_steps, self.stability.detector.low_point())

        with self.watchdog.phase(step, "checkpoint save"):
            shared = self.shared_state()
            self.checkpoints.save_ring(self.engine, step, shared, self.checkpoint_meta(shared), to_delete)

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        self.announce()
        self.stop.install(handle_signals=self.cfg.checkpoint.save_on_signal)
        self.logger.set_progress(self.total_steps, self.state.step)
        self.checkpoints.refresh()  # every complete checkpoint, long-term and ring, on every rank
        self.engine.train()
        last_loss: float | None = None
        outcome = StepOutcome(loss=None)
        max_steps = self.cfg.train.max_steps
        start_step = self.state.step
        if start_step >= self.total_steps:
            self.logger.info(f"run {self.cfg.name} is already complete ({start_step} steps); nothing to do")
        else:
            self.exclude_documents()
            self.feed_from(self.cfg.stability.inject.feed_sample)
            self.note_session()
            if start_step == 0 and self.cfg.checkpoint.save_initial and 0 not in self.checkpoints.steps:
                self.save("initial")
        if self.downstream.at_start(start_step):
            self.downstream.run(0, 0)
        try:
            while self.state.step < self.total_steps and not (max_steps and self.state.step >= max_steps):
                outcome = self.step_once()
                last_loss = outcome.loss if outcome.loss is not None else last_loss
                if outcome.stability_stop is not None or outcome.signal_stop:
                    break
            else:
                if self.cfg.checkpoint.save_final and self.state.step > start_step:
                    self.save("final")
            stopped = outcome.signal_stop or outcome.stability_stop is not None
            val = {} if stopped or not self.evaluator.val_sets else self.evaluate()
            if not stopped and self.state.step > start_step:  # a run found complete is not scored again
                self.downstream.final(self.state.step, self.state.tokens)
            self.drain_checkpoints()
        finally:
            self.stop.restore()
            self.loader.close()
        return TrainResult(self.state.step, self.state.tokens, outcome.signal_stop, last_loss,
                           stopped_by_stability=outcome.stability_stop, val_losses=val)

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
            if not self.checkpoints.discard_if_blamed(step):  # right after a resume: nothing of this state is kept
                self.save("stability stop")
            outcome.stability_stop = action.message
            return outcome
        if self.evaluator.due(step):
            self.evaluate()
        if self.downstream.due(step):
            self.downstream.run(step, self.state.tokens)
        if stop_requested:
            why = self.stop.reason or "asked on another rank: a signal, or its launcher is gone"
            self.logger.event("signal_stop", step, self.state.tokens, f"stop requested ({why}): saving and exiting cleanly")
            self.save("signal")
            outcome.signal_stop = True
            return outcome
        if self.cfg.checkpoint.interval and step % self.cfg.checkpoint.interval == 0 and step < self.total_steps:
            self.save("interval")
        elif self.checkpoints.ring_due(step, self.total_steps):
            self.save_recovery_checkpoint()
        return outcome

    def evaluate(self) -> dict[str, float]:
        return self.evaluator.run(self.state.step, self.state.tokens)

    def exclude_documents(self) -> None:
        """data.exclude's new documents leave the stream from this session's first sample on; the run's earlier
        exclusions (its checkpoint's, its ledger's) stay (pretrain/excluded.py)."""
        position = self.loader.consumed_samples
        new = self.excluded.begin(self.cfg.data.exclude, position)
        if new is not None:
            self.logger.event("data_excluded", self.state.step, self.state.tokens,
                              f"data.exclude: {len(new.documents)} document(s) left out from global sample "
                              f"{position:,} on", from_sample=position, documents=[list(d) for d in new.documents])

    def feed_from(self, position: int) -> None:
        """A replay arm (`ayumi replay`): this session's first step reads from stream `position`, not from the
        checkpoint's; the mixer's stage follows it. -1: the checkpoint's position."""
        if position < 0:
            return
        self.loader.load_state_dict({"consumed_samples": position})
        # The spike's batches may lie in a range a later rollback skipped (a checkpoint saved after it holds it):
        # a replay trains what it is fed, so no range from here on is jumped.
        self.skipped.forget_from(position)
        if self.mixer is not None:
            self.mixer.position = position
        self.logger.info(f"replay: training from global sample {position:,} (stability.inject.feed_sample)")

    def note_session(self) -> None:
        """The `session` event: the batch layout and stream position this session trains from, which
        pretrain/step_samples.py reads to say which samples each step trained on (and on which rank)."""
        loader = self.loader
        self.logger.event("session", self.state.step, self.state.tokens,
                          f"training from step {self.state.step + 1:,} on {loader.world_size} data-parallel rank(s) x "
                          f"{loader.grad_accum} micro batch(es) of {loader.micro_batch}, from global sample "
                          f"{loader.consumed_samples:,}", world_size=self.dist.world_size, dp_size=loader.world_size,
                          micro_batch=loader.micro_batch, grad_accum=loader.grad_accum,
                          global_batch=loader.global_batch, first_sample=loader.consumed_samples)

    def announce(self) -> None:
        self.logger.info(start_line(self.cfg, self.dist, self.total_steps, self.figures, self.engine.grad_accum,
                                    self.engine.grad_accum_dtype))

    # -- one step -------------------------------------------------------------------------------
    def begin_step(self, step: int) -> float:
        """LR (schedule x stage policy x cool-down x injected fault) and clip for step `step`."""
        self.skip_recorded_ranges()
        if self.mixer is not None:
            self.follow_stage(self.mixer.stage_index())
        self.stability.new_step()
        lr = scheduled_lr(step, self.cfg.optim, self.lengths)
        if self.mixer is not None:
            lr = self.mixer.lr(lr, self.cfg.optim.min_lr)
        lr *= self.stability.lr_factor(step)
        replayed = self.stability.injector.lr_set_at(step)  # a replay arm trains at the LR the spike's step had
        lr = lr if replayed is None else replayed
        self.engine.set_lr(lr)
        if self.cfg.stability.clip.enabled:
            self.engine.set_grad_clip(self.stability.clip_threshold())
        self.engine.withhold_next_update(False)
        return lr

    def follow_stage(self, index: int) -> None:
        """A step begins in curriculum stage `index`: its RoPE and sample length from now on (pretrain/stages.py).

        The batches take the stage's length from the loader; here the model's RoPE tables, the checkpoints'
        model record and the FLOP count follow. A rollback into an earlier stage comes back through here.
        """
        if index == self._stage:
            return
        self._stage = index
        model = model_in_stage(self.cfg.model, self.cfg.curriculum.stages, index)
        rope = rope_fields(model)
        if any(self.run_meta["model"][key] != value for key, value in rope.items()):
            self.engine.set_rope(model)
            self.run_meta["model"].update(rope)
            self.logger.info(f"stage {index + 1}: RoPE theta {model.rope_theta:g}, scaling "
                             f"{model.rope_scaling.type} (factor {model.rope_scaling.factor:g}) from this step on")
        length = self.mixer.schedule.stage_seq_lens[index]
        if length != self.figures.seq_len:
            self.figures = replace(self.figures, seq_len=length, flops_per_token=flops_per_token(model, length))

    def _update_gate(self) -> bool:
        """Asked inside the optimizer step, once DeepSpeed knows the global grad norm."""
        if self._pending is None:
            return True
        step, loss, domains = self._pending
        action = self.stability.judge(step, loss, self.engine.current_grad_norm(), self.checkpoints.steps, domains)
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
        self._batch_losses = (self.loader.consumed_samples, [])  # a spike event names the step's samples from these
        batches = self.loader.next_step()
        own = time.perf_counter() - start  # this rank's own work: its batch, then its forward passes (below)
        if self.mixer is not None:
            # The mixer advances over the samples this step trains before the step is judged, so a stage that
            # begins in it has its grace period from this very step. Events carry the step's 1-based number.
            self.log_curriculum_events(self.mixer.advance(self.loader.consumed_samples), step, step + 1,
                                       self.state.tokens + self.figures.tokens_per_step)
        fault, delayed = self.drills.apply(step, batches, self.state.tokens)
        own += delayed
        # Per-domain [loss sum, sample count], the total loss sum and the stop flag: one all-reduce per step
        # carries everything the ranks must agree on or report. Kept on the device until then.
        device, num_domains = self.dist.device, len(self.domain_names)
        sums = torch.zeros(3 + 2 * num_domains, dtype=torch.float64, device=device)  # [-2]: document spans
        result = None
        for index, batch in enumerate(batches):
            forward_start = time.perf_counter()
            out = self.engine.forward(batch.input_ids, batch.labels)
            own += time.perf_counter() - forward_start
            self.engine.backward(out.loss if fault == 1.0 else out.loss * fault)
            # The reported loss is the cross-entropy (no z-loss); an injected NaN shows in it too.
            sums[0] += (out.ce_loss * float("nan") if math.isnan(fault) else out.ce_loss).double()
            sample_loss, domains = out.sample_loss.double(), batch.domains.to(device, non_blocking=True)
            self._batch_losses[1].append((batch.first_sample, sample_loss.detach()))
            sums[1:1 + num_domains].index_add_(0, domains, sample_loss)
            sums[1 + num_domains:1 + 2 * num_domains].index_add_(0, domains, torch.ones_like(sample_loss))
            if self.figures.document_end is not None:  # the attention's FLOPs follow the documents
                sums[-2] += span_sum(batch.input_ids, self.figures.document_end)
            if index == len(batches) - 1:
                sums[-1] = 1.0 if self.stop.received is not None else 0.0
                self.watchdog.beat(step, "all-reduce")
                reduced = all_reduce_tensor(sums)
                # Over all ranks: the ranks of a tensor-parallel group computed the same loss on the same samples,
                # so each data-parallel batch counts tensor_parallel times, in the sum and in the divisor alike; a
                # sequence-parallel group's ranks hold shares that average to the batch's loss (Llama.loss_from_tokens).
                mean_loss = float(reduced[0]) / (len(batches) * self.dist.world_size)
                domains = domain_losses(reduced, self.domain_names)
                self._pending = (step, mean_loss, domains)
                for hook in self.hooks:
                    hook.before_update(step)
            result = self.engine.micro_step() or result
        self._pending = None
        step_time = time.perf_counter() - start
        applied, action = self.judge_step(step, mean_loss, result, domains)
        self.state.step += 1
        self.state.tokens += self.figures.tokens_per_step
        self.state.wall_time += step_time
        self.state.skipped_steps += 0 if applied else 1
        metrics = step_metrics(self.figures, mean_loss, lr, result, step_time, reduced, self.state.skipped_steps,
                               self.state.tokens, self.domain_names, self.stability.metrics(self.state.step - 1),
                               self.mixer.metrics() if self.mixer is not None else {})
        metrics["train/seq_len"] = int(batches[0].input_ids.shape[-1])  # a curriculum stage may set its own
        report = StepReport(step, self.state.step, self.state.tokens, own, applied, metrics)
        for hook in self.hooks:
            hook.after_step(report)
        return metrics, bool(reduced[-1] > 0), action

    def judge_step(self, step: int, mean_loss: float, result, domains: dict | None = None) -> tuple[bool, Action]:
        """The stability machinery's verdict on a finished step: (update applied, the action to carry out).
        domains: each domain's mean loss and sample count (all-reduced), for the mix-adjusted loss."""
        grad_norm = result.grad_norm if result is not None else None
        applied = bool(result is not None and result.applied and not self.engine.update_was_withheld())
        # DeepSpeed skipped the update itself (fp16 overflow, non-finite bf16 grads): judge now.
        # An fp16 overflow with a finite loss is the dynamic loss scaler at work, not a spike: the
        # watchdog owns those, so the detector judges that step on its loss alone.
        overflow = self.cfg.deepspeed.precision == "fp16" and result is not None and not result.applied \
            and math.isfinite(mean_loss)
        self.stability.judge(step, mean_loss, None if overflow else grad_norm, self.checkpoints.steps, domains)
        action, events, reset_scale = self.stability.after_step(step, self.engine.loss_scale(), applied)
        if reset_scale is not None:
            self.engine.reset_loss_scale(reset_scale)
        for event in events:
            if event["event"] == "spike":  # every rank has the same events: the gather below is collective
                event.update(self.spike_batch())
            self.log_stability_event(event)
        return applied, action

    def spike_batch(self) -> dict[str, Any]:
        """The step's samples with their losses, its highest-loss samples with their documents and its domain mix
        against the stage's weights (pretrain/step_samples.py), for the spike event. One all-reduce of the global
        batch's per-sample losses; only when the detector calls a spike."""
        from pretrain.step_samples import Layout, spike_batch_record

        first, micro_losses = self._batch_losses
        loader = self.loader
        slots = torch.zeros(2, loader.global_batch, dtype=torch.float64, device=self.dist.device)
        for micro_first, losses in micro_losses:
            stride = loader.source.sample_slots(micro_first)
            at = micro_first - first + stride * torch.arange(len(losses), device=self.dist.device)
            slots[0, at] += losses
            slots[1, at] += 1.0
        slots = all_reduce_tensor(slots)  # the ranks of a tensor- or sequence-parallel group add the same samples
        present = torch.nonzero(slots[1] > 0).flatten().tolist()
        losses = {first + offset: float(slots[0, offset] / slots[1, offset]) for offset in present}
        layout = Layout(self.state.step, first, loader.world_size, loader.micro_batch, loader.grad_accum,
                        loader.global_batch)
        return spike_batch_record(loader.source, layout, first, losses)

    def log_stability_event(self, event: dict[str, Any]) -> None:
        """Stability components count steps from 0 (step k runs on checkpoint k's weights); events and
        metrics report the steps done after it (k + 1), like the progress line."""
        event = dict(event)
        kind, step, message = event.pop("event"), event.pop("step"), event.pop("message")
        tokens = (step + 1) * self.figures.tokens_per_step
        self.logger.event(kind, step + 1, tokens, message, **event)

    # -- recovery -------------------------------------------------------------------------------
    def roll_back(self, action: Action) -> None:
        """Load checkpoint `to_step` (verified; the newest older one that verifies if it is damaged), skip the
        batches around the spike, cool the LR, carry on. The stability history (recovery count, bad steps, cool-down)
        stays as it is in memory: the checkpoint predates the spike and must not make the run forget it. Checkpoints
        of the abandoned timeline are deleted and the recovered state is saved at once, so a crash from here on
        resumes after the skip, never before it."""
        began = time.perf_counter()
        self.drain_checkpoints(prune=False)  # nothing in flight while folders are loaded and dropped
        with self.watchdog.phase(self.state.step, "checkpoint load"):
            loaded = self.checkpoints.load(self.engine, int(action.to_step))  # an older one if that one is damaged
        report(loaded.notes, self.logger, self.state.step, self.state.tokens)
        to_step = loaded.step
        self.load_shared_state(loaded.shared, with_stability=False)
        self.checkpoints.drop_after(to_step)
        self.skip_batches(action.skip_batches)
        if action.reset_loss_scale is not None:
            self.engine.reset_loss_scale(action.reset_loss_scale)
        self.apply_optimizer_overrides()
        self.stability.rewound(to_step)
        self.save("after rollback")
        latency = time.perf_counter() - began  # detection -> training again, the save included
        self.logger.event("recovered", to_step, self.state.tokens,
                          f"rolled back to step {to_step} ({loaded.root.name}), skipped {action.skip_batches} batches, "
                          f"LR x{action.lr_factor:g} cooling over {action.cooldown_steps} steps; "
                          f"training again after {latency:.1f}s", latency_s=latency, to_step=to_step,
                          skip_batches=action.skip_batches, first_sample=self.loader.consumed_samples)
        self.logger.set_progress(self.total_steps, self.state.step)

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

    def skip_recorded_ranges(self) -> None:
        """After restoring a position older than a recorded skip, jump over the skipped batches again
        when the stream reaches them (checked every step: a few range comparisons)."""
        self.skip_batches(self.skipped.due())

    def skip_batches(self, num_batches: int) -> None:
        """Advance the data stream past `num_batches` global batches that will never be trained on."""
        if num_batches <= 0:
            return
        start, stop, events = self.skipped.skip(num_batches)
        if self.mixer is not None:
            self.log_curriculum_events(events, self.state.step, self.state.step, self.state.tokens)
        else:
            self.logger.event("batches_skipped", self.state.step, self.state.tokens,
                              f"skipped {num_batches} batch(es): global samples [{start:,}, {stop:,}) will never be "
                              "trained on", skip_start=start, skip_stop=stop, batches=num_batches)


def domain_losses(reduced: torch.Tensor, names: list[str]) -> dict[str, tuple[float, float]]:
    """{domain: (mean loss, sample count)} of the domains in the step, from its all-reduced sums
    [loss, per-domain loss sums, per-domain sample counts, ...] (Trainer.train_step): the same on every
    rank, as the detector needs them."""
    count = len(names)
    sums, counts = reduced[1:1 + count].tolist(), reduced[1 + count:1 + 2 * count].tolist()
    return {name: (sums[i] / counts[i], counts[i]) for i, name in enumerate(names) if counts[i] > 0}
