"""Document masking for packed sequences (`model.attention=document`).

A training sample is cut from one domain's token stream, so it usually holds the end of one document
and the start of the next (documents end with the data's end-of-document token). Plain causal attention
lets the second attend to the first. With document masking a token attends only to earlier tokens of
its own document, as Megatron's reset attention mask, torchtitan's and OLMo's document masking do, and
with `model.restart_positions` each document's positions start again at 0, so a packed document is
computed exactly as if it were alone.

The documents are found from the tokens themselves: the token after an end-of-document token starts a
new one. The end token belongs to the document it ends (it is predicted from inside it).

Kernels, the fastest exact one the platform has: on CUDA, FlexAttention with a block mask (blocks of
the mask that are all masked are skipped, so the work follows the documents' lengths); elsewhere, SDPA
with a boolean [B, 1, T, T] mask.
"""
from __future__ import annotations

import torch
from torch import Tensor


def document_ids(input_ids: Tensor, end_id: int) -> Tensor:
    """[B, T] index of the document each token belongs to, counted from 0 in each row."""
    starts = torch.zeros_like(input_ids, dtype=torch.int64)
    starts[:, 1:] = (input_ids[:, :-1] == end_id).to(torch.int64)  # the token after an end starts a document
    return starts.cumsum(1)


def positions_in_document(documents: Tensor) -> Tensor:
    """[B, T] each token's position within its own document (0 at its first token)."""
    steps = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    start_of_own = torch.where(first, steps, torch.zeros_like(steps)).cummax(1).values
    return steps - start_of_own


def span_sum(input_ids: Tensor, end_id: int) -> Tensor:
    """Sum over the tokens of the length of each one's document (sum of squared document lengths per row), as a
    float64 scalar on the tokens' device, with no host sync: the attention work under document masking, in
    the units of flops_per_token's span (pretrain/model/flops.py)."""
    documents = document_ids(input_ids, end_id)
    rows, length = documents.shape
    flat = (documents + torch.arange(rows, device=documents.device)[:, None] * length).flatten()
    counts = torch.zeros(rows * length, dtype=torch.float64, device=documents.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
    return (counts * counts).sum()


def dense_mask(documents: Tensor) -> Tensor:
    """[B, 1, T, T] True where query t may attend key s: s <= t and the same document (for SDPA)."""
    t = documents.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    return ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]


def block_mask(documents: Tensor):
    """FlexAttention's BlockMask for causal attention within documents."""
    from torch.nn.attention.flex_attention import create_block_mask

    def within_document(batch, head, query, key):
        return (query >= key) & (documents[batch, query] == documents[batch, key])

    b, t = documents.shape
    return create_block_mask(within_document, b, None, t, t, device=documents.device)


def attention_mask(documents: Tensor, kernel: str):
    """The mask Attention takes: "flex" (a BlockMask) or "sdpa" (a boolean tensor)."""
    return block_mask(documents) if kernel == "flex" else dense_mask(documents)


def mask_kernel(device: torch.device) -> str:
    """FlexAttention on CUDA (compiled there); SDPA with a dense mask on other devices."""
    return "flex" if device.type == "cuda" else "sdpa"


_compiled_flex = None


def flex_attention(q: Tensor, k: Tensor, v: Tensor, mask) -> Tensor:
    """FlexAttention over grouped K/V heads; compiled on CUDA (its fast kernel), eager elsewhere (tests)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention as flex

    if q.is_cuda:
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=True)
    return flex(q, k, v, block_mask=mask, enable_gqa=True)
