"""RecoveryPolicy: escalation, rollback targets, recovery ring, cool-down, stop message, state."""
import json

import pytest

from pretrain.stability.config import RecoveryConfig, StabilityConfig
from pretrain.stability.detector import Verdict
from pretrain.stability.policy import (
    RecoveryPolicy, StepRanges, choose_rollback_checkpoint, ring_checkpoints_to_delete,
)


def verdict(step, kind, start=None):
    return Verdict(step=step, kind=kind, reason=f"{kind} at {step}", loss=3.0, grad_norm=1.0,
                   episode_start=start if start is not None else (None if kind == "ok" else step))


def policy(action="recover", enabled=True, **recovery):
    return RecoveryPolicy(StabilityConfig(enabled=enabled, action=action, recovery=RecoveryConfig(**recovery)))


RING = [0, 50, 100, 150, 200, 250, 300]


# -- rollback target ----------------------------------------------------------------------------
def test_rollback_goes_at_least_rollback_steps_before_the_spike():
    assert choose_rollback_checkpoint(RING, 301, 100).step == 200
    assert choose_rollback_checkpoint(RING, 300, 100).step == 200
    assert choose_rollback_checkpoint(RING, 299, 100).step == 150
    assert choose_rollback_checkpoint(RING, 301, 100).note == ""


def test_rollback_never_uses_a_checkpoint_taken_during_a_spike():
    bad = StepRanges([(195, 205)])
    assert choose_rollback_checkpoint(RING, 301, 100, bad).step == 150


def test_rollback_falls_back_to_the_oldest_good_checkpoint_with_a_note():
    choice = choose_rollback_checkpoint([50, 100], 120, 100)
    assert choice.step == 50 and "70 steps before" in choice.note


def test_rollback_has_no_target_without_a_good_checkpoint_before_the_spike():
    assert choose_rollback_checkpoint([], 120, 100).step is None
    choice = choose_rollback_checkpoint([120, 150], 120, 100)  # checkpoint 120 is the spike's own weights
    assert choice.step is None and "120, 150" in choice.note


def test_step_ranges_merge_and_contain():
    ranges = StepRanges()
    ranges.add(10, 12)
    ranges.add(13, 15)  # adjacent: merged
    ranges.add(30, 30)
    ranges.add(14, 31)  # bridges both
    assert ranges.to_list() == [[10, 31]]
    assert 20 in ranges and 9 not in ranges and "20" not in ranges


# -- recovery ring ------------------------------------------------------------------------------
def test_ring_keeps_the_newest_and_the_rollback_target():
    assert ring_checkpoints_to_delete([0, 50, 100, 150, 200], keep=2, current_step=200, rollback_steps=100) == [0, 50]
    # keep=1 still keeps the checkpoint rollback_steps back
    assert ring_checkpoints_to_delete([0, 50, 100, 150, 200], keep=1, current_step=200, rollback_steps=100) == \
        [0, 50, 150]


def test_ring_deletes_checkpoints_from_a_spike_but_never_the_newest_good_one():
    bad = StepRanges([(150, 200)])
    assert ring_checkpoints_to_delete([0, 50, 100, 150, 200], 1, 200, 100, bad) == [0, 50, 150, 200]
    assert ring_checkpoints_to_delete([100], 3, 120, 100) == []


@pytest.mark.parametrize("interval,keep", [(50, 3), (50, 1), (30, 2), (70, 2), (10, 5)])
def test_ring_always_allows_a_rollback_far_enough_back(interval, keep):
    rollback, ring = 100, []
    for step in range(0, 2000):
        if step % interval == 0:
            ring.append(step)
            for gone in ring_checkpoints_to_delete(ring, keep, step, rollback):
                ring.remove(gone)
            assert len(ring) <= keep + 1
        if step >= rollback:  # a spike beginning at this step can go rollback_steps back
            assert choose_rollback_checkpoint(ring, step, rollback).note == "", (step, ring)


# -- decisions ----------------------------------------------------------------------------------
def test_escalation_ok_outlier_spike():
    pol = policy()
    assert pol.decide(verdict(400, "ok"), 400, RING).kind == "none"
    assert pol.decide(verdict(401, "nonfinite"), 401, RING).kind == "skip_update"
    assert pol.decide(verdict(410, "outlier"), 410, RING).kind == "skip_update"
    action = pol.decide(verdict(412, "spike", start=410), 412, RING)
    assert action.kind == "rollback" and action.to_step == 300
    assert (action.skip_batches, action.lr_factor, action.cooldown_steps) == (200, 0.5, 200)
    assert action.reset_loss_scale == 2.0 ** 16 and action.new_eps is None and action.new_beta1 is None
    assert pol.skipped_updates == 2 and len(pol.recoveries) == 1
    kinds = [e["event"] for e in pol.new_events()]
    assert kinds == ["skip_update", "skip_update", "spike", "rollback"]
    assert pol.new_events() == []
    assert "roll back to step 300; skip 200 batches; LR x0.5 for 200 steps" in pol.events[-1]["message"]


