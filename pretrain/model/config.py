"""Llama model shape and options as one documented dataclass (`conf/model/*.yaml` are its presets)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """The architecture; every field is one line of documentation (litgpt style)."""

    name: str = "debug"
    """Preset name, for logs and the exported HF config."""
    vocab_size: int = 512
    """Vocabulary size (the tokenizer's, optionally padded to a multiple of 64/128)."""
    hidden_size: int = 64
    """Width of the residual stream."""
    intermediate_size: int = 176
    """Width of the SwiGLU feed-forward's hidden layer."""
    num_layers: int = 2
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention query heads; hidden_size must divide by it."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention); num_heads must divide by it. = num_heads is MHA."""
    max_seq_len: int = 128
    """Longest sequence the RoPE tables are built for."""
    rope_theta: float = 10000.0
    """RoPE base frequency θ (Llama-2: 1e4; long-context variants raise it)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_embeddings: bool = False
    """Share the input embedding matrix with the output projection (lm_head)."""
    init_std: float = 0.02
    """Std of the normal init; residual output projections use init_std / sqrt(2 * num_layers)."""
    z_loss: float = 0.0
    """Coefficient of the PaLM z-loss (log Z)^2 that keeps the softmax normaliser near 1; 0 = off (1e-4 typical)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head before RoPE (stabilises attention logits)."""
    embedding_grad_alpha: float = 1.0
    """GLM-130B embedding-gradient shrink: emb = a*emb + (1-a)*emb.detach(); 1.0 = off, 0.1 as in GLM-130B."""
    attention: str = "sdpa"
    """Attention kernel: sdpa (torch scaled_dot_product_attention; flash/efficient kernels on GPU) or eager."""
