"""The building blocks of ayumi's Llama: RMSNorm, rotary embeddings, attention, SwiGLU, the block.

Module and parameter names follow Hugging Face's `LlamaForCausalLM` (q_proj, gate_proj,
input_layernorm, ...) so a state dict loads into transformers unchanged. The maths follows the
same conventions (RMSNorm in fp32, "rotate_half" RoPE) so logits match it in fp32.
"""
from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pretrain.model.config import ModelConfig, RopeScaling
from pretrain.model.documents import document_attention
from pretrain.model.rope import inverse_frequencies, original_length

# `enable_gqa` arrived in torch 2.5; older torch repeats K/V heads instead (same result).
_SDPA_HAS_GQA = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 5)


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 like HF's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        # Cast back before the scale, as HF does: bf16 outputs then agree with the exported model.
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE, fp32, shared by all layers; not saved (a pure function of the config).

    With a scaling (pretrain/model/rope.py) the frequencies are scaled, and under yarn the tables too; under
    dynamic, a sequence longer than the original length gets tables made for its length."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.scaling = scaling or RopeScaling()
        cos, sin = self._tables(torch.device("cpu"), max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, device: torch.device, positions: int, dynamic: bool = False) -> tuple[Tensor, Tensor]:
        """Tables for positions 0 .. positions - 1; `dynamic`: with the frequencies dynamic scaling gives a
        sequence of that many tokens (otherwise those of one within the original length)."""
        inv_freq, magnitude = inverse_frequencies(self.head_dim, self.theta, self.scaling, self.max_seq_len,
                                                  positions if dynamic else 0, device)
        angles = torch.outer(torch.arange(positions, device=device).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [T, head_dim], the rotate_half layout
        if magnitude == 1.0:
            return angles.cos(), angles.sin()
        return angles.cos() * magnitude, angles.sin() * magnitude

    def retune(self, theta: float, scaling: RopeScaling) -> None:
        """Another RoPE base or scaling from now on (a curriculum stage's, pretrain/stages.py)."""
        self.theta, self.scaling = theta, scaling
        self._rebuild()

    def _rebuild(self) -> None:
        self.cos, self.sin = self._tables(self.cos.device, self.max_seq_len)

    def _apply(self, fn, recurse=True):
        # `model.bfloat16()` would round the tables to bf16 (~3 significant digits, bad at large
        # positions). Rebuild them in fp32 on the new device after any move or cast instead.
        super()._apply(fn, recurse)
        self._rebuild()
        return self

    def forward(self, seq_len: int) -> tuple[Tensor, Tensor]:
        if seq_len > self.max_seq_len:
            raise ValueError(f"sequence length {seq_len} > model.max_seq_len {self.max_seq_len}; raise max_seq_len")
        if self.scaling.type == "dynamic" and seq_len > original_length(self.scaling, self.max_seq_len):
            return self._tables(self.cos.device, seq_len, dynamic=True)  # theta grows with the length
        return self.cos[:seq_len], self.sin[:seq_len]


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, head_dim] by position; computed in fp32, returned in x's dtype."""
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, kv_heads, T, D] -> [B, kv_heads * n_rep, T, D]; query head h reads kv head h // n_rep."""
    if n_rep == 1:
        return x
    b, kv, t, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE and optional QK-norm; no biases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.kernel = cfg.attention
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.exchange = None  # sequence parallelism's all-to-all (pretrain/engine/sequence_parallel.py), in training

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask=None) -> Tensor:
        """`mask`: None (causal), or document masking's (pretrain/model/documents.py: its DocumentMask, or a
        boolean [B, 1, T, T] tensor). Under sequence parallelism x, cos and sin hold this rank's tokens and the
        mask the whole sequence's."""
        b, t, _ = x.shape
        # Head counts come from the projections' widths, not the config: a tensor-parallel rank's
        # projections hold a whole-head slice of them (pretrain/model/tensor_parallel.py), and the same code runs.
        q = self.q_proj(x).view(b, t, -1, self.head_dim)
        k = self.k_proj(x).view(b, t, -1, self.head_dim)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, heads, T, head_dim]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.exchange is not None and self.training:
            # [B, T/N, heads, head_dim] out: this rank's tokens, every head (the kernel ran on all tokens).
            y = self.exchange(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None, mask)
            return self.o_proj(y.reshape(b, t, -1))
        y = self.attend(q, k, v, mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask=None) -> Tensor:
        """The attention kernel on [B, heads, T, head_dim] (K/V heads may be fewer): causal, or within documents."""
        if mask is not None:
            return self._masked(q, k, v, mask)
        return self._eager(q, k, v) if self.kernel == "eager" else self._sdpa(q, k, v)

    def attend_tokens_major(self, q: Tensor, k: Tensor, v: Tensor, mask=None) -> Tensor:
        """`attend` on [B, T, heads, head_dim] in and out: the layout of sequence parallelism's exchange."""
        return self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n_rep = q.shape[1] // k.shape[1]  # query heads per K/V head (the same on a tensor-parallel slice)
        if n_rep > 1 and _SDPA_HAS_GQA and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            # The flash kernel reads grouped K/V heads in place: no repeated copy.
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # The other fused kernels (memory-efficient, CPU flash) need equal head counts.
        return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)

    def _masked(self, q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
        """Causal attention within documents, by the kernel documents.mask_kernel picks for q's dtype and head
        size: flash varlen on CUDA in bf16/fp16, SDPA with the dense mask otherwise."""
        return document_attention(q, k, v, mask)

    def _eager(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Reference path: explicit scores, causal mask, fp32 softmax."""
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        t = q.shape[-2]
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, recompute: str = "", mask=None) -> Tensor:
        """`recompute` "attention" or "mlp": that half keeps no activations and is recomputed in backward.
        `mask`: document masking's (Attention.forward), else None."""
        def attention(y: Tensor) -> Tensor:
            return self.self_attn(self.input_layernorm(y), cos, sin, mask)

        def mlp(y: Tensor) -> Tensor:
            return self.mlp(self.post_attention_layernorm(y))

        x = x + (checkpoint(attention, x, use_reentrant=False) if recompute == "attention" else attention(x))
        return x + (checkpoint(mlp, x, use_reentrant=False) if recompute == "mlp" else mlp(x))
