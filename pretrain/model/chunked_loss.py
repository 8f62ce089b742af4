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

import sys
import warnings

import torch
from torch import Tensor, nn

IGNORE_INDEX = -100


# -- GEMMs with an fp32 result from low-precision inputs ---------------------------------------------------------
UNSUPPORTED = (RuntimeError, TypeError, NotImplementedError)
"""What a GEMM with out_dtype raises where torch lacks it (no kernel for the device, an unknown keyword)."""
_GEMM_PATHS: dict[str, dict[str, str]] = {}
"""The answers of _fp32_out_kind so far, by device: its cache, and what gemm_path_choices returns."""


def _fp32_out_kind(device: str) -> dict[str, str]:
    """How this device multiplies bf16/fp16 matrices into fp32, for each of the two products the loss runs ("mm",
    the logits; "addmm", the weight gradient's accumulation): "out_dtype" (torch's GEMM with `out_dtype`: cuBLAS
    accumulates and writes fp32, no rounding to bf16) or "cast" (a GEMM in the input dtype, then a cast).

    torch has `mm`/`addmm` with `out_dtype` on CUDA only (2.8+); each is probed once, on its own (one failing
    leaves the other on), on a small product against an fp32 reference, so a torch without them, or one that
    computes them wrongly, falls back instead of failing. Said once per process (stderr) and kept for
    gemm_path_choices. Never asked while torch.compile traces (model.compile=full): the callers leave the product
    to inductor then."""
    if device in _GEMM_PATHS:
        return _GEMM_PATHS[device]
    if device.startswith("cuda"):
        a, b = _probe_operands(device)
        kinds = {op: "out_dtype" if works(a, b) else "cast" for op, works in _OUT_DTYPE_PROBES.items()}
    else:
        kinds = {"mm": "cast", "addmm": "cast"}
    _GEMM_PATHS[device] = kinds
    print(f"ayumi: the fused LM-head loss's fp32-output GEMMs on {device}: "
          + ", ".join(f"{op} {kind}" for op, kind in kinds.items()), file=sys.stderr, flush=True)
    return kinds


def _probe_operands(device: str) -> tuple[Tensor, Tensor]:
    """Two small bf16 matrices for the probes, drawn on the CPU from a generator of their own: drawing from the
    device's (or the CPU's) global generator would shift the run's random stream, differently after a resume."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 48, generator=generator), torch.randn(48, 16, generator=generator)
    return a.to(device, torch.bfloat16), b.to(device, torch.bfloat16)


def _mm_out_dtype_works(a: Tensor, b: Tensor) -> bool:
    """Whether torch.mm(a, b, out_dtype=fp32) runs here and gives the fp32 product."""
    try:
        return torch.allclose(torch.mm(a, b, out_dtype=torch.float32), a.float() @ b.float(), atol=1e-3)
    except torch.OutOfMemoryError:
        raise  # a full device, no answer: the loss's own GEMMs would not fit either
    except UNSUPPORTED:
        return False


def _addmm_out_dtype_works(a: Tensor, b: Tensor) -> bool:
    """Whether torch.addmm(acc, a, b, out_dtype=fp32, out=acc) adds the fp32 product to acc in place here."""
    acc = torch.ones(a.shape[0], b.shape[1], device=a.device)
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except torch.OutOfMemoryError:
        raise
    except UNSUPPORTED:
        return False
    return torch.allclose(acc, a.float() @ b.float() + 1, atol=1e-3)


_OUT_DTYPE_PROBES = {"mm": _mm_out_dtype_works, "addmm": _addmm_out_dtype_works}


def gemm_path_choices() -> dict[str, dict[str, str]]:
    """The fused loss's fp32-output GEMM path per device it ran on in low precision so far, as
    {"cuda:0": {"mm": "out_dtype" | "cast", "addmm": "out_dtype" | "cast"}} (_fp32_out_kind says what each means);
    {} before the first bf16/fp16 chunk (an fp32 model multiplies in fp32 and asks nothing). Products traced by
    torch.compile (model.compile=full) are inductor's, whatever this says."""
    return {device: dict(kinds) for device, kinds in _GEMM_PATHS.items()}


def matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b in the inputs' dtype (tensor cores for bf16), the result in fp32."""
    if a.dtype == torch.float32:
        return a @ b
    if not torch.compiler.is_compiling() and _fp32_out_kind(str(a.device))["mm"] == "out_dtype":
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def accumulate_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc (fp32) += a @ b, the product computed in the inputs' dtype."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif not torch.compiler.is_compiling() and _fp32_out_kind(str(a.device))["addmm"] == "out_dtype":
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b)


# -- one chunk's loss and logit gradient --------------------------------------------------------------------------
def chunk_loss_terms(logits: Tensor, target: Tensor, z_loss: float, grad_dtype: torch.dtype | None):
    """From a chunk's fp32 logits [c, V]: per-token CE and log Z (0 where the target is ignored), and, unless
    grad_dtype is None, the gradient of `sum(ce) + z_loss * sum(lse^2)` with respect to the logits, in grad_dtype."""
    keep = target != IGNORE_INDEX
    index = target.clamp(min=0).unsqueeze(-1)
    every_lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, index).squeeze(-1)
    ce = torch.where(keep, every_lse - picked, 0.0)
    lse = torch.where(keep, every_lse, 0.0)
    if grad_dtype is None:
        return ce, lse, None
    # d(ce)/d(logit) = softmax - onehot; d(z lse^2)/d(logit) = 2 z lse softmax. An ignored token's row is
    # softmax * 0 (its softmax from its own log Z, which stays finite where exp(logit) alone would not).
    weight = keep.float() * (1.0 + 2.0 * z_loss * lse)
    dlogits = (logits - every_lse.unsqueeze(-1)).exp_().mul_(weight.unsqueeze(-1))  # one fp32 buffer, in place
    # The one-hot's -1 is written into the cast result at the c target places, each computed in fp32 from the
    # target's logit as the softmax above computes it there (and rounded once, as every other element). Adding it
    # to the fp32 softmax first (scatter_add_) had inductor materialise that softmax: a second chunk x V buffer,
    # in fp32, beside the cast one; this way its one kernel writes the cast result alone.
    at_target = (picked - every_lse).exp_().mul_(weight).sub_(keep.float()).unsqueeze(-1)
    return ce, lse, dlogits.to(grad_dtype).scatter_(-1, index, at_target.to(grad_dtype))


_compiled_terms = None
_compile_failed = False


def loss_terms_for(device: torch.device, compiled: bool = True):
    """chunk_loss_terms, compiled on CUDA (one fused pass over a chunk's logits instead of five) and eager elsewhere.

    `compiled=False` (model.compile=off, Llama passes it) keeps them eager on CUDA too: that switch promises no
    inductor compile, and each compiling process starts its own pool of inductor workers."""
    global _compiled_terms
    if not compiled or device.type != "cuda" or _compile_failed or torch.compiler.is_compiling():
        return chunk_loss_terms  # (is_compiling: already inside a compiled model, which fuses them itself)
    if _compiled_terms is None:
        _compiled_terms = torch.compile(chunk_loss_terms, dynamic=False)
    return _guarded_compiled_terms


def _guarded_compiled_terms(*args):
    """The compiled terms; should inductor fail to build them on this GPU, the eager ones from then on, with one
    warning. Any other error is raised as it is: running out of memory (the eager terms need the memory too, and
    the run must see its OOM) or an error the eager function would meet as well."""
    global _compile_failed
    try:
        return _compiled_terms(*args)
    except Exception as err:
        if not _compile_failure(err):
            raise
        _compile_failed = True
        warnings.warn(f"the LM-head loss's compiled kernel failed to build ({type(err).__name__}: {err}); using the "
                      "eager one (same values, slower)", stacklevel=2)
        return chunk_loss_terms(*args)


