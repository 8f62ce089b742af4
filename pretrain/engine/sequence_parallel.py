"""Sequence parallelism's exchange: DeepSpeed Ulysses' `DistributedAttention` put into every attention layer.

pretrain/model/sequence_parallel.py says what a rank computes; this is the one place that brings DeepSpeed's
own all-to-all attention (`deepspeed.sequence.layer.DistributedAttention`) into the model, since only the
engine imports DeepSpeed. Each layer's exchange takes q, k, v of this rank's tokens for all heads, laid out
[batch, tokens, heads, head_dim], hands the layer's own attention kernel all tokens of heads/N heads, and
gives back the output for this rank's tokens and all heads. Under grouped-query attention the heads are split
in whole K/V groups, so a query head lands on the rank that holds its K/V head.
"""
from __future__ import annotations

import torch
from deepspeed.sequence.layer import DistributedAttention

from pretrain.model.sequence_parallel import SequenceSlice


def install_sequence_parallel(model: torch.nn.Module, group, rank: int, size: int) -> int:
    """Slice `model`'s training forward over the `size` ranks of `group` (this one is `rank`); returns how many
    attention layers exchange. The exchange holds no parameters: the state dict does not change."""
    model.sequence = SequenceSlice(rank, size)
    layers = 0
    for module in model.modules():
        if hasattr(module, "attend_tokens_major"):
            # scatter the heads (dim 2), gather the tokens (dim 1) of [batch, tokens, heads, head_dim]
            exchange = DistributedAttention(module.attend_tokens_major, group, scatter_idx=2, gather_idx=1)
            # Outside any compiled graph (model.compile=blocks): collectives inside an autograd.Function. Wrapped
            # here, once, rather than by a decorator in the model, which would import dynamo in every run.
            module.exchange = torch.compiler.disable(exchange.forward)
            layers += 1
    if not layers:
        raise RuntimeError("parallel.sequence found no attention layer to exchange in the model")
    return layers
