"""SpikeDetector on recorded and synthetic loss curves: no false alarms, spikes found at the right step."""
import json
import math

import numpy as np
import pytest

from pretrain.stability.config import DetectorConfig
from pretrain.stability.detector import SpikeDetector, robust_baseline
from tests.pretrain.stability.curves import (
    RECORDED_EVENT, Curve, normal_curve, recorded, with_palm_spike, with_single_bad_batch, with_stage_switch,
)


def observe_all(detector: SpikeDetector, curve: Curve, start: int = 0, stop: int | None = None):
    stop = len(curve) if stop is None else stop
    return [detector.observe(step, float(curve.loss[step]), float(curve.grad_norm[step])) for step in range(start, stop)]


def alarms(verdicts):
    return [(v.step, v.kind) for v in verdicts if v.kind != "ok"]


# -- no false alarms ----------------------------------------------------------------------------
def test_no_alarm_on_the_recorded_normal_curve():
    assert alarms(observe_all(SpikeDetector(DetectorConfig()), recorded("normal"))) == []


@pytest.mark.parametrize("seed", range(5))
def test_no_alarm_on_synthetic_normal_curves(seed):
    assert alarms(observe_all(SpikeDetector(DetectorConfig()), normal_curve(seed=seed))) == []


def test_no_alarm_on_an_early_fast_falling_loss_even_with_a_short_warmup():
    # Judging from step 10 on: the loss falls from ~9 to ~4.8 over the first 200 steps.
    cfg = DetectorConfig(warmup_steps=10, min_history=10)
    verdicts = observe_all(SpikeDetector(cfg), normal_curve(seed=1), stop=400)
    assert verdicts[10].loss_z is not None  # it is judging, not warming up
    assert alarms(verdicts) == []


def test_no_alarm_on_a_stage_switch_bump_that_is_many_sigmas():
    curve = with_stage_switch(normal_curve(seed=2), at=1200)
    verdicts = observe_all(SpikeDetector(DetectorConfig()), curve)
    assert alarms(verdicts) == []
    # The +8% bump is far beyond the 0.8% batch noise: the z-score alone would have fired, and
    # the loss_min_rise gate is what keeps it quiet.
    assert max(v.loss_z for v in verdicts[1200:1205]) > DetectorConfig().loss_z


def test_a_real_domain_switch_is_quiet_when_the_trainer_reports_it():
    curve = recorded("switch")  # +150% at step 500: a new domain, not a curriculum bump
    unannounced = observe_all(SpikeDetector(DetectorConfig()), curve)
    assert any(v.kind == "spike" for v in unannounced[RECORDED_EVENT:RECORDED_EVENT + 5])

    detector = SpikeDetector(DetectorConfig())
    verdicts = observe_all(detector, curve, stop=RECORDED_EVENT)
    detector.note_stage_switch(RECORDED_EVENT)
    verdicts += observe_all(detector, curve, start=RECORDED_EVENT)
    assert alarms(verdicts) == []
    # After the grace period the baseline sits on the new stage's level.
    assert verdicts[-1].baseline_loss > 2.0


# -- spikes found -------------------------------------------------------------------------------
def test_the_recorded_lr_spike_is_found_at_the_right_step():
    # LR x50 at step 500: step 501's loss (on the updated weights) is the first to show it.
    verdicts = observe_all(SpikeDetector(DetectorConfig()), recorded("spike"), stop=RECORDED_EVENT + 10)
    first = [v for v in verdicts if v.kind != "ok"]
    assert [(v.step, v.kind) for v in first[:3]] == [(501, "outlier"), (502, "outlier"), (503, "spike")]
    assert first[2].spike_start == 501
    assert "loss" in first[0].reason and "above its baseline" in first[0].reason


def test_a_palm_like_spike_is_found_within_three_steps_of_its_start():
    at = 1500
    verdicts = observe_all(SpikeDetector(DetectorConfig()), with_palm_spike(normal_curve(seed=3), at))
    assert alarms(verdicts[:at]) == []
    spike = next(v for v in verdicts if v.kind == "spike")
    assert spike.step == at + 2 and spike.spike_start == at
    # Both signals saw it; grad norm by its ratio, loss by its rise.
    assert spike.grad_ratio > 3 and spike.loss_rise > 0.3


