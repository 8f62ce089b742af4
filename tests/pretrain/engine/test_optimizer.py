"""LR schedules (pure functions of the step: pretrain/plan/lr_schedule.py) and AdamW parameter groups."""
import math

import pytest

from pretrain.config import OptimConfig
from pretrain.model.config import ModelConfig
from pretrain.model.llama import Llama
from pretrain.engine.optimizer import param_groups
from pretrain.plan.lr_schedule import lr_at


def cfg(**kw):
    base = dict(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine", wsd_decay_fraction=0.2)
    base.update(kw)
    return OptimConfig(**base)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_warmup_is_linear_and_reaches_peak(schedule):
    c = cfg(schedule=schedule)
    assert [lr_at(s, c, 100) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lr_at(10, c, 100) == pytest.approx(1.0)


def test_cosine_shape():
    c = cfg()
    assert lr_at(99, c, 100) == pytest.approx(0.1)
    middle = 10 + (99 - 10) / 2
    assert lr_at(int(middle), c, 100) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * (int(middle) - 10) / 89)))
    values = [lr_at(s, c, 100) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert lr_at(500, c, 100) == pytest.approx(0.1)  # past the end: stays at min_lr


def test_linear_and_constant():
    assert lr_at(99, cfg(schedule="linear"), 100) == pytest.approx(0.1)
    assert lr_at(54, cfg(schedule="linear"), 100) == pytest.approx(1.0 + (0.1 - 1.0) * 44 / 89)
    assert {lr_at(s, cfg(schedule="constant"), 100) for s in range(10, 100)} == {1.0}


def test_wsd_is_flat_then_decays_over_the_last_fraction():
    c = cfg(schedule="wsd")
    assert {lr_at(s, c, 100) for s in range(10, 79)} == {1.0}
    assert lr_at(99, c, 100) == pytest.approx(0.1)
    assert 0.1 < lr_at(90, c, 100) < 1.0


def test_no_warmup():
    assert lr_at(0, cfg(warmup_steps=0, schedule="constant"), 10) == 1.0


def test_param_groups_exclude_norms_from_decay():
    model = Llama(ModelConfig())
    groups = param_groups(model.named_parameters(), 0.1)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"])
    assert all(p.ndim == 1 for p in no_decay["params"])
    total = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for g in groups for p in g["params"]) == total
