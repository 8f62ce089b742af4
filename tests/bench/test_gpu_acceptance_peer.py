"""The peer at its best (bench/gpu_acceptance.py, part `peer`): the attention it registers with transformers is causal
SDPA over the K/V heads as they are, with no mask made, and computes what transformers' own attention computes; the
model has no KV cache; under torch.compile of the whole model it is one graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.gpu_acceptance import PEER_ATTENTION, PEER_SMOKE, peer_attention, peer_config, peer_model


@pytest.fixture(scope="module")
def cfg():
    return peer_config(PEER_SMOKE)


def models(cfg, attention: str):
    model, _ = peer_model(cfg, torch.device("cpu"), compiled=False, attention=attention)
    return model


def test_the_peer_attention_equals_transformers_own(cfg):
    name = peer_attention()
    assert name == PEER_ATTENTION
    ours, theirs = models(cfg, name), models(cfg, "sdpa")
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, cfg.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert ours.config.use_cache is False


def test_the_peer_attention_gets_no_mask_and_keeps_the_kv_heads(cfg, monkeypatch):
    """SDPA is called with is_causal, no mask and K/V of num_kv_heads heads (enable_gqa): no [B, 1, T, T] mask and no
    K/V repeated to every head, which is what keeps SDPA's flash kernel available on a GPU."""
    peer_attention()
    model = models(cfg, PEER_ATTENTION)
    calls = []
    real = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.shape[1], key.shape[1], attn_mask, kwargs))
        return real(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    model(input_ids=torch.randint(0, cfg.model.vocab_size, (2, 64)))
    assert len(calls) == cfg.model.num_layers
    for heads, kv_heads, mask, kwargs in calls:
        assert (heads, kv_heads) == (cfg.model.num_heads, cfg.model.num_kv_heads)
        assert mask is None and kwargs["is_causal"] is True and kwargs["enable_gqa"] is True