def test_spike_steps_do_not_pollute_the_statistics():
    at = 1500
    curve = with_palm_spike(normal_curve(seed=3), at)
    verdicts = observe_all(SpikeDetector(DetectorConfig()), curve)
    before = verdicts[at - 1].baseline_loss
    # 50 steps into the spike the baseline is still the pre-spike one, and the steps still flag.
    assert verdicts[at + 50].baseline_loss == pytest.approx(before, rel=0.01)
    assert verdicts[at + 50].kind == "spike"


def test_a_single_bad_batch_is_an_outlier_not_a_spike():
    at = 900
    verdicts = observe_all(SpikeDetector(DetectorConfig()), with_single_bad_batch(normal_curve(seed=4), at))
    assert alarms(verdicts) == [(at, "outlier")]
    assert verdicts[at].episode_start == at
    assert verdicts[at + 20].episode_start is None  # the episode closed


def test_a_large_threshold_makes_one_step_a_spike():
    at = 900
    cfg = DetectorConfig(large_loss_rise=1.0)
    verdicts = observe_all(SpikeDetector(cfg), with_single_bad_batch(normal_curve(seed=4), at))
    assert alarms(verdicts) == [(at, "spike")]
    assert "large" in verdicts[at].reason


def test_grad_norm_alone_can_flag_a_step():
    curve = normal_curve(seed=5)
    grad = curve.grad_norm.copy()
    grad[800] *= 50  # BLOOM-like: the grad norm jumps, the loss hardly moves
    verdicts = observe_all(SpikeDetector(DetectorConfig()), Curve(curve.loss, grad))
    assert alarms(verdicts) == [(800, "outlier")]
    assert verdicts[800].grad_ratio > 30 and "grad norm" in verdicts[800].reason
    quiet = observe_all(SpikeDetector(DetectorConfig(use_grad_norm=False)), Curve(curve.loss, grad))
    assert alarms(quiet) == []


# -- non-finite ---------------------------------------------------------------------------------
def test_non_finite_values_are_caught_at_once_even_during_warmup():
    detector = SpikeDetector(DetectorConfig())
    assert detector.observe(0, 10.0, 1.0).kind == "ok"
    nan = detector.observe(1, math.nan, 1.0)
    assert nan.kind == "nonfinite" and "non-finite loss" in nan.reason and nan.score == math.inf
    assert detector.observe(2, 9.0, math.inf).kind == "nonfinite"
    third = detector.observe(3, math.inf, 1.0)
    assert third.kind == "spike" and third.spike_start == 1  # three within 10 steps
    json.dumps(detector.state_dict(), allow_nan=False)  # raises if a NaN/inf entered the statistics


def test_grad_norm_is_optional():
    detector = SpikeDetector(DetectorConfig())
    curve = normal_curve(seed=6)
    verdicts = [detector.observe(s, float(curve.loss[s]), None) for s in range(600)]
    assert alarms(verdicts) == [] and verdicts[-1].grad_z is None and verdicts[-1].loss_z is not None


# -- control and state --------------------------------------------------------------------------
def test_rewind_forgets_the_abandoned_steps():
    curve = recorded("spike")
    detector = SpikeDetector(DetectorConfig())
    observe_all(detector, curve, stop=RECORDED_EVENT + 10)
    assert detector.in_episode(RECORDED_EVENT + 9)
    detector.rewind(400)  # rolled back to checkpoint 400
    assert not detector.in_episode(400)
    assert max(step for step, _, _ in detector.state_dict()["history"]) == 399
    # The replay (here: the clean run) raises nothing.
    assert alarms(observe_all(detector, recorded("normal"), start=400)) == []


def test_state_dict_round_trip_gives_identical_verdicts():
    curve = with_palm_spike(normal_curve(seed=7), 1500)
    straight = observe_all(SpikeDetector(DetectorConfig()), curve)
    first = SpikeDetector(DetectorConfig())
    observe_all(first, curve, stop=1502)  # mid-episode
    resumed = SpikeDetector(DetectorConfig())
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert observe_all(resumed, curve, start=1502) == straight[1502:]


