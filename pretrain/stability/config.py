"""Stability configuration: one dataclass per concern, each field one line of user documentation.

`StabilityConfig` is the `stability` node of the training config (`conf/stability/*.yaml`), with
fault injection as the nested group `stability/inject` (`conf/stability/inject/*.yaml`). Values
only; `check_stability_config` holds the cross-field checks. This module imports nothing from
`pretrain.config`, which imports it.

Step numbers everywhere in `pretrain.stability` follow the checkpoint convention: step k is the
optimizer step that runs on the weights of checkpoint k (k updates already applied).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from pretrain.ranges import Range, above, at_least, between, range_problems

ACTIONS = ("recover", "skip", "stop", "log_only")
COOLDOWN_SHAPES = ("linear", "constant")


class StabilityConfigError(ValueError):
    """A stability setting is inconsistent; the message names the field, the value and the fix."""


@dataclass
class DetectorConfig:
    """Spike detection on loss and grad norm with robust rolling statistics (pretrain/stability/detector.py)."""

    window: int = 200
    """Accepted (non-outlier) steps kept; their step-to-step changes give the noise scale (a MAD)."""
    center_window: int = 20
    """Newest accepted steps whose median is the baseline a step is compared with (short: tracks a falling loss)."""
    warmup_steps: int = 100
    """No outlier verdicts before this step (early training is legitimately wild); NaN/Inf is always caught."""
    min_history: int = 50
    """Accepted steps needed before judging (again after a rollback rewinds the history)."""
    loss_z: float = 6.0
    """Robust z-score of the loss above its baseline that makes a step an outlier (with loss_min_rise)."""
    loss_min_rise: float = 0.10
    """...and the loss must also be this fraction above its baseline (keeps a stage switch's ~8% bump quiet)."""
    grad_z: float = 6.0
    """Robust z-score of log(grad norm) above its baseline that makes a step an outlier (with grad_min_ratio)."""
    grad_min_ratio: float = 3.0
    """...and the grad norm must also be this many times its baseline."""
    use_grad_norm: bool = True
    """Judge the unclipped grad norm as well as the loss (BLOOM: grad norm is the sharper signal)."""
    large_loss_rise: float = 0.0
    """An outlier with the loss this fraction above baseline is a spike at once (1.0 = doubled); 0 = wait for sustained."""
    large_grad_ratio: float = 0.0
    """An outlier with the grad norm this many times baseline is a spike at once; 0 = wait for sustained."""
    sustained_count: int = 3
    """This many outlier or non-finite steps within sustained_window steps make a spike."""
    sustained_window: int = 10
    """Steps over which sustained_count outliers are counted; also what links outliers into one episode."""
    stage_switch_grace_steps: int = 50
    """After the trainer reports a curriculum stage switch, for this many steps the loss is judged mix-adjusted (each
    domain's loss against its own baseline; not at all without a domain that has one) and the grad
    norm flags a step only at grad_alone_ratio, as a repeat or confirmed by that loss (smaller rises are taken as the
    new stage's level)."""
    domain_min_steps: int = 10
    """Accepted steps with samples of a domain before its loss has a baseline in the mix-adjusted loss (a stage's new
    domain is left out until then)."""
    confirm_z: float = 4.0
    """A step that crosses one signal's thresholds is an outlier only if the other signal's robust z is at least this
    (their batch noise is independent: one hard small batch moves one of them), it is extreme on its own
    (loss_alone_rise, grad_alone_ratio) or it repeats within sustained_window steps; 0 = off (each signal alone)."""
    loss_alone_rise: float = 0.5
    """A loss this fraction above its baseline, with z >= loss_alone_z, is an outlier without the grad norm confirming
    it."""
    loss_alone_z: float = 12.0
    """...the robust z that rise needs too: at a low loss single steps vary 4x, so +50% alone is ordinary there, and
    its skewed noise reaches z 6 about once in 2,000 clean steps (docs/stability.md); a bad batch is far above both."""
    grad_alone_ratio: float = 8.0
    """A grad norm this many times its baseline, with z >= grad_alone_z, is an outlier without the loss confirming
    it, unless the step is clipped (its update is then bounded whatever the norm, and it needs confirming like any
    other)."""
    grad_alone_z: float = 12.0
    """...the robust z (of log grad norm) that ratio needs too: at a low loss clean steps reach 6-9x their baseline at
    z 6-7.5 (docs/stability.md); a blow-up in ordinary noise (10% in log space) is z 20 or more at 8x."""
    divergence_rise: float = 0.10
    """A spike too: the loss baseline this fraction above the lowest it reached since the last stage switch or
    rollback, a slow climb no single step shows (an LR past the stable edge), if divergence_z agrees; 0 = off."""
    divergence_z: float = 4.0
    """...and the baseline this many standard errors (robust, of a median) above the level of the center_window steps
    after that low point, its own window wholly after them: the climb must stand out of the loss's noise, which at a
    low loss can be 4x from one step to the next (docs/stability.md); 0 = the relative rise alone."""

    RANGES: ClassVar[dict[str, Range]] = {
        "window": at_least(3), "center_window": at_least(1), "warmup_steps": at_least(0), "min_history": at_least(0),
        "loss_z": above(0), "loss_min_rise": at_least(0), "grad_z": above(0), "grad_min_ratio": at_least(1),
        "large_loss_rise": at_least(0, "0 = off"), "large_grad_ratio": at_least(0, "0 = off"),
        "sustained_count": at_least(1), "sustained_window": at_least(1), "stage_switch_grace_steps": at_least(0),
        "domain_min_steps": at_least(1),
        "confirm_z": at_least(0, "0 = off: each signal judged alone"), "loss_alone_rise": at_least(0),
        "loss_alone_z": at_least(0), "grad_alone_z": at_least(0),
        "grad_alone_ratio": at_least(1), "divergence_rise": at_least(0, "0 = off"),
        "divergence_z": at_least(0, "0 = the relative rise alone"),
    }
    """Allowed values, checked before training starts (pretrain/ranges.py)."""


@dataclass
class RecoveryConfig:
    """What a spike triggers: roll back, skip data, cool the LR, reset the loss scale; when to give up."""

    rollback_steps: int = 100
    """Roll back to the newest good checkpoint at least this many steps before the spike began (PaLM: ~100)."""
    skip_batches: int = 200
    """Global batches to skip past the rollback checkpoint's data position (PaLM: 200-500, WeLM: ~200)."""
    lr_cooldown_factor: float = 0.5
    """Multiply the LR by this right after a rollback (WeLM lowered the LR); 1.0 = no cool-down."""
    lr_cooldown_steps: int = 200
    """Length of the cool-down after a rollback, in steps."""
    lr_cooldown_shape: str = "linear"
    """linear (the factor ramps back to 1 over the cool-down) | constant (held, then back to 1 at once)."""
    lr_repeat_factor: float = 0.5
    """A spike within recovery_window_steps of an earlier recovery, or a divergence (detector.divergence_rise), also
    multiplies the LR by this for the rest of the run (the cool-down then returns to the lowered LR): a spike that comes
    back, or a slow climb, is the LR's doing, not a batch's (OPT lowered its LR after repeated restarts); 1.0 = the LR
    always returns to the schedule's."""
    reset_loss_scale: bool = True
    """fp16: after a rollback set the loss scale to 2**loss_scale_reset_power (the checkpoint holds the collapsed one)."""
    loss_scale_reset_power: int = 16
    """fp16: the loss scale after a rollback is 2**this."""
    adam_eps: float | None = None
    """If set, Adam's epsilon from the first recovery on (Molybog et al.: a smaller eps counters the collapse)."""
    adam_beta1: float | None = None
    """If set, Adam's beta1 from the first recovery on."""
    max_recoveries: int = 3
    """Recoveries allowed within recovery_window_steps; the next spike stops the run with a saved state."""
    recovery_window_steps: int = 2000
    """Spikes whose steps lie within this distance of each other count as repeated (replayed steps included)."""
    max_skips_per_episode: int = 50
    """action=skip: stop once one spike episode has skipped this many updates (skipping cannot repair weights)."""
    ring_interval: int = 50
    """Save a recovery checkpoint every this many steps (separate from the long-term ones); 0 = none."""
    ring_keep: int = 3
    """Recovery checkpoints kept (the rollback target >= rollback_steps back is always kept in addition)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "rollback_steps": at_least(0), "skip_batches": at_least(0),
        "lr_cooldown_factor": between(0, 1, low_open=True, note="1.0 = no cool-down"), "lr_cooldown_steps": at_least(0),
        "lr_repeat_factor": between(0, 1, low_open=True, note="1.0 = never lowered for good"),
        "adam_eps": above(0), "adam_beta1": between(0, 1, high_open=True), "max_recoveries": at_least(0),
        "recovery_window_steps": at_least(1), "max_skips_per_episode": at_least(1),
        "ring_interval": at_least(0, "0 = no recovery checkpoints"), "ring_keep": at_least(1),
    }
    """Allowed values, checked before training starts (pretrain/ranges.py)."""


@dataclass
class WatchdogConfig:
    """fp16 loss-scale watchdog (pretrain/stability/watchdog.py); inactive in bf16/fp32."""

    enabled: bool = True
    """Watch the fp16 loss scale and the consecutive skipped steps."""
    floor_margin_power: int = 3
    """Reset the scale once it is <= deepspeed.min_loss_scale x 2**this (DeepSpeed raises on an overflow at the floor)."""
    max_consecutive_skips: int = 16
    """Reset the scale after this many overflow-skipped steps in a row."""
    reset_scale_power: int = 16
    """The watchdog resets the scale to 2**this."""
    max_resets: int = 2
    """Resets allowed within reset_window_steps; if overflows continue after them, roll back instead."""
    reset_window_steps: int = 1000
    """Window (in steps) over which resets are counted."""

    RANGES: ClassVar[dict[str, Range]] = {
        "floor_margin_power": at_least(0), "max_consecutive_skips": at_least(1), "max_resets": at_least(0),
        "reset_window_steps": at_least(1),
    }
    """Allowed values, checked before training starts (pretrain/ranges.py)."""


@dataclass
class ClipConfig:
    """Adaptive gradient clipping at a percentile of recent unclipped grad norms (playbook: ~p90)."""

    enabled: bool = False
    """Adapt the clip threshold; off = optim.grad_clip throughout (percentiles are logged either way)."""
    percentile: float = 90.0
    """The threshold is this percentile of the recent unclipped grad norms of accepted steps."""
    warmup_steps: int = 200
    """Grad norms recorded before the threshold adapts; until then optim.grad_clip applies."""
    window: int = 1000
    """Recent accepted steps whose grad norms the percentile is taken over."""
    warn_share: float = 0.5
    """Warn when more than this share of the window's steps were clipped (the playbook: lower the LR instead)."""

    RANGES: ClassVar[dict[str, Range]] = {
        "percentile": between(0, 100, low_open=True, high_open=True), "warmup_steps": at_least(0),
        "window": at_least(1), "warn_share": between(0, 1),
    }
    """Allowed values, checked before training starts (pretrain/ranges.py)."""


@dataclass
class TelemetryConfig:
    """Stability telemetry under opt/ and stability/ (the unclipped global grad norm is logged every step)."""

    group_norm_interval: int = 50
    """Log grad norms and update/weight ratios per parameter group every this many steps; 0 = never."""
    update_ratio: bool = True
    """With the group norms, log |update| / |weight| per group (snapshots the weights for one step)."""
    histogram_interval: int = 100
    """Log a histogram of log10 grad norms over the percentile window every this many steps; 0 = never."""
    histogram_bins: int = 64
    """Bins of that histogram (fixed range, so histograms of different steps compare)."""
    percentile_window: int = 1000
    """Recent steps over which p50/p90/p99 of the unclipped grad norm are logged."""

    RANGES: ClassVar[dict[str, Range]] = {
        "group_norm_interval": at_least(0, "0 = never"), "histogram_interval": at_least(0, "0 = never"),
        "histogram_bins": at_least(1), "percentile_window": at_least(1),
    }
    """Allowed values, checked before training starts (pretrain/ranges.py)."""


@dataclass
class InjectConfig:
    """Fault injection for demos and tests (`stability/inject`): every list empty = off.

    Steps here are 0-based step indices: index 600 is the step the console and events.jsonl call
    601 (the start-up line "FAULT INJECTION ON" lists them as the console counts).
    """

    lr_multiply: dict[int, float] = field(default_factory=dict)
    """FAULT: step -> factor multiplying that step's LR (e.g. {300: 50.0, 301: 50.0})."""
    random_batch_steps: list[int] = field(default_factory=list)
    """FAULT: steps whose batch is replaced by uniformly random tokens."""
    nan_loss_steps: list[int] = field(default_factory=list)
    """FAULT: steps whose loss is made NaN before backward."""
    fp16_overflow_steps: list[int] = field(default_factory=list)
    """FAULT: fp16 steps whose gradients are forced to overflow (the loss is multiplied by inf)."""
    replay: bool = False
    """Fire again when a rollback replays a step; false = only the first time the run reaches it."""
    seed: int = 0
    """Seed of the random tokens (with the step and rank)."""
    feed_sample: int = -1
    """REPLAY: the stream position (global sample index) this session's first step reads from, instead of the
    checkpoint's; -1 = the checkpoint's. `ayumi replay` sets it to feed a checkpoint a spike's batches."""
    lr_set: dict[int, float] = field(default_factory=dict)
    """REPLAY: step -> the LR that step trains at, whatever the schedule, cool-down or stage policy would give;
    `ayumi replay` sets the LRs the spike's steps had."""


@dataclass
class StabilityConfig:
    """Training stability: detect (detector) -> decide (policy, watchdog) -> act (the trainer)."""

    enabled: bool = True
    """Run spike detection and act on it; off = telemetry and the non-finite skip only."""
    action: str = "recover"
    """On a spike: recover (roll back + skip data) | skip (skip updates only) | stop (save and stop) | log_only."""
    skip_nonfinite_loss: bool = True
    """Skip the update of a step whose loss or grad norm is NaN/inf on any rank, even with enabled=false."""
    detector: DetectorConfig = field(default_factory=DetectorConfig)
    """Spike detector thresholds and windows."""
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """Rollback, data skip, LR cool-down, loss-scale reset, escalation to stop, recovery checkpoints."""
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    """fp16 loss-scale watchdog."""
    clip: ClipConfig = field(default_factory=ClipConfig)
    """Adaptive gradient clipping."""
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    """What is logged and how often."""
    inject: InjectConfig = field(default_factory=InjectConfig)
    """Fault injection (off by default; conf/stability/inject/)."""
    precision_check_every: int = 0
    """Every N evaluations also evaluate in fp32 (a full fp32 weight copy per rank) and log val/<domain>/fp32_gap; 0 = off."""

    RANGES: ClassVar[dict[str, Range]] = {"precision_check_every": at_least(0, "0 = off")}
    """Allowed values, checked before training starts (pretrain/ranges.py)."""


def check_stability_config(cfg: StabilityConfig, min_loss_scale: float = 1.0) -> None:
    """Ranges (each section's RANGES) and cross-field checks; raises StabilityConfigError naming the
    field, the value and the fix. Single-field bounds live in RANGES only."""
    ranges = range_problems(cfg, "stability.")  # every value out of range at once, before the cross-checks
    _check(not ranges, "\n".join(ranges))
    _check(cfg.action in ACTIONS, f"stability.action={cfg.action!r}: choose one of {', '.join(ACTIONS)}")
    det, rec, dog = cfg.detector, cfg.recovery, cfg.watchdog
    _check(1 <= det.center_window <= det.window,
           f"stability.detector.center_window={det.center_window}: must lie in [1, detector.window={det.window}]")
    _check(det.domain_min_steps <= det.center_window,
           f"stability.detector.domain_min_steps={det.domain_min_steps} exceeds detector.center_window="
           f"{det.center_window}: a domain keeps only center_window steps of its loss, so it would never have a "
           "baseline after a stage switch; lower domain_min_steps or raise center_window")
    _check(det.min_history <= det.window,
           f"stability.detector.min_history={det.min_history} exceeds detector.window={det.window}: lower it")
    _check(det.loss_alone_rise >= det.loss_min_rise,
           f"stability.detector.loss_alone_rise={det.loss_alone_rise:g} is below detector.loss_min_rise="
           f"{det.loss_min_rise:g}: the rise that needs no confirmation must be at least the one that makes an outlier")
    _check(det.loss_alone_z >= det.loss_z,
           f"stability.detector.loss_alone_z={det.loss_alone_z:g} is below detector.loss_z={det.loss_z:g}: the z that "
           "needs no confirmation must be at least the one that makes an outlier")
    _check(det.grad_alone_z >= det.grad_z,
           f"stability.detector.grad_alone_z={det.grad_alone_z:g} is below detector.grad_z={det.grad_z:g}: the z that "
           "needs no confirmation must be at least the one that makes an outlier")
    _check(det.grad_alone_ratio >= det.grad_min_ratio,
           f"stability.detector.grad_alone_ratio={det.grad_alone_ratio:g} is below detector.grad_min_ratio="
           f"{det.grad_min_ratio:g}: the ratio that needs no confirmation must be at least the one that makes an outlier")
    _check(1 <= det.sustained_count <= det.sustained_window,
           f"stability.detector.sustained_count={det.sustained_count}: must lie in "
           f"[1, detector.sustained_window={det.sustained_window}]")
    _check(rec.lr_cooldown_shape in COOLDOWN_SHAPES,
           f"stability.recovery.lr_cooldown_shape={rec.lr_cooldown_shape!r}: choose linear or constant")
    floor = min_loss_scale * 2 ** dog.floor_margin_power
    _check(2 ** dog.reset_scale_power > floor,
           f"stability.watchdog.reset_scale_power={dog.reset_scale_power}: 2**{dog.reset_scale_power} must exceed "
           f"min_loss_scale x 2**floor_margin_power = {floor:g}, or every reset would trigger the next")
    _check(2 ** rec.loss_scale_reset_power > floor,
           f"stability.recovery.loss_scale_reset_power={rec.loss_scale_reset_power}: 2**it must exceed {floor:g}")
    _check(all(factor > 0 for factor in cfg.inject.lr_multiply.values()),
           f"stability.inject.lr_multiply={dict(cfg.inject.lr_multiply)}: factors must be > 0")
    _check(all(lr >= 0 for lr in cfg.inject.lr_set.values()),
           f"stability.inject.lr_set={dict(cfg.inject.lr_set)}: LRs must be >= 0")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise StabilityConfigError(message)
