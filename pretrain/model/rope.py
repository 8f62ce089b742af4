"""RoPE's frequencies, plain and scaled for context extension, as today's Llamas use them.

Plain RoPE turns the i-th pair of a head's dimensions by the angle position x theta^(-2i/d). A scaling
changes those frequencies (YaRN also the tables' magnitude) so that a model reaches beyond the length
L it was pretrained at (`original_max_seq_len`):

- `linear` (position interpolation): every frequency divided by `factor`.
- `dynamic` (NTK-aware, dynamic): for a sequence of T > L tokens, theta becomes
  theta x (factor x T / L - (factor - 1))^(d / (d - 2)); at or below L it is plain RoPE. The tables then
  depend on the sequence's length, and are made for each length above L.
- `llama3` (Llama 3.1, 3.2, 3.3): a frequency whose wavelength exceeds L / low_freq_factor is divided by
  `factor`, one shorter than L / high_freq_factor is kept, and those between are blended smoothly by
  where L / wavelength falls between the two factors.
- `yarn`: each frequency a blend of the interpolated (/ factor) and the original one, by a linear ramp
  over the dimensions between those that turn beta_fast and beta_slow times over L (rounded outward
  unless `truncate` is false); the cos/sin tables are multiplied by the attention factor, by default
  0.1 ln(factor) + 1 (or the ratio of that with `mscale` over `mscale_all_dim`, as DeepSeek writes it).

The parameters are named as transformers names them (`rope_scaling` in its 4.x config.json,
`rope_parameters` in 5.x), so a Llama's config.json reads in and is written back by `ayumi export hf`
unchanged (pretrain/model/hf_import.py); tests/pretrain/model/test_rope_scaling.py holds the logits to
transformers' own. The settings are `model.rope_scaling` (RopeScaling, pretrain/model/config.py).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from pretrain.model.config import RopeScaling


def original_length(scaling: RopeScaling, max_seq_len: int) -> int:
    """The length the model was pretrained at (original_max_seq_len; 0 means model.max_seq_len)."""
    return scaling.original_max_seq_len or max_seq_len


def exponents(head_dim: int, device: torch.device | None = None) -> Tensor:
    """2i/d for each pair i of a head's dimensions, fp32."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling, max_seq_len: int, seq_len: int,
                        device: torch.device | None = None) -> tuple[Tensor, float]:
    """The frequency of each dimension pair (fp32) and the factor the cos/sin tables are multiplied by, for a
    sequence of `seq_len` tokens (only `dynamic` depends on it)."""
    kind, factor, length = scaling.type, scaling.factor, original_length(scaling, max_seq_len)
    if kind == "dynamic" and seq_len > length:
        # In fp32, as transformers computes it from the batch's positions: the tables then agree to the bit.
        stretch = torch.tensor(seq_len, device=device) * factor / length - (factor - 1)
        theta = theta * stretch ** (head_dim / (head_dim - 2))
    powers = theta ** exponents(head_dim, device)  # theta^(2i/d), the wavelengths over 2 pi
    plain = 1.0 / powers
    if kind in ("none", "dynamic"):
        return plain, 1.0
    if kind == "linear":
        return plain / factor, 1.0
    if kind == "llama3":
        return llama3_frequencies(plain, scaling, length), 1.0
    return yarn_frequencies(powers, scaling, length, theta, head_dim), yarn_attention_factor(scaling)


def llama3_frequencies(plain: Tensor, scaling: RopeScaling, length: int) -> Tensor:
    """Long wavelengths interpolated, short ones kept, a smooth blend between (Llama 3.1's scheme)."""
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / plain
    # Where L / wavelength falls between the two factors: 0 = interpolate fully, 1 = keep.
    keep_share = ((length / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - keep_share) * plain / factor + keep_share * plain
    scaled = torch.where(wavelength > length / low, plain / factor, blended)
    return torch.where(wavelength < length / high, plain, scaled)


def yarn_frequencies(powers: Tensor, scaling: RopeScaling, length: int, theta: float, head_dim: int) -> Tensor:
    """YaRN's per-dimension blend of interpolation and extrapolation (`powers`: theta^(2i/d))."""

    def dimension_turning(turns: float) -> float:  # the dimension that turns `turns` times over `length` tokens
        return head_dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(scaling.beta_fast), dimension_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=powers.device) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # 1 for the fast dimensions (kept), 0 for the slow ones (interpolated)
    # 1 / (factor x theta^(2i/d)) rather than (1 / theta^(2i/d)) / factor: rounded as transformers rounds it.
    return 1.0 / (scaling.factor * powers) * (1 - extrapolated) + 1.0 / powers * extrapolated


def yarn_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor:
        return float(scaling.attention_factor)

    def magnitude(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return magnitude(scaling.factor, scaling.mscale) / magnitude(scaling.factor, scaling.mscale_all_dim)
    return magnitude(scaling.factor)