def test_the_spike_start_marks_checkpoints_bad():
    pol = policy()
    pol.decide(verdict(148, "outlier"), 148, RING)
    pol.decide(verdict(153, "outlier", start=148), 153, RING)  # the ring saved 150 in between
    assert pol.is_bad_checkpoint(150) and not pol.is_bad_checkpoint(100)
    action = pol.decide(verdict(155, "spike", start=148), 155, [0, 50, 100, 150])
    assert action.to_step == 0  # <= 48 and not 150


def test_optimizer_overrides_apply_from_the_first_recovery_on():
    pol = policy(adam_eps=1e-10, adam_beta1=0.8)
    assert pol.optimizer_overrides() == {}
    action = pol.decide(verdict(500, "spike"), 500, RING)
    assert (action.new_eps, action.new_beta1) == (1e-10, 0.8)
    assert pol.optimizer_overrides() == {"eps": 1e-10, "beta1": 0.8}


def test_lr_cooldown_linear_and_constant():
    pol = policy(lr_cooldown_factor=0.2, lr_cooldown_steps=100)
    assert pol.lr_factor_at(250) == 1.0
    pol.decide(verdict(400, "spike"), 400, RING)  # -> rollback to 300
    assert pol.lr_factor_at(299) == 1.0
    assert pol.lr_factor_at(300) == pytest.approx(0.2)
    assert pol.lr_factor_at(350) == pytest.approx(0.6)
    assert pol.lr_factor_at(399) == pytest.approx(0.992)
    assert pol.lr_factor_at(400) == 1.0
    constant = policy(lr_cooldown_factor=0.2, lr_cooldown_steps=100, lr_cooldown_shape="constant")
    constant.decide(verdict(400, "spike"), 400, RING)
    assert constant.lr_factor_at(399) == pytest.approx(0.2) and constant.lr_factor_at(400) == 1.0
    assert constant.metrics(350)["stability/lr_factor"] == pytest.approx(0.2)


def test_no_cooldown_when_the_factor_is_one():
    pol = policy(lr_cooldown_factor=1.0)
    assert pol.decide(verdict(400, "spike"), 400, RING).cooldown_steps == 0
    assert pol.lr_factor_at(310) == 1.0


def test_repeated_spikes_stop_with_what_was_tried_and_what_to_change():
    pol = RecoveryPolicy(StabilityConfig(recovery=RecoveryConfig(max_recoveries=2)),
                         knobs={"optim.lr": 3e-4, "model.z_loss": 1e-4, "model.qk_norm": False})
    # A spike at 420, a rollback to 300, the replay spikes at 415 (a lower step!), then again.
    assert pol.decide(verdict(420, "spike"), 420, RING).kind == "rollback"
    assert pol.decide(verdict(415, "spike"), 415, RING).kind == "rollback"
    stop = pol.decide(verdict(418, "spike"), 418, RING)
    assert stop.kind == "stop"
    message = stop.message
    assert "2 recoveries within 2000 steps" in message
    assert "spike at step 420 (began 420): rolled back to step 300, skipped 200 batches" in message
    assert "optim.lr=0.0003 -> 0.00015" in message and "model.qk_norm=true" in message
    assert "z_loss" not in message  # already set: not suggested
    assert "docs/stability.md" in message
    assert pol.events[-1]["event"] == "stop"


def test_spikes_far_apart_do_not_count_as_repeated():
    pol = policy(max_recoveries=1, recovery_window_steps=500)
    assert pol.decide(verdict(400, "spike"), 400, RING).kind == "rollback"
    assert pol.decide(verdict(1000, "spike"), 1000, RING + [800]).kind == "rollback"


def test_no_checkpoint_to_roll_back_to_stops():
    action = policy().decide(verdict(40, "spike"), 40, [])
    assert action.kind == "stop" and "cannot roll back" in action.message


# -- other actions ------------------------------------------------------------------------------
def test_log_only_never_acts_but_still_skips_nan_and_logs_one_event_per_spike():
    pol = policy(action="log_only")
    assert pol.decide(verdict(410, "outlier"), 410, RING).kind == "none"
    assert pol.decide(verdict(411, "spike", 410), 411, RING).kind == "none"
    assert pol.decide(verdict(412, "spike", 410), 412, RING).kind == "none"
    assert pol.decide(verdict(413, "nonfinite", 410), 413, RING).kind == "skip_update"
    assert [e["event"] for e in pol.new_events()] == ["spike", "skip_update"]


def test_disabled_only_skips_non_finite_steps_when_asked():
    pol = policy(enabled=False)
    assert pol.decide(verdict(410, "spike"), 410, RING).kind == "none"
    assert pol.decide(verdict(411, "nonfinite"), 411, RING).kind == "skip_update"
    off = RecoveryPolicy(StabilityConfig(enabled=False, skip_nonfinite_loss=False))
    assert off.decide(verdict(411, "nonfinite"), 411, RING).kind == "none"


