"""Spike detection: robust rolling statistics on the loss and the unclipped grad norm.

`SpikeDetector.observe(step, loss, grad_norm)` returns a `Verdict`:

- ``nonfinite``: the loss or grad norm is NaN/inf. Caught at once, warm-up or not.
- ``outlier``: one step far above its baseline; the policy skips that update.
- ``spike``: an outlier that is large, or the sustained_count-th outlier within sustained_window
  steps (an *episode*); the policy rolls back.
- ``ok``: everything else. Only these steps enter the statistics, so a spike cannot raise the
  baseline it is measured against; an *unconfirmed* excursion (below) is ok but stays out too.

Statistics, per signal (the loss, and log(grad norm) because grad norms vary multiplicatively):

- baseline = median of the newest `center_window` accepted values. A short window follows a
  falling loss; a long window's median lags above it, so a real rise would stay hidden until
  it climbed past that stale level.
- noise = 1.4826 x MAD of the step-to-step differences of the last `window` accepted values,
  divided by sqrt(2). Differences cancel the slow trend of a decaying loss, which would otherwise
  count as noise and blunt the detector; the MAD ignores the odd large step.
- z = (value - baseline) / noise, one-sided (only rises matter).

Escalation waits for confirmation by default (`large_loss_rise`/`large_grad_ratio` = 0): an
outlier's update is skipped anyway, so waiting sustained_count steps costs no damage, while a
single bad batch (random tokens, say) can double the loss alone and deserves a skip, not a
rollback. Damaged weights keep producing outliers and become a spike within a few steps.

A signal *crosses its thresholds* when z is high *and* the rise is large in absolute terms
(`loss_min_rise`, `grad_min_ratio`): z alone scales with batch noise, so with large batches a
curriculum stage switch's short +8% bump would be "many sigmas" yet is harmless.

Confirmation (`confirm_z` > 0, the default): a crossing makes the step an outlier only if
- the other signal confirms it: its z >= confirm_z (a damaged model shows in both: after LR x50
  both z-scores were >= 9.6 in every recorded case, docs/stability.md), or
- it is extreme on its own: loss >= `loss_alone_rise` above baseline, grad norm >=
  `grad_alone_ratio` x baseline (a random-token batch, BLOOM's grad-norm blow-up), or
- it repeats: another crossing or outlier within sustained_window steps (a lasting rise in one
  signal is caught one step later than alone, and escalates to a spike at the same step), or
- the other signal is not there to ask (no grad norm, `use_grad_norm=false`).
Otherwise it is an *unconfirmed* excursion: the step is ok (its update is applied) but it stays
out of the statistics and is remembered for the repeat rule. Why: with small batches each
signal's noise is heavy-tailed on its own. In `ayumi demo` (8 samples of 128 tokens a step) one
clean step's loss rose 13% (z 6.7, grad z 2.5) and another's grad norm 3.3x (z 11, loss z 1.9),
while the two z-scores of clean steps are uncorrelated (r = 0.05), so asking the other signal
cuts the false alarms without blunting the detector.

Stage switch (`note_stage_switch`): for stage_switch_grace_steps the loss is not judged (it can
neither flag nor confirm) and the grad norm flags a step only at grad_alone_ratio, or when it
repeats an outlier; smaller grad-norm rises enter the statistics, so both baselines settle on
the new stage's level. A new domain may legitimately move both signals at once, which is just
what confirmation would take for damage.

The detector is pure Python/numpy. Every rank must feed it identical numbers (the trainer
all-reduces loss and grad norm first); its decisions are then identical on every rank.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pretrain.stability.config import DetectorConfig

MAD_TO_SIGMA = 1.4826  # a normal distribution's sigma per unit of median absolute deviation
# Smallest noise assumed, so a nearly constant signal does not turn every wiggle into a huge z:
LOSS_NOISE_FLOOR = 0.002  # relative to the loss baseline
LOG_GRAD_NOISE_FLOOR = 0.01  # in log space, i.e. 1% of the grad norm

KINDS = ("ok", "nonfinite", "outlier", "spike")


@dataclass(frozen=True)
class Verdict:
    """The detector's judgement of one step, with the numbers behind it."""

    step: int
    """The step judged."""
    kind: str
    """ok | nonfinite | outlier | spike."""
    reason: str
    """Human-readable explanation (empty for ok)."""
    loss: float
    """The loss fed in (mean over all ranks)."""
    grad_norm: float | None = None
    """The unclipped global grad norm fed in (None when not available)."""
    loss_z: float | None = None
    """Robust z-score of the loss above its baseline (None while warming up)."""
    grad_z: float | None = None
    """Robust z-score of log(grad norm) above its baseline (None while warming up or without a norm)."""
    loss_rise: float | None = None
    """loss / baseline - 1."""
    grad_ratio: float | None = None
    """grad norm / baseline."""
    baseline_loss: float | None = None
    """Median of the newest accepted losses."""
    baseline_grad_norm: float | None = None
    """Median of the newest accepted grad norms."""
    loss_z_threshold: float = 0.0
    """The loss z-score threshold in force."""
    grad_z_threshold: float = 0.0
    """The grad-norm z-score threshold in force."""
    episode_start: int | None = None
    """First step of the outlier episode this step belongs to (None for ok steps outside one)."""
    outliers_in_window: int = 0
    """Outlier/non-finite steps within the last sustained_window steps, this one included."""
    note: str = ""
    """ok steps only: a signal crossed its thresholds without confirmation, or as a stage's new level (empty: none)."""

    @property
    def spike_start(self) -> int | None:
        """Where the spike began, as far as the detector can tell: its episode's first outlier."""
        return self.episode_start

    @property
    def score(self) -> float:
        """Spike score for dashboards: the larger of the two z-scores, 0 when none (inf if non-finite)."""
        if self.kind == "nonfinite":
            return math.inf
        return max(0.0, self.loss_z or 0.0, self.grad_z or 0.0)

    def metrics(self) -> dict[str, float]:
        """`stability/*` metrics for metrics.jsonl and W&B: finite values only (JSON has no inf);
        z-scores once warmed up."""
        out: dict[str, float] = {"stability/outlier": float(self.kind != "ok"),
                                 "stability/nonfinite": float(self.kind == "nonfinite"),
                                 "stability/unconfirmed": float(bool(self.note))}
        if math.isfinite(self.score):
            out["stability/spike_score"] = self.score
        if self.loss_z is not None:
            out["stability/loss_z"] = self.loss_z
        if self.grad_z is not None:
            out["stability/grad_z"] = self.grad_z
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Signal:
    """One signal's comparison with its baseline."""

    z: float
    baseline: float
    excess: float  # loss: relative rise; grad: ratio to baseline


