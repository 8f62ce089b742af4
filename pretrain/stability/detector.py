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
- it is extreme on its own: loss >= `loss_alone_rise` above baseline with a z >= `loss_alone_z`, grad norm >=
  `grad_alone_ratio` x baseline with a z >= `grad_alone_z` on a step whose update is not clipped (a random-token
  batch, BLOOM's grad-norm blow-up; clipping bounds the update whatever the norm, so a clipped step needs
  confirming like any other), or
- it repeats: another crossing or outlier within sustained_window steps (a lasting rise in one
  signal is caught one step later than alone, and escalates to a spike at the same step), or
- the other signal is not there to ask (no grad norm, `use_grad_norm=false`).
Otherwise it is an *unconfirmed* excursion: the step is ok (its update is applied) but it stays
out of the statistics and is remembered for the repeat rule. Why: with small batches each
signal's noise is heavy-tailed on its own. In `ayumi demo` (8 samples of 128 tokens a step) one
clean step's loss rose 13% (z 6.7, grad z 2.5) and another's grad norm 3.3x (z 11, loss z 1.9),
while the two z-scores of clean steps are uncorrelated (r = 0.05), so asking the other signal
cuts the false alarms without blunting the detector. The loss needs a z for "on its own" as well as a rise: at a
low loss single steps vary 4x (0.025-0.10 around 0.04 in issue 46's run), so +50% is ordinary there. That noise
is skewed, too: in log-normal noise of its size a clean step reaches z 6 about once in 2,000 steps. The grad norm
is judged in log space, but its noise there grows heavy-tailed at a low loss: clean memorising runs had single
steps at 6.5x (z 7.5) and 8.8x (z 5.9) their baseline. So 8x needs a z of grad_alone_z too.

Stage switch (`note_stage_switch`): a new mix moves the total loss (its domains have other
levels) and may move the grad norm, both legitimately, which is just what confirmation would take
for damage. For stage_switch_grace_steps the bar is raised, never removed:
- the loss is judged *mix-adjusted* when the trainer passes each domain's loss (`domains`): the
  token-weighted relative rise of each domain's loss over that domain's own baseline. A domain's
  loss does not jump because the mix changed, so this signal keeps the usual thresholds (z >=
  loss_z, rise >= loss_min_rise) and confirms like the loss. Domains seen on fewer than
  `domain_min_steps` accepted steps (a stage's new domains) are left out until they have a level.
- a step none of whose domains has a level yet (a stage of new domains only, its first
  domain_min_steps steps) or a caller that passes no domain losses leaves the loss unjudged: a new
  domain may start far above the old level (+150% in a recorded switch), so no bar on the total
  would be safe. The trainer always passes them; the grad norm is judged throughout.
- the grad norm flags a step at grad_alone_ratio, when it repeats an outlier, or when the
  mix-adjusted loss confirms it; smaller grad-norm rises enter the statistics, so both
  baselines settle on the new stage's level.

Divergence: an LR past the stable edge may raise the loss over a hundred steps, each step within the noise of
the one before, so none of the above fires. The loss baseline against its lowest value since the last stage switch
or rollback does. The step is a spike whose episode begins at the low point (the rollback goes back before the
climb) when the climb is all of:
- large against the level: the baseline `divergence_rise` (10%) above its lowest;
- large against the noise: the baseline `divergence_z` (4) standard errors above the level of the window after the
  low point (the median of the center_window accepted losses that follow it). A standard error is that of a
  median, sqrt(pi/2) x sigma / sqrt(n), sigma being the larger of the window's own 1.4826 x MAD and the
  detector's noise. The low point itself is no fair reference: it is the lowest of many noisy medians, so it sits
  below the level by chance. The window after it was not chosen by that minimum, so it is.
- sustained: the baseline's window lies wholly after that window, so at least 2 x center_window accepted steps
  follow the low point, and the two medians share no step.
Why: a relative rise alone cannot tell a climb from the wobble of a median when single steps vary 4x (issue 46:
a clean run at loss 0.04 was rolled back three times and stopped). Measured: the natural divergences stood 4.1-7.7
standard errors up at their alarms; clean runs at every loss level stayed below 2, and 3,000-step plateaus of 35%
log-normal noise below 3.2 (docs/stability.md).

The detector is pure Python/numpy. Every rank must feed it identical numbers (the trainer
all-reduces loss and grad norm first); its decisions are then identical on every rank.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, replace
from itertools import islice
from typing import Any, Mapping

import numpy as np

from pretrain.stability.config import DetectorConfig

MAD_TO_SIGMA = 1.4826  # a normal distribution's sigma per unit of median absolute deviation
MEDIAN_SE = math.sqrt(math.pi / 2)  # a median's standard error per sigma / sqrt(n), for normal samples
# Smallest noise assumed, so a nearly constant signal does not turn every wiggle into a huge z:
LOSS_NOISE_FLOOR = 0.002  # relative to the loss baseline
LOG_GRAD_NOISE_FLOOR = 0.01  # in log space, i.e. 1% of the grad norm

KINDS = ("ok", "nonfinite", "outlier", "spike")

DomainLosses = Mapping[str, tuple[float, float]]
"""Per domain: (mean loss of its samples in the step, how many samples it had), identical on every rank."""


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
    mix_z: float | None = None
    """Robust z-score of the mix-adjusted loss rise (None without domain losses or their baselines)."""
    mix_rise: float | None = None
    """Token-weighted relative rise of each domain's loss over that domain's own baseline (None: not available)."""
    divergence: bool = False
    """spike only: a slow climb of the loss baseline (divergence_rise, divergence_z), not a run of outliers."""
    climb_z: float | None = None
    """Standard errors the loss baseline stands above the level of the window after its low point (None: not judged
    yet, or the baseline is at a new low)."""

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
        if self.mix_z is not None:
            out["stability/mix_z"] = self.mix_z
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Signal:
    """One signal's comparison with its baseline."""

    z: float
    baseline: float
    excess: float  # loss: relative rise; grad: ratio to baseline
    noise: float = 0.0  # the robust noise z was divided by (floor included)


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
        self._domains = DomainBaselines(cfg)
        self._lowest: tuple[float, int] | None = None  # (lowest loss baseline, its step) since a switch or rollback
        # (median, standard error, last step) of the center_window accepted losses after the low point, once complete:
        self._after_low: tuple[float, float, int] | None = None

    # -- judging ---------------------------------------------------------------------------------
    def observe(self, step: int, loss: float, grad_norm: float | None = None,
                domains: DomainLosses | None = None, clip_threshold: float = 0.0) -> Verdict:
        """Judge one step. Call once per optimizer step with values identical on every rank.

        domains: each domain's mean loss and sample count in this step (the total loss is their
        count-weighted mean); they give the mix-adjusted loss a stage switch's grace judges.
        clip_threshold: the gradient clipping this step's update gets (0 = none): a clipped step's grad norm is not
        extreme on its own (grad_alone_ratio), as its update is bounded whatever that norm.
        """
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
        mix_rise = self._domains.mix_rise(domains or {})
        mix_sig = self._compare_mix(step, mix_rise)
        judged = self._judge(step, loss, grad_norm, loss_sig, grad_sig, mix_sig, clip_threshold)
        climb_z = None
        if not judged.reasons:
            if judged.hold_out:
                self._suspects.append(step)
            else:
                self._history.append((step, float(loss), log_grad))
                self._domains.accept(step, domains or {}, mix_rise)
                diverging, climb_z = self._divergence(step, loss_sig)
                if diverging:
                    return self._diverged(step, loss, grad_norm, diverging, loss_sig, grad_sig, mix_sig, climb_z)
            return self._verdict(step, "ok", "", loss, grad_norm, loss_sig, grad_sig, note=judged.note, mix=mix_sig,
                                 climb_z=climb_z)
        for earlier in judged.repeats:  # the excursions this one confirms open its episode
            self._register_outlier(earlier)
        return self._flag(step, loss, grad_norm, "; ".join(judged.reasons), loss_sig, grad_sig, large=judged.large,
                          kind="outlier", mix=mix_sig)

    def _divergence(self, step: int, loss_sig: _Signal | None) -> tuple[str, float | None]:
        """(Why the loss is diverging, "" when it is not; the climb z of Verdict.climb_z): its baseline stands
        divergence_rise above the lowest one since the last stage switch or rollback, divergence_z standard errors
        above the level of the window after that low point, and its own window lies after that one (module
        docstring).

        A learning rate past the stable edge can raise the loss over a hundred steps, each step within the noise
        of the one before: the spike tests, which compare a step with the newest steps, never fire. The baseline
        this step was judged against (loss_sig's: the median of the newest center_window accepted losses) against
        its own low point does; a healthy run's baseline only falls within a stage. Not judged in a stage switch's
        grace (the new mix sets a new level, from which the low point starts again) nor while the detector warms up
        (no loss_sig). Called after this step joined the history."""
        cfg = self.cfg
        if cfg.divergence_rise <= 0 or loss_sig is None or step < self._loss_grace_until:
            return "", None
        baseline = loss_sig.baseline
        if self._lowest is None or baseline < self._lowest[0]:
            self._lowest = (baseline, step)
            self._after_low = None
            return "", None
        lowest, at = self._lowest
        risen = lowest > 0 and baseline >= lowest * (1 + cfg.divergence_rise)
        diverging = (f"the loss is diverging: its baseline {baseline:.4g} is {100 * (baseline / lowest - 1):.0f}% "
                     f"above its lowest {lowest:.4g} at step {at} (divergence_rise {100 * cfg.divergence_rise:g}%)"
                     if risen else "")
        if cfg.divergence_z <= 0:  # the relative rise alone
            return diverging, None
        window = cfg.center_window
        if self._after_low is None:
            after = list(islice(((s, value) for s, value, _ in self._history if s > at), window))
            if len(after) < window:
                return "", None  # the window after the low point is not complete yet
            values = np.array([value for _, value in after])
            self._after_low = (float(np.median(values)), median_standard_error(values, loss_sig.noise), after[-1][0])
        level, level_se, last = self._after_low
        # The baseline's own window: the newest accepted losses before this step (this one joined the history after).
        earlier = list(islice(((s, value) for s, value, _ in reversed(self._history) if s < step), window))[::-1]
        if len(earlier) < window or earlier[0][0] <= last:
            return "", None  # sustained: the baseline's window must lie wholly after the window after the low point
        se = median_standard_error(np.array([value for _, value in earlier]), loss_sig.noise)
        climb_z = (baseline - level) / math.hypot(se, level_se)
        if not diverging or climb_z < cfg.divergence_z:
            return "", climb_z
        return (f"{diverging}, and {climb_z:.1f} standard errors above the level {level:.4g} of the {window} "
                f"steps after it (divergence_z {cfg.divergence_z:g})"), climb_z

    def _diverged(self, step: int, loss: float, grad_norm: float | None, reason: str, loss_sig: _Signal | None,
                  grad_sig: _Signal | None, mix: _Signal | None, climb_z: float | None) -> Verdict:
        """A spike whose episode begins where the loss baseline was lowest: the rollback goes back before the
        climb. The low point starts again from here, so a lasting climb is reported again only divergence_rise higher."""
        begins = self._lowest[1]
        self._register_outlier(step)
        self._episode_start = min(self._episode_start if self._episode_start is not None else step, begins)
        self._lowest = None
        self._after_low = None
        verdict = self._verdict(step, "spike", reason, loss, grad_norm, loss_sig, grad_sig, mix=mix, climb_z=climb_z)
        return replace(verdict, divergence=True)

    def _compare(self, step: int, loss: float, log_grad: float | None) -> tuple[_Signal | None, _Signal | None]:
        """Both signals against their baselines; (None, None) while warming up."""
        if step < self.cfg.warmup_steps or len(self._history) < self.cfg.min_history:
            return None, None
        losses = np.fromiter((h[1] for h in self._history), dtype=np.float64)
        center, noise = robust_baseline(losses, self.cfg.center_window)
        noise = max(noise, LOSS_NOISE_FLOOR * abs(center))
        rise = loss / center - 1.0 if center > 0 else (math.inf if loss > center else 0.0)
        loss_sig = _Signal(z=(loss - center) / noise, baseline=center, excess=rise, noise=noise)
        grad_sig = None
        grads = np.array([h[2] for h in self._history if h[2] is not None], dtype=np.float64)
        if log_grad is not None and len(grads) >= self.cfg.min_history:
            g_center, g_noise = robust_baseline(grads, self.cfg.center_window)
            g_noise = max(g_noise, LOG_GRAD_NOISE_FLOOR)
            grad_sig = _Signal(z=(log_grad - g_center) / g_noise, baseline=math.exp(g_center),
                               excess=math.exp(log_grad - g_center))
        return loss_sig, grad_sig

    def _compare_mix(self, step: int, mix_rise: float | None) -> _Signal | None:
        """The mix-adjusted loss rise against the rises of accepted steps; None while warming up or without it.

        Its z uses the same robust statistics as the loss (the rises of a falling loss are centred near 0)."""
        history = self._domains.rises
        if mix_rise is None or step < self.cfg.warmup_steps or len(history) < self.cfg.min_history:
            return None
        rises = np.fromiter((r for _, r in history), dtype=np.float64)
        center, noise = robust_baseline(rises, self.cfg.center_window)
        noise = max(noise, LOSS_NOISE_FLOOR)  # the rise is relative already
        return _Signal(z=(mix_rise - center) / noise, baseline=center, excess=mix_rise)

    def _loss_view(self, step: int, loss_sig: _Signal | None, mix_sig: _Signal | None) -> tuple[_Signal | None, str]:
        """The loss signal judged at `step` and how: "loss" (the total, as always), "mix" (the mix-adjusted loss,
        in a stage switch's grace) or "none" (in that grace without a domain that has a level: nothing to compare
        the loss with, since a stage of new domains may start far above the old level)."""
        if step >= self._loss_grace_until:
            return loss_sig, "loss"
        if mix_sig is not None:
            return mix_sig, "mix"
        return None, "none"

    def _judge(self, step: int, loss: float, grad_norm: float | None, loss_sig: _Signal | None,
               grad_sig: _Signal | None, mix_sig: _Signal | None = None, clip_threshold: float = 0.0) -> _Judgement:
        """Which signals cross their thresholds, and whether each crossing is confirmed (module docstring)."""
        cfg = self.cfg
        in_grace = step < self._loss_grace_until
        grad_judged = cfg.use_grad_norm and grad_sig is not None
        view, how = self._loss_view(step, loss_sig, mix_sig)
        loss_cross = view is not None and view.z >= cfg.loss_z and view.excess >= cfg.loss_min_rise
        grad_cross = grad_judged and grad_sig.z >= cfg.grad_z and grad_sig.excess >= cfg.grad_min_ratio
        if not (loss_cross or grad_cross):
            return _Judgement([])
        recent = self._recent_steps(step)
        reasons, notes, large, hold_out = [], [], False, False
        if loss_cross:
            what = _loss_text(loss, view, how, cfg.loss_z)
            alone = f"+{100 * cfg.loss_alone_rise:.0f}% and z {cfg.loss_alone_z:g}"
            # Extreme on its own takes both: a rise of loss_alone_rise is ordinary where single steps vary 4x (a low
            # loss), and a z of loss_alone_z is ordinary where the noise is tiny (a quiet phase).
            extreme = view.excess >= cfg.loss_alone_rise and view.z >= cfg.loss_alone_z
            # Both signals crossing confirm each other; the message then reads as it always did.
            why = "" if grad_cross else self._confirmation(
                other=("grad norm", grad_sig.z) if grad_judged else None,
                alone=extreme, alone_text=alone, recent=recent)
            if why is None:
                notes.append(f"{what}, unconfirmed (grad norm z {grad_sig.z:.1f} < {cfg.confirm_z:g}, below {alone}, "
                             f"no other excursion within {cfg.sustained_window} steps): update applied, step kept "
                             "out of the statistics")
                hold_out = True
            else:
                reasons.append(what + why)
                large |= cfg.large_loss_rise > 0 and view.excess >= cfg.large_loss_rise
        if grad_cross:
            what = (f"grad norm {grad_norm:.4g} is {grad_sig.excess:.1f}x its baseline "
                    f"{grad_sig.baseline:.4g} (robust z {grad_sig.z:.1f} >= {cfg.grad_z:g})")
            # A clipped step's update is bounded by the clip threshold whatever its grad norm, so an extreme norm is
            # no harm on its own: applying a clean run's lone 11.7x step (clipped to 1.0) moved the next 100 steps'
            # loss by < 0.5% and its val loss not at all (docs/stability.md). Unclipped, it could be a huge update.
            # Extreme takes a z of grad_alone_z too: at a low loss a clean grad norm reaches 6-9x (docs/stability.md).
            large_ratio = grad_sig.excess >= cfg.grad_alone_ratio
            extreme = large_ratio and grad_sig.z >= cfg.grad_alone_z
            bounded = extreme and 0 < clip_threshold < grad_norm
            alone = extreme and not bounded
            alone_text = f"clipped to {clip_threshold:.4g}" if bounded else f"{cfg.grad_alone_ratio:g}x"
            if large_ratio and not extreme:
                alone_text += f" with z {cfg.grad_alone_z:g}"
            if in_grace:
                # Right after a stage switch the total loss cannot confirm (the new mix moves it) but the mix-adjusted
                # loss can, and only an outlier counts as a repeat: smaller rises are the new stage's level and enter
                # the statistics.
                other = ("mix-adjusted loss", mix_sig.z) if how == "mix" else None
                why = "" if loss_cross else self._confirmation(
                    other=other, alone=alone, alone_text=alone_text,
                    recent=[s for s in recent if s in self._outliers], no_other_is_alone=False)
                if why is None:
                    notes.append(f"{what}, within {cfg.stage_switch_grace_steps} steps of a stage switch and "
                                 f"{_limit_text(bounded, alone_text)}: taken as the new stage's level")
            else:
                why = "" if loss_cross else self._confirmation(
                    other=("loss", loss_sig.z), alone=alone, alone_text=alone_text, recent=recent)
                if why is None:
                    notes.append(f"{what}, unconfirmed (loss z {loss_sig.z:.1f} < {cfg.confirm_z:g}, "
                                 f"{_limit_text(bounded, alone_text)}, no other excursion within "
                                 f"{cfg.sustained_window} steps): update applied, step kept out of the statistics")
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
              grad_sig: _Signal | None, *, large: bool, kind: str, mix: _Signal | None = None) -> Verdict:
        """Record an outlier (not in the statistics) and escalate it to a spike when warranted."""
        count = self._register_outlier(step)
        sustained = count >= self.cfg.sustained_count
        if large or sustained:
            why = "large" if large else f"{count} outliers in the last {self.cfg.sustained_window} steps"
            reason = f"{reason}; spike ({why}, episode since step {self._episode_start})"
            kind = "spike"
        return self._verdict(step, kind, reason, loss, grad_norm, loss_sig, grad_sig, mix=mix)

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
                 loss_sig: _Signal | None, grad_sig: _Signal | None, note: str = "",
                 mix: _Signal | None = None, climb_z: float | None = None) -> Verdict:
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
            mix_z=None if mix is None else mix.z,
            mix_rise=None if mix is None else mix.excess,
            climb_z=climb_z,
        )

    # -- control from the trainer ---------------------------------------------------------------
    def low_point(self) -> int | None:
        """The step where the loss baseline was lowest since the last stage switch or rollback (None: not judged
        yet): the recovery ring keeps a checkpoint from before it, so a divergence found a hundred steps into its
        climb can still roll back before the climb."""
        return self._lowest[1] if self._lowest else None

    def in_episode(self, step: int) -> bool:
        """True while an outlier episode is open at `step`: a checkpoint taken now is suspect."""
        return bool(self._outliers) and self._outliers[-1] > step - self.cfg.sustained_window

    def note_stage_switch(self, step: int) -> None:
        """A curriculum stage switch at `step`: for stage_switch_grace_steps judge the mix-adjusted loss
        instead of the total (not at all without a domain that has a level), and let the grad
        norm flag a step only at grad_alone_ratio, when it repeats an outlier or when the mix-adjusted
        loss confirms it.

        The losses and the smaller grad-norm rises still enter the statistics, so both baselines
        settle on the new stage's level during the grace period. With confirm_z = 0 the grad norm
        is judged as usual.
        """
        self._loss_grace_until = step + self.cfg.stage_switch_grace_steps
        self._lowest = None  # the new mix has its own level
        self._after_low = None

    def rewind(self, to_step: int) -> None:
        """After a rollback to checkpoint `to_step`: forget steps >= to_step and the open episode.

        The statistics become those the run had at that checkpoint; if too few remain, the
        detector warms up again (min_history), which is the honest state after a rollback.
        """
        self._history = deque((h for h in self._history if h[0] < to_step), maxlen=self.cfg.window)
        self._outliers.clear()
        self._suspects.clear()
        self._episode_start = None
        self._domains.rewind(to_step)
        self._lowest = None
        self._after_low = None

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (no NaN: a missing grad norm is None)."""
        return {
            "history": [list(h) for h in self._history],
            "outliers": list(self._outliers),
            "suspects": list(self._suspects),
            "episode_start": self._episode_start,
            "loss_grace_until": self._loss_grace_until,
            "domains": self._domains.state_dict(),
            "lowest": list(self._lowest) if self._lowest else None,
            "after_low": list(self._after_low) if self._after_low else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._history = deque(((int(s), float(l), None if g is None else float(g)) for s, l, g in state["history"]),
                              maxlen=self.cfg.window)
        self._outliers = deque(int(s) for s in state["outliers"])
        self._suspects = deque(int(s) for s in state.get("suspects", ()))  # absent in checkpoints before confirmation
        self._episode_start = state["episode_start"]
        self._loss_grace_until = int(state["loss_grace_until"])
        self._domains = DomainBaselines(self.cfg)
        if "domains" in state:  # absent in checkpoints before the mix-adjusted loss: it warms up again
            self._domains.load_state_dict(state["domains"])
        lowest = state.get("lowest")  # absent in checkpoints before the divergence test: the low point starts again
        self._lowest = (float(lowest[0]), int(lowest[1])) if lowest else None
        after = state.get("after_low")  # absent in checkpoints before divergence_z: taken again from the history
        self._after_low = (float(after[0]), float(after[1]), int(after[2])) if after and self._lowest else None


def _limit_text(bounded: bool, alone_text: str) -> str:
    """Why a grad-norm crossing is not extreme on its own: below grad_alone_ratio, or clipped (its update bounded)."""
    return f"{alone_text}, so its update is bounded" if bounded else f"below {alone_text}"


def _loss_text(loss: float, view: _Signal, how: str, threshold: float) -> str:
    """What crossed, for a reason: the total loss, or the mix-adjusted loss after a stage switch."""
    if how == "mix":
        return (f"loss {loss:.4g}: its domains' losses are {100 * view.excess:.0f}% above their own baselines "
                f"(mix-adjusted, within a stage switch's grace; robust z {view.z:.1f} >= {threshold:g})")
    return (f"loss {loss:.4g} is {100 * view.excess:.0f}% above its baseline {view.baseline:.4g} "
            f"(robust z {view.z:.1f} >= {threshold:g})")


class DomainBaselines:
    """Each domain's loss baseline, and the mix-adjusted rises of accepted steps.

    A domain's baseline is the median of its mean loss over the newest center_window accepted steps
    that had samples of it; it counts once it has domain_min_steps of them (a stage's new domain has
    no level yet and is left out). The mix-adjusted rise of a step is sum(n_d * loss_d) /
    sum(n_d * baseline_d) - 1 over the domains with a baseline: the token-weighted relative rise of
    each domain's loss over its own level, which a change of mix does not move.
    """

    def __init__(self, cfg: DetectorConfig):
        self.cfg = cfg
        self.levels: dict[str, deque[tuple[int, float]]] = {}
        self.rises: deque[tuple[int, float]] = deque(maxlen=cfg.window)  # (step, rise) of accepted steps

    def baseline(self, name: str) -> float | None:
        level = self.levels.get(name)
        if level is None or len(level) < max(1, self.cfg.domain_min_steps):
            return None
        return float(np.median([value for _, value in level]))

    def mix_rise(self, domains: DomainLosses) -> float | None:
        """The step's mix-adjusted rise; None when no domain of it has a baseline."""
        actual = expected = 0.0
        for name, (mean, count) in domains.items():
            base = self.baseline(name)
            if base is None or count <= 0 or not math.isfinite(mean):
                continue
            actual += count * mean
            expected += count * base
        return actual / expected - 1.0 if expected > 0 else None

    def accept(self, step: int, domains: DomainLosses, rise: float | None) -> None:
        """An accepted step: its domain losses join their levels, its rise the rises' history."""
        for name, (mean, count) in domains.items():
            if count > 0 and math.isfinite(mean):
                self.levels.setdefault(name, deque(maxlen=self.cfg.center_window)).append((step, float(mean)))
        if rise is not None:
            self.rises.append((step, rise))

    def rewind(self, to_step: int) -> None:
        """Forget steps >= to_step (a rollback)."""
        self.levels = {name: deque(((s, v) for s, v in level if s < to_step), maxlen=self.cfg.center_window)
                       for name, level in self.levels.items()}
        self.rises = deque(((s, r) for s, r in self.rises if s < to_step), maxlen=self.cfg.window)

    def state_dict(self) -> dict[str, Any]:
        return {"levels": {name: [list(x) for x in level] for name, level in self.levels.items()},
                "rises": [list(x) for x in self.rises]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.levels = {name: deque(((int(s), float(v)) for s, v in level), maxlen=self.cfg.center_window)
                       for name, level in state["levels"].items()}
        self.rises = deque(((int(s), float(r)) for s, r in state["rises"]), maxlen=self.cfg.window)


def median_standard_error(values: np.ndarray, noise: float = 0.0) -> float:
    """The standard error of the median of `values`: sqrt(pi/2) x sigma / sqrt(n) (normal samples).

    sigma is the larger of the values' own robust spread (1.4826 x their MAD) and `noise`, the detector's
    trend-free step-to-step noise. The spread sees a slow wander within the window that step-to-step changes miss;
    the noise keeps a window that happens to be calm from claiming a tiny error."""
    if len(values) == 0:
        return math.inf
    spread = MAD_TO_SIGMA * mad(values)
    return MEDIAN_SE * max(spread, noise) / math.sqrt(len(values))


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
    return center, MAD_TO_SIGMA * mad(np.diff(values)) / math.sqrt(2.0)


def mad(values: np.ndarray) -> float:
    """The median absolute deviation of `values` from their median (x MAD_TO_SIGMA: a normal sigma)."""
    return float(np.median(np.abs(values - np.median(values))))
