"""Telemetry: rolling percentiles, adaptive clipping, per-group norms on the real Llama, histograms."""
import json
import math

import numpy as np
import pytest
import torch

from pretrain.model.config import ModelConfig
from pretrain.model.llama import Llama
from pretrain.stability.config import ClipConfig
from pretrain.stability.telemetry import (
    AdaptiveClip, RollingPercentiles, group_grad_norms, group_metrics, log10_histogram, update_to_weight_ratios,
)


def test_rolling_percentiles_match_numpy_over_the_window():
    rng = np.random.default_rng(0)
    values = rng.lognormal(size=2500)
    rolling = RollingPercentiles(1000)
    for v in values:
        rolling.push(float(v))
    expected = np.percentile(values[-1000:], [50, 90, 99])
    assert list(rolling.percentiles().values()) == pytest.approx(list(expected))
    assert np.array_equal(rolling.values(), values[-1000:])
    assert set(rolling.metrics()) == {"stability/grad_norm_p50", "stability/grad_norm_p90", "stability/grad_norm_p99"}


def test_rolling_percentiles_ignore_non_finite_and_start_empty():
    rolling = RollingPercentiles(10)
    assert rolling.percentiles() == {} and rolling.percentile(50) is None
    rolling.push(math.nan)
    rolling.push(math.inf)
    rolling.push(2.0)
    assert len(rolling) == 1 and rolling.percentile(90) == 2.0


@pytest.mark.parametrize("pushed", [3, 10, 17, 30])
def test_rolling_percentiles_state_round_trip_before_and_after_wrapping(pushed):
    rolling = RollingPercentiles(10)
    for i in range(pushed):
        rolling.push(float(i))
    restored = RollingPercentiles(10)
    restored.load_state_dict(json.loads(json.dumps(rolling.state_dict())))
    assert np.array_equal(restored.values(), rolling.values())
    for value in (100.0, 101.0):
        rolling.push(value)
        restored.push(value)
    assert np.array_equal(restored.values(), rolling.values())


def test_adaptive_clip_uses_the_static_value_until_warmed_up_then_the_percentile():
    clip = AdaptiveClip(ClipConfig(enabled=True, warmup_steps=100, window=500, percentile=90), static_clip=1.0)
    rng = np.random.default_rng(1)
    norms = rng.lognormal(mean=-1.0, sigma=0.3, size=1000)  # median ~0.37: never above 1.0
    for i, norm in enumerate(norms):
        if i < 100:
            assert clip.threshold() == 1.0
        clip.observe(float(norm))
    assert clip.threshold() == pytest.approx(np.percentile(norms[-500:], 90))
    # p90 clips about one step in ten, by construction
    assert 0.05 < clip.clipped_share < 0.15 and not clip.too_many_clipped
    assert set(clip.metrics()) == {"opt/clip_threshold", "stability/clipped_share"}


def test_adaptive_clip_warns_when_most_steps_are_clipped():
    clip = AdaptiveClip(ClipConfig(enabled=True, warmup_steps=20, window=50), static_clip=1.0)
    for i in range(200):
        clip.observe(0.1 * 1.05 ** i)  # ever-growing norms: each one beyond the recent p90
    assert clip.clipped_share > 0.5 and clip.too_many_clipped


def test_adaptive_clip_disabled_keeps_the_static_value_and_counts_clips():
    clip = AdaptiveClip(ClipConfig(enabled=False, warmup_steps=0), static_clip=1.0)
    assert [clip.observe(n) for n in (0.5, 2.0, 0.9, 3.0)] == [False, True, False, True]
    assert clip.threshold() == 1.0 and clip.clipped_share == 0.5
    no_clip = AdaptiveClip(ClipConfig(enabled=False), static_clip=0.0)
    assert no_clip.observe(100.0) is False


def test_adaptive_clip_state_round_trip():
    cfg = ClipConfig(enabled=True, warmup_steps=5, window=20)
    clip = AdaptiveClip(cfg, static_clip=1.0)
    for i in range(33):
        clip.observe(0.5 + 0.01 * i)
    restored = AdaptiveClip(cfg, static_clip=1.0)
    restored.load_state_dict(json.loads(json.dumps(clip.state_dict())))
    assert restored.threshold() == clip.threshold() and restored.clipped_share == clip.clipped_share


def _llama_with_grads():
    torch.manual_seed(0)
    model = Llama(ModelConfig(num_layers=2, vocab_size=128))
    tokens = torch.randint(0, 128, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    return model


def test_group_grad_norms_cover_every_group_and_combine_to_the_global_norm():
    model = _llama_with_grads()
    norms = group_grad_norms((name, p.grad) for name, p in model.named_parameters())
    assert list(norms) == ["embedding", "block_0", "block_1", "final_norm", "lm_head"]
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert math.sqrt(sum(v ** 2 for v in norms.values())) == pytest.approx(float(total), rel=1e-5)
    assert norms["embedding"] == pytest.approx(float(model.model.embed_tokens.weight.grad.norm()), rel=1e-5)
    # DeepSpeed's engine prefixes names with "module."; missing gradients are skipped.
    wrapped = group_grad_norms([("module." + n, p.grad) for n, p in model.named_parameters()] + [("module.lm_head.weight", None)])
    assert wrapped == pytest.approx(norms)
    assert group_metrics(norms, "opt/grad_norm/")["opt/grad_norm/embedding"] == norms["embedding"]


def test_update_to_weight_ratios_per_group():
    model = _llama_with_grads()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.01)  # a 1% move of the embedding only
    after = {name: p.detach().clone() for name, p in model.named_parameters()}
    ratios = update_to_weight_ratios(before, after)
    assert ratios["embedding"] == pytest.approx(0.01, rel=1e-4)
    assert ratios["block_0"] == 0.0 and ratios["lm_head"] == 0.0
    zero = {"model.norm.weight": torch.zeros(4)}
    assert update_to_weight_ratios(zero, {"model.norm.weight": torch.ones(4)}) == {"final_norm": math.inf}


def test_log10_histogram_has_fixed_bins_and_keeps_out_of_range_values():
    counts, edges = log10_histogram([1e-6, 0.01, 0.1, 1.0, 10.0, 1e9, math.nan, 0.0, -1.0], bins=8)
    assert len(edges) == 9 and edges[0] == -4.0 and edges[-1] == 4.0
    assert counts.sum() == 6  # NaN, 0 and -1 left out; 1e-6 and 1e9 in the edge bins
    assert counts[0] == 1 and counts[-1] == 1
