"""LossScaleWatchdog driven by a model of DeepSpeed's dynamic loss scaler."""
import json

import pytest

from pretrain.stability.config import WatchdogConfig
from pretrain.stability.watchdog import LossScaleWatchdog


class FakeScaler:
    """DeepSpeed's DynamicLossScaler as docs/deepspeed-on-cpu.md describes it: an overflow skips the step
    and halves the scale once hysteresis is used up; a window without overflow doubles it; an
    overflow at the minimum scale raises."""

    def __init__(self, scale=2.0 ** 16, min_scale=1.0, hysteresis=2, window=1000):
        self.scale, self.min_scale, self.window = scale, min_scale, window
        self.delayed_shift = self.hysteresis = hysteresis
        self.good_steps = 0

    def step(self, overflow: bool) -> bool:
        """Returns whether the update was applied."""
        if not overflow:
            self.good_steps += 1
            if self.good_steps % self.window == 0:
                self.scale *= 2
            return True
        if self.scale <= self.min_scale:
            raise RuntimeError("Current loss scale already at minimum - cannot decrease scale anymore")
        self.good_steps = 0
        if self.hysteresis > 1:
            self.hysteresis -= 1
        else:
            self.scale = max(self.scale / 2, self.min_scale)
        return False

    def reset(self, value: float) -> None:  # what TrainEngine.reset_loss_scale does
        self.scale, self.hysteresis = value, self.delayed_shift


def drive(watchdog, scaler, overflow_steps, steps):
    """Run `steps` steps; apply every reset; return the watchdog actions that were not 'none'."""
    actions = []
    for step in range(steps):
        applied = scaler.step(step in overflow_steps)
        action = watchdog.observe(step, scaler.scale, applied)
        if action.kind == "reset_scale":
            scaler.reset(action.value)
        if action.kind != "none":
            actions.append((step, action))
        if action.kind == "rollback":
            break
    return actions


def test_normal_fp16_training_with_rare_overflows_is_left_alone():
    watchdog = LossScaleWatchdog(WatchdogConfig(), min_loss_scale=1.0)
    overflows = set(range(0, 6)) | {1500, 2600, 3700}  # the initial scale search, then the odd probe
    assert drive(watchdog, FakeScaler(), overflows, 4000) == []
    assert watchdog.total_skips == 9


def test_the_scale_is_reset_before_the_floor_and_rollback_follows_persisting_overflows():
    watchdog = LossScaleWatchdog(WatchdogConfig(max_resets=2), min_loss_scale=1.0)
    scaler = FakeScaler()
    actions = drive(watchdog, scaler, set(range(200, 400)), 400)  # would raise at the floor without resets
    kinds = [a.kind for _, a in actions]
    assert kinds == ["reset_scale", "reset_scale", "rollback"]
    first_step, first = actions[0]
    assert first.value == 2.0 ** 16 and "within 2^3 of the floor" in first.reason
    assert first_step < 220  # 14 halvings after one hysteresis overflow: 2^16 -> 2^2 ... reset at <= 8
    assert actions[-1][1].overflow_start == 200 and "after 2 loss-scale resets" in actions[-1][1].reason


def test_consecutive_skips_trigger_a_reset_even_at_a_high_scale():
    cfg = WatchdogConfig(max_consecutive_skips=4, floor_margin_power=0)
    watchdog = LossScaleWatchdog(cfg, min_loss_scale=1.0)
    scaler = FakeScaler(scale=2.0 ** 30)
    actions = drive(watchdog, scaler, set(range(10, 14)), 100)
    assert [(step, a.kind) for step, a in actions] == [(13, "reset_scale")]
    assert "4 overflow-skipped steps in a row" in actions[0][1].reason


def test_old_resets_are_forgotten_after_the_window():
    cfg = WatchdogConfig(max_resets=1, reset_window_steps=100, max_consecutive_skips=3)
    watchdog = LossScaleWatchdog(cfg, min_loss_scale=1.0)
    assert watchdog.observe(10, 2.0 ** 16, True).kind == "none"
    for step in (11, 12, 13):
        action = watchdog.observe(step, 2.0 ** 16, False)
    assert action.kind == "reset_scale"
    for step in (200, 201, 202):  # 190 steps later: a fresh problem, not a repeat
        action = watchdog.observe(step, 2.0 ** 16, False)
    assert action.kind == "reset_scale"
    for step in (203, 204, 205):
        action = watchdog.observe(step, 2.0 ** 16, False)
    assert action.kind == "rollback"


def test_inactive_without_a_loss_scale_or_when_disabled():
    assert LossScaleWatchdog(WatchdogConfig(), 1.0).observe(5, None, False).kind == "none"  # bf16 / fp32
    off = LossScaleWatchdog(WatchdogConfig(enabled=False), 1.0)
    assert off.observe(5, 1.0, False).kind == "none"


def test_rewind_and_state_round_trip():
    watchdog = LossScaleWatchdog(WatchdogConfig(max_consecutive_skips=2), min_loss_scale=1.0)
    watchdog.observe(1, 1024.0, False)
    watchdog.observe(2, 1024.0, False)
    restored = LossScaleWatchdog(WatchdogConfig(max_consecutive_skips=2), min_loss_scale=1.0)
    restored.load_state_dict(json.loads(json.dumps(watchdog.state_dict())))
    assert restored.state_dict() == watchdog.state_dict() and len(restored.resets) == 1
    restored.rewind()
    assert restored.metrics() == {"stability/consecutive_skips": 0.0, "stability/loss_scale_resets": 0.0}


def test_reset_value_must_clear_the_margin():
    from pretrain.stability.config import StabilityConfig, StabilityConfigError, check_stability_config

    cfg = StabilityConfig(watchdog=WatchdogConfig(reset_scale_power=3, floor_margin_power=3))
    with pytest.raises(StabilityConfigError, match="reset_scale_power"):
        check_stability_config(cfg, min_loss_scale=1.0)