def _compile_failure(err: BaseException) -> bool:
    """Whether `err` is torch.compile failing to build a kernel: one of dynamo's errors (inductor's and the
    backends' are raised as BackendCompilerFailed) or Triton's own, and no out-of-memory error anywhere in its
    chain (one met while autotuning is still the device being full)."""
    from torch._dynamo.exc import TorchDynamoException  # loaded already: the error came from a compiled function

    chain = _exception_chain(err)
    if any(isinstance(link, torch.OutOfMemoryError) for link in chain):
        return False
    return any(isinstance(link, TorchDynamoException) or type(link).__module__.partition(".")[0] == "triton"
               for link in chain)


def _exception_chain(err: BaseException) -> list[BaseException]:
    """err and the exceptions it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    link: BaseException | None = err
    while link is not None and all(link is not seen for seen in chain):
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


# -- the fused head ----------------------------------------------------------------------------------------------
class _FusedLinearCrossEntropy(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], labels [N], scale, chunk, z_loss, with_grads, compiled) -> (loss, token_ce [N],
    token_lse [N]).

    loss = scale * (sum(ce) + z_loss * sum(lse^2)), differentiable; token_ce and token_lse are fp32, 0 where
    the label is ignored, and not differentiable (for logging and the per-sample losses). `scale` is a
    0-dim fp32 tensor (1/tokens, times the sequence-parallel group size), kept on the device: no host sync.
    `compiled`: whether the chunk terms may run compiled on CUDA (loss_terms_for).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, scale: Tensor, chunk: int, z_loss: float,
                with_grads: bool, compiled: bool):
        n = hidden.shape[0]
        ce = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(ce)
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) \
            if with_grads and ctx.needs_input_grad[0] else None  # contiguous, whatever hidden's strides
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if with_grads and ctx.needs_input_grad[1] else None
        grad_dtype = hidden.dtype if grad_hidden is not None or grad_weight is not None else None
        terms = loss_terms_for(hidden.device, compiled)
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
            del dlogits  # before the next chunk's logits: one chunk's gradient alive at a time, not two
        loss = scale * (ce.sum() + z_loss * lse.square().sum()) if z_loss else scale * ce.sum()
        ctx.save_for_backward(grad_hidden, grad_weight, scale)
        ctx.weight_dtype = weight.dtype
        ctx.scaled = False
        ctx.mark_non_differentiable(ce, lse)
        return loss, ce, lse

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_ce, _grad_lse):
        if ctx.scaled:  # the gradients were scaled in place: a second pass (retain_graph) would scale them again
            raise RuntimeError("the fused LM-head loss runs backward once per forward (retain_graph is not supported)")
        ctx.scaled = True
        grad_hidden, grad_weight, scale = ctx.saved_tensors
        factor = grad_loss.float() * scale  # DeepSpeed's loss scale and 1/accumulation, times 1/tokens
        if grad_hidden is not None:  # scaled in fp32, rounded once (a bf16 factor would round the scale too)
            grad_hidden = grad_hidden.float().mul_(factor).to(grad_hidden.dtype)
        if grad_weight is not None:  # in place: `grad_weight * factor` was a second fp32 V x H at backward's start
            grad_weight = grad_weight.mul_(factor).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


class LMHead(nn.Linear):
    """The output projection (`lm_head.weight`, as Hugging Face names it); with labels, its fused loss."""

    def __init__(self, hidden_size: int, vocab_size: int):
        super().__init__(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: Tensor, labels: Tensor | None = None, chunk: int = 0, scale: Tensor | None = None,
                z_loss: float = 0.0, compiled: bool = True):
        """Logits [.., vocab] without labels (or chunk 0); with labels and chunk > 0, (loss, token_ce, token_lse):
        the loss `scale * (sum ce + z_loss * sum lse^2)` and per-token fp32 values shaped as labels. `compiled`:
        whether the loss's chunk terms may be compiled on CUDA (Llama passes False under model.compile=off)."""
        if labels is None or chunk <= 0:
            return super().forward(hidden)
        with_grads = torch.is_grad_enabled() and (hidden.requires_grad or self.weight.requires_grad)
        loss, ce, lse = _FusedLinearCrossEntropy.apply(hidden.flatten(0, -2), self.weight, labels.flatten(), scale,
                                                       chunk, float(z_loss), with_grads, compiled)
        return loss, ce.view_as(labels), lse.view_as(labels)
