"""Per-step concerns that watch the training step without being part of it.

The trainer calls every hook at two points of each optimizer step:

- `before_update(index)`: after the step's last backward, before the optimizer update (every rank; under
  ZeRO a hook may gather full gradients or weights here, which is collective);
- `after_step(report)`: after the update, with the step's `StepReport`; a hook adds its metrics to
  `report.metrics` (they are logged with the step's own) and may log events.

A new concern (e.g. downstream evaluation) is a new hook handed to the `Trainer`; the step itself does not
change. The hooks here: grad-norm and update-ratio telemetry, the grad-norm histogram, straggler reports.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pretrain.config import AyumiConfig
from pretrain.engine.train_engine import TrainEngine
from pretrain.job.hang_watchdog import StragglerMonitor
from pretrain.metrics import NullLogger
from pretrain.model.llama import layer_groups
from pretrain.stability.telemetry import group_grad_norms, group_metrics, log10_histogram, update_to_weight_ratios


@dataclass
class StepReport:
    """What one optimizer step did, as the hooks see it."""

    index: int
    """The step's 0-based index (the stability machinery's numbering)."""
    step: int
    """Steps done after it (1-based), as the progress line and the metrics count."""
    tokens: int
    """Tokens consumed after it."""
    own_seconds: float
    """This rank's own work in the step (its batch and forward passes, not the collectives)."""
    applied: bool
    """Whether the optimizer update was applied (not skipped or withheld)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The step's metrics; hooks add theirs."""


class StepHook:
    """A per-step concern; both methods do nothing unless overridden."""

    def before_update(self, index: int) -> None:
        """Between the step's last backward and its optimizer update (all ranks)."""

    def after_step(self, report: StepReport) -> None:
        """After the update; add metrics to `report.metrics`."""


class TelemetryHook(StepHook):
    """Every `stability.telemetry.group_norm_interval` steps: the grad norm per layer group, and (with
    `telemetry.update_ratio`) the update-to-weight ratio per group."""

    def __init__(self, cfg: AyumiConfig, engine: TrainEngine):
        self.telemetry = cfg.stability.telemetry
        self.engine = engine
        self._metrics: dict[str, float] = {}
        self._before: dict | None = None

    def before_update(self, index: int) -> None:
        self._metrics, self._before = {}, None
        interval = self.telemetry.group_norm_interval
        if interval <= 0 or index % interval:
            return
        self._metrics = group_metrics(group_grad_norms(self.engine.named_full_grads(), layer_groups), "opt/grad_norm/")
        if self.telemetry.update_ratio:
            self._before = self.engine.full_fp32_params()

    def after_step(self, report: StepReport) -> None:
        if self._before is not None and report.applied:
            self._metrics.update(group_metrics(update_to_weight_ratios(self._before, self.engine.full_fp32_params()),
                                               "stability/update_ratio/"))
        report.metrics.update(self._metrics)
        self._metrics, self._before = {}, None


class HistogramHook(StepHook):
    """Every `stability.telemetry.histogram_interval` steps: the histogram of recent log10 grad norms."""

    def __init__(self, cfg: AyumiConfig, logger: NullLogger, grad_norms):
        self.telemetry = cfg.stability.telemetry
        self.logger = logger
        self.grad_norms = grad_norms
        """The stability machinery's recent grad norms (a percentile window with `values()`)."""

    def after_step(self, report: StepReport) -> None:
        interval = self.telemetry.histogram_interval
        if interval > 0 and report.index > 0 and report.index % interval == 0:
            counts, edges = log10_histogram(self.grad_norms.values(), self.telemetry.histogram_bins)
            self.logger.histogram(report.step, "opt/grad_norm_log10_hist", counts, edges)


class StragglerHook(StepHook):
    """Each rank's own step time, compared across ranks every `hang.straggler_interval` steps."""

    def __init__(self, monitor: StragglerMonitor, logger: NullLogger):
        self.monitor = monitor
        self.logger = logger

    def after_step(self, report: StepReport) -> None:
        self.monitor.record(report.own_seconds)
        if self.monitor.due(report.step):
            metrics, verdict = self.monitor.report()
            report.metrics.update(metrics)
            if verdict:
                self.logger.event("straggler", report.step, report.tokens, verdict)
