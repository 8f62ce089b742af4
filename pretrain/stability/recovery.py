"""The stability machinery as one component the trainer drives: detect -> decide -> act.

`StabilityMonitor` owns the detector, the recovery policy, the loss-scale watchdog, the
adaptive clip, the grad-norm percentiles and the fault injector, and knows nothing about
DeepSpeed or the data: the trainer hands it values that are already identical on every rank
(all-reduced loss, DeepSpeed's global grad norm), so every rank reaches the same decision
without another collective. The trainer then carries out the returned `Action` (withhold the
update, roll back, stop), which keeps the mechanism (engine, checkpoints, loader) in one place
and the policy in another, as OLMo-core separates saving mechanism from saving policy.

Step convention (shared with detector/policy/watchdog/inject): step k is the 0-based optimizer
step that runs on the weights of checkpoint k.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from pretrain.stability.config import StabilityConfig
from pretrain.stability.detector import DomainLosses, SpikeDetector, Verdict
from pretrain.stability.inject import FaultInjector
from pretrain.stability.policy import NONE, Action, RecoveryPolicy
from pretrain.stability.telemetry import AdaptiveClip, RollingPercentiles
from pretrain.stability.watchdog import LossScaleWatchdog


@dataclass
class StepJudgement:
    """What was decided for one step (kept until the step's metrics are written)."""

    verdict: Verdict | None = None
    action: Action = field(default_factory=lambda: NONE)
    grad_norm: float | None = None


class StabilityMonitor:
    """Per-step stability decisions; every method is called on every rank with identical inputs."""

    def __init__(self, cfg: StabilityConfig, static_clip: float, min_loss_scale: float,
                 knobs: dict[str, Any] | None = None):
        self.cfg = cfg
        self.detector = SpikeDetector(cfg.detector)
        self.policy = RecoveryPolicy(cfg, knobs=knobs)
        self.watchdog = LossScaleWatchdog(cfg.watchdog, min_loss_scale)
        self.clip = AdaptiveClip(cfg.clip, static_clip)
        self.percentiles = RollingPercentiles(cfg.telemetry.percentile_window)
        self.injector = FaultInjector(cfg.inject)
        self.judgement = StepJudgement()
        self._checkpoints: list[int] = []
        self._warned_clipping = False

    # -- before the step ----------------------------------------------------------------------------
    def lr_factor(self, step: int) -> float:
        """Cool-down after a rollback times any injected LR fault."""
        return self.policy.lr_factor_at(step) * self.injector.lr_multiplier(step)

    def clip_threshold(self) -> float:
        return self.clip.threshold()

    # -- at the accumulation boundary, inside the optimizer step ----------------------------------
    def judge(self, step: int, loss: float, grad_norm: float | None, checkpoints: Iterable[int],
              domains: DomainLosses | None = None) -> Action:
        """Verdict and action for step `step`, given its all-reduced loss and global grad norm (and each
        domain's all-reduced mean loss and sample count, for the mix-adjusted loss after a stage switch).

        Called at most once per step: from the optimizer gate when DeepSpeed reaches the update,
        or after the step when DeepSpeed skipped it itself (overflow) and never asked.
        """
        if self.judgement.verdict is not None:
            return self.judgement.action
        # The threshold this step is clipped with: clip.observe (after_step) has not seen it yet.
        verdict = self.detector.observe(step, loss, grad_norm, domains, clip_threshold=self.clip.threshold())
        action = self.policy.decide(verdict, step, checkpoints)
        self.judgement = StepJudgement(verdict, action, grad_norm)
        return action

    @staticmethod
    def allows_update(action: Action) -> bool:
        """Apply the update unless the step is skipped, rolled back or the run stops on it."""
        return action.kind == "none"

    # -- after the step -----------------------------------------------------------------------------
    def after_step(self, step: int, loss_scale: float | None, applied: bool) -> tuple[Action, list[dict], float | None]:
        """Feed the watchdog and telemetry; returns (action to carry out, new events, loss scale to set)."""
        judgement = self.judgement
        action = judgement.action
        reset_scale = None
        watch = self.watchdog.observe(step, loss_scale, applied)
        if watch.kind == "reset_scale":
            reset_scale = watch.value
            self.policy.record_event("loss_scale_reset", step, watch.reason, loss_scale=loss_scale, new_scale=watch.value)
        elif watch.kind == "rollback" and action.kind == "none":
            action = self.policy.on_watchdog_rollback(step, self._checkpoints, watch.reason, watch.overflow_start)
        norm = judgement.grad_norm
        if judgement.verdict is not None and judgement.verdict.kind == "ok" and norm is not None and math.isfinite(norm):
            self.clip.observe(norm)
            self.percentiles.push(norm)
            too_many = self.clip.too_many_clipped and self.clip.adapting
            if too_many and not self._warned_clipping:  # once per crossing, not every step
                self.policy.record_event("clipping_too_often", step,
                                         f"{100 * self.clip.clipped_share:.0f}% of recent steps were clipped: "
                                         "lower the LR instead (optim.lr)")
            self._warned_clipping = too_many
        self.injector.step_done(step)
        return action, self.policy.new_events(), reset_scale

    def set_checkpoints(self, steps: Iterable[int]) -> None:
        """Steps of the complete checkpoints a rollback may load (refreshed by the trainer)."""
        self._checkpoints = sorted(set(steps))

    def metrics(self, step: int) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.judgement.verdict is not None:
            out.update(self.judgement.verdict.metrics())
        out.update(self.policy.metrics(step))
        out.update(self.watchdog.metrics())
        out.update(self.clip.metrics())
        out.update(self.percentiles.metrics())
        return out

    def new_step(self) -> None:
        self.judgement = StepJudgement()

    # -- rollback -----------------------------------------------------------------------------------
    def rewound(self, to_step: int) -> None:
        """After loading checkpoint `to_step`: forget the abandoned timeline's statistics (and the resume: the
        state it loaded is gone)."""
        self.detector.rewind(to_step)
        self.watchdog.rewind()
        self.policy.resumed = None

    def in_episode(self, step: int) -> bool:
        return self.detector.in_episode(step)

    # -- state --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "policy": self.policy.state_dict(),
            "watchdog": self.watchdog.state_dict(),
            "clip": self.clip.state_dict(),
            "percentiles": self.percentiles.state_dict(),
            "injector": self.injector.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state["detector"])
        self.policy.load_state_dict(state["policy"])
        self.watchdog.load_state_dict(state["watchdog"])
        self.clip.load_state_dict(state["clip"])
        self.percentiles.load_state_dict(state["percentiles"])
        self.injector.load_state_dict(state["injector"])
