"""The LM head fused with its cross-entropy: chunks of tokens, gradients made in the forward pass, GEMMs in
the training dtype with fp32 accumulation, and never the whole `[tokens × vocab]` logits.

At vocabulary 50k, micro batch 8 and sequence 2048, the full fp32 logits are 3.3 GB per GPU, kept for
backward, and their softmax gradient another 3.3 GB: often the largest single allocation of a 1B model's
step. `LMHead` computes the loss from the final hidden states instead, `chunk` tokens at a time:

- the chunk's logits, `hidden @ weight.T`, in the training dtype on tensor cores, with an fp32 result;
- their logsumexp and target logit (the per-token cross-entropy and log-normaliser, in fp32);
- right away, the gradient of the loss with respect to those logits, `softmax * (1 + 2 z lse) - onehot`
  (z = the z-loss coefficient), cast to the training dtype, and from it the chunk's gradient of the hidden
  states (`dlogits @ weight`) and its share of the weight's gradient (`dlogits.T @ hidden`, summed over the
  chunks in fp32).

The loss is the graph's last operation, so its gradient is known up to one scalar (the factor backward
receives: DeepSpeed's loss scale and 1/accumulation, times 1/tokens): backward only multiplies the
gradients already made. Nothing is recomputed, so a step does three `hidden × vocab` GEMMs, as the plain
path does, not four (the former chunked loss recomputed each chunk's logits in backward), and each runs in
bf16 under bf16 training (the former did the two backward ones in fp32 on CUDA cores: 37% of a 1B step's
GPU time on an H200). Peak extra memory is one chunk's logits and their gradient (chunk × vocab × 6 bytes
in bf16) and the weight's fp32 gradient (vocab × hidden × 4), instead of all tokens' logits.

The same design as Liger-Kernel's fused linear cross-entropy (gradients in forward, fp32 accumulation, which
OLMo-core adopted after bf16 accumulation diverged), written here with torch operations only so that it runs
on any device; in fp32 it equals the plain path to rounding. The module is the `lm_head` (an `nn.Linear` with
the same parameter name), so ZeRO-3 gathers its weight around forward exactly as for the plain head.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100


# -- GEMMs with an fp32 result from low-precision inputs ---------------------------------------------------------
@functools.cache
def _fp32_out_kind(device: str) -> str:
    """How this device multiplies bf16/fp16 matrices into fp32: "dtype" (torch's out_dtype GEMMs: cuBLAS
    accumulates and writes fp32, no rounding to bf16) or "cast" (a GEMM in the input dtype, then a cast).

    torch has `mm`/`addmm` with `out_dtype` on CUDA only (2.8+); probed once on a small product against an
    fp32 reference, so a torch without them, or one that computes them wrongly, falls back instead of failing.
    Never asked while torch.compile traces (model.compile=full): the callers leave the product to inductor then.
    """
    if not device.startswith("cuda"):
        return "cast"
    try:
        a = torch.randn(32, 48, device=device).to(torch.bfloat16)
        b = torch.randn(48, 16, device=device).to(torch.bfloat16)
        expected = a.float() @ b.float()
        acc = torch.ones(32, 16, device=device)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)  # acc += a @ b, in place, fp32
        product = torch.mm(a, b, out_dtype=torch.float32)
        if torch.allclose(product, expected, atol=1e-3) and torch.allclose(acc, expected + 1, atol=1e-3):
            return "dtype"
    except (RuntimeError, TypeError, NotImplementedError):
        pass
    return "cast"


def matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b in the inputs' dtype (tensor cores for bf16), the result in fp32."""
    if a.dtype == torch.float32:
        return a @ b
    if not torch.compiler.is_compiling() and _fp32_out_kind(str(a.device)) == "dtype":
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def accumulate_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc (fp32) += a @ b, the product computed in the inputs' dtype."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif not torch.compiler.is_compiling() and _fp32_out_kind(str(a.device)) == "dtype":
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b)


# -- one chunk's loss and logit gradient --------------------------------------------------------------------------
def chunk_loss_terms(logits: Tensor, target: Tensor, z_loss: float, grad_dtype: torch.dtype | None):
    """From a chunk's fp32 logits [c, V]: per-token CE and log Z (0 where the target is ignored), and, unless
    grad_dtype is None, the gradient of `sum(ce) + z_loss * sum(lse^2)` with respect to the logits, in grad_dtype."""
    keep = target != IGNORE_INDEX
    every_lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ce = torch.where(keep, every_lse - picked, 0.0)
    lse = torch.where(keep, every_lse, 0.0)
    if grad_dtype is None:
        return ce, lse, None
    # d(ce)/d(logit) = softmax - onehot; d(z lse^2)/d(logit) = 2 z lse softmax. An ignored token's row is
    # softmax * 0 (its softmax from its own log Z, which stays finite where exp(logit) alone would not).
    weight = keep.float() * (1.0 + 2.0 * z_loss * lse)
    dlogits = (logits - every_lse.unsqueeze(-1)).exp_().mul_(weight.unsqueeze(-1))  # one fp32 buffer, in place
    dlogits.scatter_add_(-1, target.clamp(min=0).unsqueeze(-1), -keep.float().unsqueeze(-1))
    return ce, lse, dlogits.to(grad_dtype)