@dataclass(frozen=True)
class _Judgement:
    """Which signals make this step an outlier, and what crossed its thresholds without counting."""

    reasons: list[str]
    large: bool = False
    note: str = ""  # an ok step's unconfirmed crossing (or a stage's new grad-norm level)
    hold_out: bool = False  # keep the step out of the statistics (an unconfirmed excursion)
    repeats: tuple[int, ...] = ()  # earlier unconfirmed steps this outlier confirms (they join its episode)


class SpikeDetector:
    """Rolling robust statistics over accepted steps, with warm-up and outlier -> spike escalation."""

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        # (step, loss, log grad norm or None) of accepted steps only.
        self._history: deque[tuple[int, float, float | None]] = deque(maxlen=cfg.window)
        self._outliers: deque[int] = deque()  # steps of recent outliers, within sustained_window
        self._suspects: deque[int] = deque()  # steps of recent unconfirmed excursions, within sustained_window
        self._episode_start: int | None = None
        self._loss_grace_until = -1

    # -- judging ---------------------------------------------------------------------------------
    def observe(self, step: int, loss: float, grad_norm: float | None = None) -> Verdict:
        """Judge one step. Call once per optimizer step with values identical on every rank."""
        if grad_norm is not None and grad_norm <= 0:
            grad_norm = None  # log(0) is no evidence of anything; judge the loss alone
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            what = "loss" if not math.isfinite(loss) else "grad norm"
            value = loss if what == "loss" else grad_norm
            return self._flag(step, loss, grad_norm, f"non-finite {what} ({value})", None, None, large=False,
                              kind="nonfinite")
        while self._suspects and self._suspects[0] <= step - self.cfg.sustained_window:
            self._suspects.popleft()  # too old to be repeated
        log_grad = math.log(grad_norm) if grad_norm is not None else None
        loss_sig, grad_sig = self._compare(step, loss, log_grad)
        judged = self._judge(step, loss, grad_norm, loss_sig, grad_sig)
        if not judged.reasons:
            if judged.hold_out:
                self._suspects.append(step)
            else:
                self._history.append((step, float(loss), log_grad))
            return self._verdict(step, "ok", "", loss, grad_norm, loss_sig, grad_sig, note=judged.note)
        for earlier in judged.repeats:  # the excursions this one confirms open its episode
            self._register_outlier(earlier)
        return self._flag(step, loss, grad_norm, "; ".join(judged.reasons), loss_sig, grad_sig, large=judged.large,
                          kind="outlier")

    def _compare(self, step: int, loss: float, log_grad: float | None) -> tuple[_Signal | None, _Signal | None]:
        """Both signals against their baselines; (None, None) while warming up."""
        if step < self.cfg.warmup_steps or len(self._history) < self.cfg.min_history:
            return None, None
        losses = np.fromiter((h[1] for h in self._history), dtype=np.float64)
        center, noise = robust_baseline(losses, self.cfg.center_window)
        noise = max(noise, LOSS_NOISE_FLOOR * abs(center))
        rise = loss / center - 1.0 if center > 0 else (math.inf if loss > center else 0.0)
        loss_sig = _Signal(z=(loss - center) / noise, baseline=center, excess=rise)
        grad_sig = None
        grads = np.array([h[2] for h in self._history if h[2] is not None], dtype=np.float64)
        if log_grad is not None and len(grads) >= self.cfg.min_history:
            g_center, g_noise = robust_baseline(grads, self.cfg.center_window)
            g_noise = max(g_noise, LOG_GRAD_NOISE_FLOOR)
            grad_sig = _Signal(z=(log_grad - g_center) / g_noise, baseline=math.exp(g_center),
                               excess=math.exp(log_grad - g_center))
        return loss_sig, grad_sig

    def _judge(self, step: int, loss: float, grad_norm: float | None, loss_sig: _Signal | None,
               grad_sig: _Signal | None) -> _Judgement:
        """Which signals cross their thresholds, and whether each crossing is confirmed (module docstring)."""
        cfg = self.cfg
        in_grace = step < self._loss_grace_until
        grad_judged = cfg.use_grad_norm and grad_sig is not None
        loss_cross = loss_sig is not None and not in_grace and loss_sig.z >= cfg.loss_z \
            and loss_sig.excess >= cfg.loss_min_rise
        grad_cross = grad_judged and grad_sig.z >= cfg.grad_z and grad_sig.excess >= cfg.grad_min_ratio
        if not (loss_cross or grad_cross):
            return _Judgement([])
        recent = self._recent_steps(step)
        reasons, notes, large, hold_out = [], [], False, False
        if loss_cross:
            what = (f"loss {loss:.4g} is {100 * loss_sig.excess:.0f}% above its baseline "
                    f"{loss_sig.baseline:.4g} (robust z {loss_sig.z:.1f} >= {cfg.loss_z:g})")
            alone = f"+{100 * cfg.loss_alone_rise:.0f}%"
            # Both signals crossing confirm each other; the message then reads as it always did.
            why = "" if grad_cross else self._confirmation(
                other=("grad norm", grad_sig.z) if grad_judged else None,
                alone=loss_sig.excess >= cfg.loss_alone_rise, alone_text=alone, recent=recent)
            if why is None:
                notes.append(f"{what}, unconfirmed (grad norm z {grad_sig.z:.1f} < {cfg.confirm_z:g}, below {alone}, "
                             f"no other excursion within {cfg.sustained_window} steps): update applied, step kept "
                             "out of the statistics")
                hold_out = True
            else:
                reasons.append(what + why)
                large |= cfg.large_loss_rise > 0 and loss_sig.excess >= cfg.large_loss_rise
        if grad_cross:
            what = (f"grad norm {grad_norm:.4g} is {grad_sig.excess:.1f}x its baseline "
                    f"{grad_sig.baseline:.4g} (robust z {grad_sig.z:.1f} >= {cfg.grad_z:g})")
            alone = grad_sig.excess >= cfg.grad_alone_ratio
            alone_text = f"{cfg.grad_alone_ratio:g}x"
            if in_grace:
                # Right after a stage switch the loss cannot confirm (the new domain moves it), and only an
                # outlier counts as a repeat: smaller rises are the new stage's level and enter the statistics.
                why = self._confirmation(other=None, alone=alone, alone_text=alone_text,
                                         recent=[s for s in recent if s in self._outliers], no_other_is_alone=False)
                if why is None:
                    notes.append(f"{what}, within {cfg.stage_switch_grace_steps} steps of a stage switch and below "
                                 f"{alone_text}: taken as the new stage's level")
            else:
                why = "" if loss_cross else self._confirmation(
                    other=("loss", loss_sig.z), alone=alone, alone_text=alone_text, recent=recent)
                if why is None:
                    notes.append(f"{what}, unconfirmed (loss z {loss_sig.z:.1f} < {cfg.confirm_z:g}, below "
                                 f"{alone_text}, no other excursion within {cfg.sustained_window} steps): update "
                                 "applied, step kept out of the statistics")
                    hold_out = True
            if why is not None:
                reasons.append(what + why)
                large |= cfg.large_grad_ratio > 0 and grad_sig.excess >= cfg.large_grad_ratio
        if reasons:
            repeats = tuple(s for s in self._suspects if s > step - cfg.sustained_window)
            return _Judgement(reasons, large, repeats=repeats)
        return _Judgement([], note="; ".join(notes), hold_out=hold_out)

    def _confirmation(self, *, other: tuple[str, float] | None, alone: bool, alone_text: str, recent: list[int],
                      no_other_is_alone: bool = True) -> str | None:
        """Why a crossing counts (appended to its reason; "" when nothing needs saying), or None: unconfirmed.

        other: the other signal's name and z, None when it cannot be asked (missing or disabled
        grad norm, the loss in its stage-switch grace). no_other_is_alone: without the other
        signal, judge this one alone as the detector did before confirmation existed.
        """
        cfg = self.cfg
        if cfg.confirm_z <= 0:
            return ""
        if other is not None and other[1] >= cfg.confirm_z:
            return f", confirmed by the {other[0]} (z {other[1]:.1f} >= {cfg.confirm_z:g})"
        if alone:
            return f", {alone_text} or more on its own"
        if recent:
            return f", repeating the excursion at step {recent[-1]}"
        if other is None and no_other_is_alone:
            return ""
        return None

    def _recent_steps(self, step: int) -> list[int]:
        """Outliers and unconfirmed excursions within the last sustained_window steps, oldest first."""
        window = self.cfg.sustained_window
        return sorted(s for s in (*self._outliers, *self._suspects) if step - window < s < step)

    def _flag(self, step: int, loss: float, grad_norm: float | None, reason: str, loss_sig: _Signal | None,
              grad_sig: _Signal | None, *, large: bool, kind: str) -> Verdict:
        """Record an outlier (not in the statistics) and escalate it to a spike when warranted."""
        count = self._register_outlier(step)
        sustained = count >= self.cfg.sustained_count
        if large or sustained:
            why = "large" if large else f"{count} outliers in the last {self.cfg.sustained_window} steps"
            reason = f"{reason}; spike ({why}, episode since step {self._episode_start})"
            kind = "spike"
        return self._verdict(step, kind, reason, loss, grad_norm, loss_sig, grad_sig)

    def _register_outlier(self, step: int) -> int:
        """Add an outlier step; returns how many lie within sustained_window (an episode's link).

        `step` may be an earlier unconfirmed excursion that a later step confirmed: it then joins
        (or opens) the episode at its own step.
        """
        horizon = max([step, *self._outliers]) - self.cfg.sustained_window
        while self._outliers and self._outliers[0] <= horizon:
            self._outliers.popleft()
        self._suspects = deque(s for s in self._suspects if s > horizon and s != step)
        if not self._outliers:
            self._episode_start = step
        elif self._episode_start is None or step < self._episode_start:
            self._episode_start = step
        self._outliers = deque(sorted({*self._outliers, step}))
        return len(self._outliers)

    def _verdict(self, step: int, kind: str, reason: str, loss: float, grad_norm: float | None,
                 loss_sig: _Signal | None, grad_sig: _Signal | None, note: str = "") -> Verdict:
        recent = sum(1 for s in self._outliers if s > step - self.cfg.sustained_window)
        return Verdict(
            step=step, kind=kind, reason=reason, loss=float(loss),
            grad_norm=None if grad_norm is None else float(grad_norm),
            loss_z=None if loss_sig is None else loss_sig.z,
            grad_z=None if grad_sig is None else grad_sig.z,
            loss_rise=None if loss_sig is None else loss_sig.excess,
            grad_ratio=None if grad_sig is None else grad_sig.excess,
            baseline_loss=None if loss_sig is None else loss_sig.baseline,
            baseline_grad_norm=None if grad_sig is None else grad_sig.baseline,
            loss_z_threshold=self.cfg.loss_z, grad_z_threshold=self.cfg.grad_z,
            episode_start=self._episode_start if recent else None,
            outliers_in_window=recent,
            note=note,
        )

    # -- control from the trainer ---------------------------------------------------------------
    def in_episode(self, step: int) -> bool:
        """True while an outlier episode is open at `step`: a checkpoint taken now is suspect."""
        return bool(self._outliers) and self._outliers[-1] > step - self.cfg.sustained_window

    def note_stage_switch(self, step: int) -> None:
        """A curriculum stage switch at `step`: for stage_switch_grace_steps do not judge the loss,
        and let the grad norm flag a step only at grad_alone_ratio (or when it repeats an outlier).

        The losses and the smaller grad-norm rises still enter the statistics, so both baselines
        settle on the new stage's level during the grace period. With confirm_z = 0 the grad norm
        is judged as usual.
        """
        self._loss_grace_until = step + self.cfg.stage_switch_grace_steps

    def rewind(self, to_step: int) -> None:
        """After a rollback to checkpoint `to_step`: forget steps >= to_step and the open episode.

        The statistics become those the run had at that checkpoint; if too few remain, the
        detector warms up again (min_history), which is the honest state after a rollback.
        """
        self._history = deque((h for h in self._history if h[0] < to_step), maxlen=self.cfg.window)
        self._outliers.clear()
        self._suspects.clear()
        self._episode_start = None

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (no NaN: a missing grad norm is None)."""
        return {
            "history": [list(h) for h in self._history],
            "outliers": list(self._outliers),
            "suspects": list(self._suspects),
            "episode_start": self._episode_start,
            "loss_grace_until": self._loss_grace_until,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = deque(((int(s), float(l), None if g is None else float(g)) for s, l, g in state["history"]),
                              maxlen=self.cfg.window)
        self._outliers = deque(int(s) for s in state["outliers"])
        self._suspects = deque(int(s) for s in state.get("suspects", ()))  # absent in checkpoints before confirmation
        self._episode_start = state["episode_start"]
        self._loss_grace_until = int(state["loss_grace_until"])


def robust_baseline(values: np.ndarray, center_window: int) -> tuple[float, float]:
    """(median of the newest center_window values, trend-free robust noise of all values).

    The noise is the MAD of step-to-step differences scaled to a standard deviation: for
    independent noise of std s a difference has std s*sqrt(2), and subtracting the median
    difference removes a locally linear trend. With fewer than 3 values the noise is 0 (the
    caller's floor applies).
    """
    center = float(np.median(values[-center_window:]))
    if len(values) < 3:
        return center, 0.0
    diffs = np.diff(values)
    mad = float(np.median(np.abs(diffs - np.median(diffs))))
    return center, MAD_TO_SIGMA * mad / math.sqrt(2.0)