def test_skip_action_skips_then_gives_up():
    pol = policy(action="skip", max_skips_per_episode=3)
    kinds = [pol.decide(verdict(s, "spike", 400), s, RING).kind for s in range(400, 405)]
    assert kinds == ["skip_update"] * 3 + ["stop", "stop"]
    assert "skipping alone cannot repair" in pol.events[-1]["message"]


def test_stop_action_stops_at_the_first_spike():
    action = policy(action="stop").decide(verdict(400, "spike"), 400, RING)
    assert action.kind == "stop" and "stability.action=stop" in action.message


def test_watchdog_alarm_rolls_back_like_a_spike():
    pol = policy()
    action = pol.on_watchdog_rollback(420, RING, "overflows continue", overflow_start=380)
    assert action.kind == "rollback" and action.to_step == 250 and pol.is_bad_checkpoint(400)
    assert policy(action="log_only").on_watchdog_rollback(420, RING, "x").kind == "none"


# -- state --------------------------------------------------------------------------------------
def test_a_restarted_job_remembers_recoveries_cooldown_and_bad_steps():
    pol = policy(max_recoveries=2, adam_eps=1e-12)
    pol.decide(verdict(148, "outlier"), 148, RING)
    pol.decide(verdict(420, "spike"), 420, RING)
    pol.new_events()
    restored = policy(max_recoveries=2, adam_eps=1e-12)
    restored.load_state_dict(json.loads(json.dumps(pol.state_dict())))
    assert restored.state_dict() == pol.state_dict()
    assert restored.new_events() == []  # already written by the run that made them
    assert restored.lr_factor_at(310) == pol.lr_factor_at(310) < 1
    assert restored.optimizer_overrides() == {"eps": 1e-12}
    assert restored.is_bad_checkpoint(148)
    assert restored.decide(verdict(430, "spike"), 430, RING).kind == "rollback"
    assert restored.decide(verdict(425, "spike"), 425, RING).kind == "stop"  # the count survived


def test_events_are_capped():
    from pretrain.stability import policy as policy_module

    pol = policy()
    for step in range(policy_module.MAX_EVENTS + 5):
        pol.record_event("loss_scale_reset", step, "reset")
    assert len(pol.events) == policy_module.MAX_EVENTS and pol.dropped_events == 5
    assert len(pol.new_events()) == policy_module.MAX_EVENTS


def test_a_repeated_spike_lowers_the_lr_for_good():
    pol = policy(lr_cooldown_factor=0.5, lr_cooldown_steps=100)
    pol.decide(verdict(400, "spike"), 400, RING)  # -> rollback to 300, cool-down [300, 400)
    assert pol.lr_factor_at(300) == pytest.approx(0.5) and pol.lr_factor_at(450) == 1.0  # a one-off: back to 1
    pol.decide(verdict(415, "spike"), 415, RING)  # the replay spikes again: the LR's doing
    assert pol.lr_factor_at(300) == pytest.approx(0.25) and pol.lr_factor_at(450) == pytest.approx(0.5)
    assert "LR x0.5 from then on (a repeated spike or a divergence)" in pol.events[-1]["message"]
    state = json.loads(json.dumps(pol.state_dict()))
    restored = policy(lr_cooldown_factor=0.5, lr_cooldown_steps=100)
    restored.load_state_dict(state)
    assert restored.lr_factor_at(5000) == pytest.approx(0.5)
    del state["lasting_lr_factor"]  # a checkpoint from before lasting LR cuts
    restored.load_state_dict(state)
    assert restored.lr_factor_at(5000) == 1.0
    never = policy(lr_repeat_factor=1.0)
    never.decide(verdict(400, "spike"), 400, RING)
    never.decide(verdict(415, "spike"), 415, RING)
    assert never.lr_factor_at(5000) == 1.0
    apart = policy(recovery_window_steps=500)
    apart.decide(verdict(400, "spike"), 400, RING)
    apart.decide(verdict(1000, "spike"), 1000, RING + [800])
    assert apart.lr_factor_at(5000) == 1.0


def test_the_ring_keeps_a_checkpoint_from_before_the_losss_low_point():
    ring = [100, 120, 140, 160, 180, 200]
    assert ring_checkpoints_to_delete(ring, 3, 200, 20) == [100, 120, 140]
    # A slow climb since step 112: the checkpoint before it stays, the rollback target of a divergence.
    assert ring_checkpoints_to_delete(ring, 3, 200, 20, low_point=112) == [120, 140]
    assert choose_rollback_checkpoint([100, 160, 180, 200], 112, 20, StepRanges([(112, 216)])).step == 100


def test_a_divergence_lowers_the_lr_for_good_at_once():
    pol = policy(lr_cooldown_factor=0.5, lr_cooldown_steps=100)
    climb = Verdict(step=400, kind="spike", reason="the loss is diverging", loss=3.0, grad_norm=1.0, episode_start=320,
                    divergence=True)
    assert pol.decide(climb, 400, RING).to_step == 200
    assert pol.lr_factor_at(200) == pytest.approx(0.25) and pol.lr_factor_at(5000) == pytest.approx(0.5)