_compiled_terms = None
_compile_failed = False


def loss_terms_for(device: torch.device):
    """chunk_loss_terms, compiled on CUDA (one fused pass over a chunk's logits instead of five) and eager elsewhere."""
    global _compiled_terms
    if device.type != "cuda" or _compile_failed or torch.compiler.is_compiling():  # already inside a compiled model
        return chunk_loss_terms
    if _compiled_terms is None:
        _compiled_terms = torch.compile(chunk_loss_terms, dynamic=False)
    return _guarded_compiled_terms


def _guarded_compiled_terms(*args):
    """The compiled terms; should inductor fail to build them on this GPU, the eager ones, with one warning."""
    global _compile_failed
    try:
        return _compiled_terms(*args)
    except Exception as err:  # noqa: BLE001  (any compile failure: the eager function computes the same)
        _compile_failed = True
        warnings.warn(f"the LM-head loss's compiled kernel failed to build ({type(err).__name__}: {err}); using the "
                      "eager one (same values, slower)", stacklevel=2)
        return chunk_loss_terms(*args)


# -- the fused head ----------------------------------------------------------------------------------------------
class _FusedLinearCrossEntropy(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], labels [N], scale) -> (loss, token_ce [N], token_lse [N]).

    loss = scale * (sum(ce) + z_loss * sum(lse^2)), differentiable; token_ce and token_lse are fp32, 0 where
    the label is ignored, and not differentiable (for logging and the per-sample losses). `scale` is a
    0-dim fp32 tensor (1/tokens, times the sequence-parallel group size), kept on the device: no host sync.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, scale: Tensor, chunk: int, z_loss: float,
                with_grads: bool):
        n = hidden.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(ce)
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) \
            if with_grads and ctx.needs_input_grad[0] else None  # contiguous, whatever hidden's strides
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if with_grads and ctx.needs_input_grad[1] else None
        grad_dtype = hidden.dtype if grad_hidden is not None or grad_weight is not None else None
        terms = loss_terms_for(hidden.device)
        weight_t = weight.t()
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            logits = matmul_fp32(hidden[rows], weight_t)
            ce[rows], lse[rows], dlogits = terms(logits, labels[rows], z_loss, grad_dtype)
            del logits
            if grad_hidden is not None:
                torch.mm(dlogits, weight, out=grad_hidden[rows])  # a row slice is contiguous: written in place
            if grad_weight is not None:
                accumulate_matmul(grad_weight, dlogits.t(), hidden[rows])
        loss = scale * (ce.sum() + z_loss * lse.square().sum()) if z_loss else scale * ce.sum()
        ctx.save_for_backward(grad_hidden, grad_weight, scale)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(ce, lse)
        return loss, ce, lse

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce, _grad_lse):
        grad_hidden, grad_weight, scale = ctx.saved_tensors
        factor = grad_loss.float() * scale  # DeepSpeed's loss scale and 1/accumulation, times 1/tokens
        if grad_hidden is not None:  # scaled in fp32, rounded once (a bf16 factor would round the scale too)
            grad_hidden = grad_hidden.float().mul_(factor).to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * factor).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


class LMHead(nn.Linear):
    """The output projection (`lm_head.weight`, as Hugging Face names it); with labels, its fused loss."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: Tensor, labels: Tensor | None = None, chunk: int = 0, scale: Tensor | None = None,
                z_loss: float = 0.0):
        """Logits [.., vocab] without labels (or chunk 0); with labels and chunk > 0, (loss, token_ce, token_lse):
        the loss `scale * (sum ce + z_loss * sum lse^2)` and per-token fp32 values shaped as labels."""
        if labels is None or chunk <= 0:
            return super().forward(hidden)
        with_grads = torch.is_grad_enabled() and (hidden.requires_grad or self.weight.requires_grad)
        loss, ce, lse = _FusedLinearCrossEntropy.apply(hidden.flatten(0, -2), self.weight, labels.flatten(), scale,
                                                       chunk, float(z_loss), with_grads)
        return loss, ce.view_as(labels), lse.view_as(labels)
