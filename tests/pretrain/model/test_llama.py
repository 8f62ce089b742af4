"""Behaviour of ayumi's Llama: shapes, masking, attention paths, init, losses, stability options."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from pretrain.model.config import ModelConfig, ModelConfigError
from pretrain.model.llama import Llama, LlamaOutput, layer_groups, no_weight_decay

B, T = 2, 16


def build(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    return Llama(dataclasses.replace(ModelConfig(), **overrides))


def batch(cfg: ModelConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return ids, torch.randint(0, cfg.vocab_size, (B, T), generator=g)


def grads(model: Llama) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_shapes_and_output_fields():
    model = build()
    ids, labels = batch(model.cfg)
    out = model(ids)
    assert isinstance(out, LlamaOutput) and out.loss is None
    assert out.logits.shape == (B, T, model.cfg.vocab_size)
    out = model(ids, labels)
    assert out.loss.ndim == 0 and out.loss.requires_grad and out.logits is None
    assert not out.ce_loss.requires_grad and not out.sample_loss.requires_grad
    assert out.sample_loss.shape == (B,) and out.sample_tokens.tolist() == [T, T]
    assert model(ids, labels, return_logits=True).logits.shape == (B, T, model.cfg.vocab_size)
    # At init the prediction is near uniform: loss ~ log(vocab).
    assert abs(out.ce_loss.item() - math.log(model.cfg.vocab_size)) < 0.1


def test_loss_matches_reference_cross_entropy_and_ignores_minus_100():
    model = build()
    ids, labels = batch(model.cfg)
    labels[0, :5] = -100
    labels[1, 3] = -100
    out = model(ids, labels, return_logits=True)
    flat = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(out.loss, flat)
    per = torch.nn.functional.cross_entropy(out.logits.float().transpose(1, 2), labels, reduction="none",
                                          ignore_index=-100)
    torch.testing.assert_close(out.sample_loss, per.sum(1) / (labels != -100).sum(1))
    assert out.sample_tokens.tolist() == [T - 5, T - 1]
    all_ignored = model(ids, torch.full_like(labels, -100))
    assert all_ignored.loss.item() == 0.0 and torch.isfinite(all_ignored.loss)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_causal_future_tokens_never_change_past_logits(attention):
    model = build(attention=attention).eval()
    ids, _ = batch(model.cfg)
    changed = ids.clone()
    changed[:, 10:] = (changed[:, 10:] + 7) % model.cfg.vocab_size
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_eager_and_sdpa_agree(qk_norm):
    sdpa = build(qk_norm=qk_norm).eval()
    eager = build(qk_norm=qk_norm, attention="eager").eval()
    eager.load_state_dict(sdpa.state_dict())
    ids, _ = batch(sdpa.cfg)
    with torch.no_grad():
        torch.testing.assert_close(sdpa(ids).logits, eager(ids).logits, rtol=0, atol=1e-5)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa = build(num_heads=4, num_kv_heads=2).eval()
    mha = build(num_heads=4, num_kv_heads=4).eval()
    head_dim, n_rep = gqa.cfg.hidden_size // 4, 2
    state = gqa.state_dict()
    for name in list(state):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            # kv head j serves query heads j*n_rep .. j*n_rep + n_rep - 1.
            w = state[name].view(2, head_dim, -1)
            state[name] = w.repeat_interleave(n_rep, dim=0).reshape(4 * head_dim, -1)
    mha.load_state_dict(state)
    ids, _ = batch(gqa.cfg)
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids).logits, mha(ids).logits, rtol=0, atol=1e-5)


def test_repeat_kv_follows_sdpa_enable_gqa_head_mapping():
    # The GPU path uses enable_gqa=True, the CPU path repeat_kv: they must group heads the same way.
    from pretrain.model.layers import repeat_kv

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 16, 8, generator=g)
    k, v = torch.randn(2, 2, 16, 8, generator=g), torch.randn(2, 2, 16, 8, generator=g)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.testing.assert_close(sdpa(q, k, v, is_causal=True, enable_gqa=True),
                               sdpa(q, repeat_kv(k, 4), repeat_kv(v, 4), is_causal=True))


def test_parameter_names_are_hugging_face_llama_names():
    names = set(build(qk_norm=True).state_dict())
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
            "model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"} <= names
    assert not any("rotary" in n for n in names)  # RoPE tables are non-persistent


def test_tied_embeddings_share_one_tensor():
    model = build(tie_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())
    ids, labels = batch(model.cfg)
    model(ids, labels).loss.backward()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_init_is_llama_style_and_deterministic():
    cfg = dict(hidden_size=256, intermediate_size=704, num_layers=8, num_heads=8, num_kv_heads=8, init_std=0.02)
    model = build(**cfg)
    params = dict(model.named_parameters())
    residual = 0.02 / math.sqrt(2 * 8)
    for name, p in params.items():
        if p.ndim == 1:
            assert torch.all(p == 1), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert p.std().item() == pytest.approx(residual, rel=0.05), name
        else:
            assert p.std().item() == pytest.approx(0.02, rel=0.05), name
            assert abs(p.mean().item()) < 1e-3
    again = build(**cfg)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_z_loss_adds_the_formula():
    plain, with_z = build(), build(z_loss=1e-2)
    ids, labels = batch(plain.cfg)
    a = plain(ids, labels, return_logits=True)
    b = with_z(ids, labels)
    lse = torch.logsumexp(a.logits.float(), dim=-1)
    torch.testing.assert_close(b.ce_loss, a.ce_loss)
    torch.testing.assert_close(b.loss, a.loss + 1e-2 * lse.square().mean())
    assert b.loss > a.loss


def test_fused_loss_equals_the_plain_formula_with_ignored_tokens_and_z_loss():
    """Loss, per-sample losses and every gradient equal log Z - target logit written out by hand (fp32)."""
    from pretrain.model.llama import IGNORE_INDEX

    model = build(z_loss=1e-3)
    ids, labels = batch(model.cfg)
    labels[0, :5] = IGNORE_INDEX  # a padded stretch
    labels[1, -1] = IGNORE_INDEX
    out = model(ids, labels, return_logits=True)
    out.loss.backward()
    fused = grads(model)
    model.zero_grad()
    logits = model(ids, labels, return_logits=True).logits
    mask = labels != IGNORE_INDEX
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    token_ce = (lse - target) * mask
    plain = token_ce.sum() / mask.sum() + 1e-3 * (lse.square() * mask).sum() / mask.sum()
    plain.backward()
    torch.testing.assert_close(out.loss, plain, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.sample_loss, token_ce.sum(1).detach() / mask.sum(1), rtol=1e-6, atol=0)
    for name, grad in grads(model).items():
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_embedding_grad_alpha_keeps_forward_and_scales_embedding_gradient():
    ref, shrunk = build(), build(embedding_grad_alpha=0.1)
    ids, labels = batch(ref.cfg)
    a, b = ref(ids, labels), shrunk(ids, labels)
    assert torch.equal(a.loss, b.loss)  # bit-identical forward
    a.loss.backward()
    b.loss.backward()
    g_ref, g_shrunk = grads(ref), grads(shrunk)
    emb = "model.embed_tokens.weight"
    torch.testing.assert_close(g_shrunk[emb], 0.1 * g_ref[emb])
    for name in g_ref.keys() - {emb}:
        torch.testing.assert_close(g_shrunk[name], g_ref[name], msg=name)


def test_qk_norm_runs_trains_and_changes_outputs():
    plain, normed = build(), build(qk_norm=True)
    normed.load_state_dict(plain.state_dict(), strict=False)  # same weights, plus q/k norms
    ids, labels = batch(plain.cfg)
    out = normed(ids, labels, return_logits=True)
    out.loss.backward()
    assert normed.model.layers[0].self_attn.q_norm.weight.grad.abs().sum() > 0
    assert not torch.allclose(out.logits, plain(ids).logits)


def test_activation_checkpointing_gives_identical_loss_and_grads():
    ref, ckpt = build(), build()
    ckpt.set_activation_checkpointing(True)
    ids, labels = batch(ref.cfg)
    a, b = ref(ids, labels), ckpt(ids, labels)
    assert torch.equal(a.loss, b.loss)
    a.loss.backward()
    b.loss.backward()
    g_ref, g_ckpt = grads(ref), grads(ckpt)
    for name in g_ref:
        torch.testing.assert_close(g_ckpt[name], g_ref[name], rtol=0, atol=0, msg=name)


def test_rope_tables_stay_fp32_after_a_bf16_cast():
    model = build(max_seq_len=4096).to(torch.bfloat16)
    rope = model.model.rotary_emb
    assert rope.cos.dtype == torch.float32
    fresh = build(max_seq_len=4096).model.rotary_emb
    assert torch.equal(rope.cos, fresh.cos) and torch.equal(rope.sin, fresh.sin)
    ids, labels = batch(model.cfg)
    assert model(ids, labels).loss.dtype == torch.float32  # the loss is computed in fp32


def test_sequence_longer_than_rope_tables_is_refused():
    model = build(max_seq_len=8)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize("overrides,field", [
    (dict(hidden_size=60), "hidden_size"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(attention="flash"), "attention"),
    (dict(embedding_grad_alpha=0.0), "embedding_grad_alpha"),
    (dict(rope_theta=0.0), "rope_theta"),
])
def test_inconsistent_configs_are_refused(overrides, field):
    with pytest.raises(ModelConfigError, match=field):
        build(**overrides)


def test_no_weight_decay_is_for_norms_and_biases():
    model = build(qk_norm=True)
    decay = {n for n, p in model.named_parameters() if not no_weight_decay(n, p)}
    assert all(n.endswith("_proj.weight") or n in ("model.embed_tokens.weight", "lm_head.weight") for n in decay)
    assert "model.embed_tokens.weight" in decay
    assert no_weight_decay("model.norm.weight", model.model.norm.weight)
    assert no_weight_decay("model.layers.0.self_attn.k_norm.weight", model.model.layers[0].self_attn.k_norm.weight)
    assert no_weight_decay("x.bias", torch.zeros(3, 3))


def test_layer_groups_cover_every_parameter():
    model = build()
    groups = {layer_groups(n) for n, _ in model.named_parameters()}
    assert groups == {"embedding", "block_0", "block_1", "final_norm", "lm_head"}
    assert layer_groups("model.layers.1.mlp.up_proj.weight") == "block_1"
    assert layer_groups("module.model.embed_tokens.weight") == "embedding"  # DeepSpeed engine prefix
    assert layer_groups("_orig_mod.model.layers.12._checkpoint_wrapped_module.mlp.up_proj.weight") == "block_12"
    with pytest.raises(ValueError, match="no telemetry group"):
        layer_groups("model.rotary_emb.cos")