def test_metrics_and_thresholds_are_reported():
    detector = SpikeDetector(DetectorConfig())
    curve = normal_curve(seed=8)
    verdict = observe_all(detector, curve, stop=300)[-1]
    metrics = verdict.metrics()
    assert set(metrics) == {"stability/spike_score", "stability/outlier", "stability/nonfinite", "stability/loss_z",
                            "stability/grad_z", "stability/unconfirmed"}
    nan = detector.observe(300, math.nan, 1.0).metrics()
    assert nan["stability/nonfinite"] == 1.0 and "stability/spike_score" not in nan
    assert verdict.loss_z_threshold == 6.0 and verdict.grad_z_threshold == 6.0
    assert verdict.to_dict()["kind"] == "ok"


def test_robust_baseline_ignores_trend_and_single_jumps():
    rng = np.random.default_rng(0)
    values = np.linspace(5.0, 3.0, 200) + 0.01 * rng.standard_normal(200)
    values[100] += 1.0
    center, noise = robust_baseline(values, 20)
    assert center == pytest.approx(np.median(np.linspace(5.0, 3.0, 200)[-20:]), abs=0.01)
    assert noise == pytest.approx(0.01, rel=0.25)  # the trend (-0.01/step) and the jump do not count


# -- divergence: a slow climb ------------------------------------------------------------------------
def with_slow_climb(curve: Curve, at: int, rise: float = 0.25, over: int = 150) -> Curve:
    """The loss climbs linearly by `rise` over `over` steps from `at` and stays up (an LR past its edge): each
    step within the 0.8% noise of the one before."""
    loss = curve.loss.copy()
    loss[at:] *= 1 + rise * np.minimum(1.0, (np.arange(len(loss) - at) + 1) / over)
    return Curve(loss, curve.grad_norm.copy())


def test_a_slow_climb_is_a_divergence_spike_that_begins_where_the_loss_was_lowest():
    verdicts = observe_all(SpikeDetector(DetectorConfig()), with_slow_climb(normal_curve(seed=3), at=1200))
    first = next(v for v in verdicts if v.kind != "ok")
    # +10% of the baseline after ~60 steps of climb, plus the median's lag of half its window.
    assert first.kind == "spike" and 1255 <= first.step <= 1285, first
    assert "the loss is diverging" in first.reason and 1190 <= first.spike_start <= 1210
    assert max(abs(v.loss_z) for v in verdicts[1200:first.step]) < DetectorConfig().loss_z  # no step stood out
    # The low point starts again at the alarm: the next one only after another 10%.
    assert [v.step for v in verdicts if v.kind == "spike"][:2] == [first.step] or \
        [v.step for v in verdicts if v.kind == "spike"][1] > first.step + 20
    assert alarms(observe_all(SpikeDetector(DetectorConfig(divergence_rise=0)),
                              with_slow_climb(normal_curve(seed=3), at=1200))) == []


def test_a_stage_switch_gives_the_loss_a_new_low_point():
    curve = normal_curve(seed=3)
    curve.loss[1200:] *= 1.2  # a new mix, 20% harder, for good
    detector = SpikeDetector(DetectorConfig())
    verdicts = observe_all(detector, curve, stop=1200)
    detector.note_stage_switch(1200)
    verdicts += observe_all(detector, curve, start=1200)
    assert alarms(verdicts) == []


def test_the_low_point_survives_a_restart_and_is_forgotten_by_a_rollback():
    curve = with_slow_climb(normal_curve(seed=3), at=1200)
    whole = observe_all(SpikeDetector(DetectorConfig()), curve)
    first = next(v.step for v in whole if v.kind != "ok")
    detector = SpikeDetector(DetectorConfig())
    observe_all(detector, curve, stop=1240)
    restored = SpikeDetector(DetectorConfig())
    restored.load_state_dict(json.loads(json.dumps(detector.state_dict())))
    assert [v.kind for v in observe_all(restored, curve, start=1240)] == [v.kind for v in whole[1240:]]
    rewound = SpikeDetector(DetectorConfig())
    observe_all(rewound, curve, stop=first)
    rewound.rewind(first - 5)  # as after a rollback: the climb so far is the new low point's start
    assert all(v.kind == "ok" for v in observe_all(rewound, curve, start=first - 5, stop=first + 20))
