"""The LR schedule across a change of the run's length (pretrain/plan/lr_schedule.py): the trained steps keep their
LR, the step after the resume moves it by no more than the old schedule did there, and the decay still ends at
min_lr."""
from __future__ import annotations

import pytest

from pretrain.config import OptimConfig
from pretrain.plan.lr_schedule import Length, history_from_record, lr_at, scheduled_lr, with_length


def optim(schedule: str) -> OptimConfig:
    return OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule=schedule, wsd_decay_fraction=0.2)


def lrs(cfg, history, steps) -> list[float]:
    return [scheduled_lr(step, cfg, history) for step in steps]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd", "constant"])
@pytest.mark.parametrize("resume_at", [5, 40, 85, 99])
@pytest.mark.parametrize("new_total", [150, 400, 90])
def test_a_new_length_keeps_the_past_and_never_jumps(schedule, resume_at, new_total):
    cfg = optim(schedule)
    old = history_from_record(None, 100)
    if resume_at >= new_total:
        pytest.skip("a run shortened below its trained steps is complete: nothing to schedule")
    new = with_length(old, cfg, resume_at, new_total)
    assert lrs(cfg, new, range(resume_at)) == lrs(cfg, old, range(resume_at))
    jump = abs(scheduled_lr(resume_at, cfg, new) - scheduled_lr(resume_at - 1, cfg, new))
    usual = abs(scheduled_lr(resume_at, cfg, old) - scheduled_lr(resume_at - 1, cfg, old))
    assert jump <= usual + 1e-12
    after = lrs(cfg, new, range(max(resume_at, 10), new_total))
    if schedule != "constant":
        assert all(a >= b - 1e-12 for a, b in zip(after, after[1:]))  # decaying, never climbing back
        assert scheduled_lr(new_total - 1, cfg, new) == pytest.approx(0.1)


def test_wsd_in_its_stable_phase_simply_lengthens():
    cfg = optim("wsd")
    new = with_length(history_from_record(None, 100), cfg, 40, 400)
    assert new[-1] == Length(40, 400, stretched=False)
    assert lrs(cfg, new, range(400)) == [lr_at(step, cfg, 400) for step in range(400)]


def test_cosine_stretches_what_is_ahead_and_a_second_extension_stretches_again():
    cfg = optim("cosine")
    once = with_length(history_from_record(None, 100), cfg, 40, 200)
    assert once[-1].stretched and scheduled_lr(40, cfg, once) == pytest.approx(lr_at(40, cfg, 100))
    twice = with_length(once, cfg, 120, 300)
    assert [length.from_step for length in twice] == [0, 40, 120]
    assert lrs(cfg, twice, range(120)) == lrs(cfg, once, range(120))
    assert scheduled_lr(120, cfg, twice) == pytest.approx(scheduled_lr(120, cfg, once))
    assert scheduled_lr(299, cfg, twice) == pytest.approx(0.1)


def test_a_finished_schedule_goes_on_at_its_final_lr_and_a_change_at_the_same_step_replaces_the_last():
    cfg = optim("cosine")
    done = with_length(history_from_record(None, 100), cfg, 100, 150)
    assert lrs(cfg, done, range(99, 150)) == pytest.approx([0.1] * 51)
    again = with_length(with_length(history_from_record(None, 100), cfg, 40, 200), cfg, 40, 300)
    assert [(length.from_step, length.total_steps) for length in again] == [(0, 100), (40, 300)]
