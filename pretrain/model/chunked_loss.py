"""The LM head and its cross-entropy in chunks of tokens, never the whole `[tokens × vocab]` fp32 logits.

At vocabulary 50k, micro batch 8 and sequence 2048, the full fp32 logits are 3.3 GB per GPU, kept
for backward, and their softmax gradient another 3.3 GB: often the largest single allocation of a
1B model's step. `LMHead` computes the loss from the final hidden states instead: per chunk of
`chunk` tokens it forms the chunk's fp32 logits, takes logsumexp and the target logit, and drops
them; backward recomputes each chunk's logits and turns them into gradients for the hidden states
and the weight at once (dlogits = softmax * (g_ce + g_lse) - onehot * g_ce). Peak extra memory is
one chunk's logits (chunk × vocab × 4 bytes) instead of all tokens'. The price is one more
`hidden × vocab` matmul per chunk in backward (the recomputation).

It returns per-token cross-entropy and log-normaliser, so the caller builds the same mean loss,
z-loss and per-sample losses as the plain path (pretrain/model/llama.py), equal to it in fp32.
The module is the `lm_head` (an `nn.Linear` with the same parameter name), so ZeRO-3 gathers its
weight around forward and backward exactly as for the plain head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100


class _ChunkedCrossEntropy(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], labels [N]) -> (token_ce [N], token_lse [N]), both fp32; 0 where ignored."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int):
        ce = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.zeros_like(ce)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = F.linear(hidden[rows], weight).float()
            target = labels[rows]
            keep = target != IGNORE_INDEX
            chunk_lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            ce[rows] = torch.where(keep, chunk_lse - picked, 0.0)
            lse[rows] = torch.where(keep, chunk_lse, 0.0)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.chunk = chunk
        return ce, lse

    @staticmethod
    def backward(ctx, grad_ce: Tensor, grad_lse: Tensor):
        hidden, weight, labels, lse = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        grad_ce = grad_ce.float() if grad_ce is not None else torch.zeros_like(lse)
        grad_lse = grad_lse.float() if grad_lse is not None else torch.zeros_like(lse)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            target = labels[rows]
            keep = (target != IGNORE_INDEX).float()
            # One chunk-sized buffer: logits -> softmax -> dlogits, in place.
            dlogits = F.linear(hidden[rows], weight).float()
            dlogits.sub_(lse[rows].unsqueeze(-1)).exp_()
            dlogits.mul_(((grad_ce[rows] + grad_lse[rows]) * keep).unsqueeze(-1))
            dlogits.scatter_add_(-1, target.clamp(min=0).unsqueeze(-1), -(grad_ce[rows] * keep).unsqueeze(-1))
            if grad_hidden is not None:
                grad_hidden[rows] = (dlogits @ weight.float()).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += dlogits.t() @ hidden[rows].float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


class LMHead(nn.Linear):
    """The output projection (`lm_head.weight`, as Hugging Face names it); `loss_terms` is its chunked loss."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: Tensor, labels: Tensor | None = None, chunk: int = 0):
        """Logits [.., vocab] without labels; with labels and chunk > 0, per-token (ce, lse) in fp32, shaped as labels."""
        if labels is None or chunk <= 0:
            return super().forward(hidden)
        ce, lse = _ChunkedCrossEntropy.apply(hidden.flatten(0, -2), self.weight, labels.flatten(), chunk)
        return ce.view_as(labels), lse.view_as(labels)
