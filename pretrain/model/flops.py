"""Parameter and FLOP counts computed from a ModelConfig alone (the 7B preset counts instantly).

`parameter_shapes` is the single source: it lists every parameter `Llama` creates, by its HF name,
so counts, the export's key check and the tests all agree with the model.
"""
from __future__ import annotations

import math

from pretrain.model.config import ModelConfig, validate_config


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every distinct parameter of `Llama(cfg)` (lm_head absent when tied)."""
    validate_config(cfg)
    h, head_dim = cfg.hidden_size, cfg.hidden_size // cfg.num_heads
    kv = cfg.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (cfg.num_heads * head_dim, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.num_heads * head_dim)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def count_parameters(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Distinct trainable parameters. include_embedding=False drops the input embedding table
    (Kaplan's "non-embedding" N); an untied lm_head is still counted, a tied one is the table."""
    shapes = parameter_shapes(cfg)
    if not include_embedding:
        del shapes["model.embed_tokens.weight"]
    return sum(math.prod(s) for s in shapes.values())


def matmul_parameters(cfg: ModelConfig) -> int:
    """Weights used in a matmul per token: every projection plus the lm_head (tied or not);
    the embedding lookup and the norm scales do no matmul."""
    shapes = parameter_shapes(cfg)
    matrices = sum(math.prod(s) for name, s in shapes.items() if len(s) == 2 and name != "model.embed_tokens.weight")
    return matrices + (cfg.vocab_size * cfg.hidden_size if cfg.tie_embeddings else 0)


def flops_per_token(cfg: ModelConfig, seq_len: int, span: float | None = None) -> float:
    """Training FLOPs per token, PaLM appendix B convention (the one MFU is usually quoted in):
    6 * N_matmul (forward 2N, backward 4N) + 12 * num_layers * hidden_size * span for the
    attention scores and the weighted sum of values, span being the keys a token's attention covers
    with no discount for the causal mask: seq_len, or under document masking the length of the token's
    own document (`span`: the mean over the step's tokens, pretrain/model/documents.py).
    Activation-checkpointing recompute is not counted: this is model FLOPs, not hardware FLOPs."""
    return 6.0 * matmul_parameters(cfg) + 12.0 * cfg.num_layers * cfg.hidden_size * (seq_len if span is None else span)


# Dense bf16 peak FLOP/s per GPU, for MFU (vendor datasheets; no sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "V100": 125e12}


def peak_flops(device) -> float | None:
    """Dense bf16 peak FLOP/s of the CUDA `device` (a torch.device), for MFU; None on a CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    import torch

    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(gpu_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of the GPU named `gpu_name` (as torch names it); None for an unknown one."""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in gpu_name), None)
