"""Document masking for packed sequences (`model.attention=document`).

A training sample is cut from one domain's token stream, so it usually holds the end of one document
and the start of the next (documents end with the data's end-of-document token). Plain causal attention
lets the second attend to the first. With document masking a token attends only to earlier tokens of
its own document, as Megatron's reset attention mask, torchtitan's and OLMo's document masking do, and
with `model.restart_positions` each document's positions start again at 0, so a packed document is
computed exactly as if it were alone.

The documents are found from the tokens themselves: the token after an end-of-document token starts a
new one. The end token belongs to the document it ends (it is predicted from inside it).

Kernels (`mask_kernel` picks one from what the device, dtype and head size support):

* "varlen": torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`, the
  FlashAttention-2 kernel that SDPA's causal path runs), as OLMo-core and torchtitan use flash varlen with
  the documents' boundaries. The batch's documents become the kernel's sequences, each attended causally:
  exact by construction (a document is computed as a sequence of its own), the work is the sum of the
  squared document lengths, and a sample that is one long document runs the same kernel as causal
  attention. Every length runs: there is no block size to meet. Needs CUDA with flash attention (compute
  capability 8.0+), a torch that has varlen_attn, fp16/bf16, a head size that is a multiple of 8 up to 256.
* "sdpa": SDPA with a boolean [B, 1, T, T] mask everywhere else (the CPU, fp32, other GPUs or head sizes):
  exact for every dtype and shape; it computes the whole T x T.

Whether a device runs varlen is decided once per process (a small forward and backward checked against SDPA,
`varlen_works`), said once on stderr, and kept: `kernel_choices()` gives it for a run's results.

FlexAttention is not used: its compiled kernels failed on shapes real runs have (torch 2.11 on an H200:
inductor's NoValidChoicesError in create_flex_decoding_kernel for a fp32 query of 90 tokens; flex picks
its decoding kernel below 128 query tokens), and with long documents it was 10% slower than the flash
kernel, skipping almost nothing.

The varlen kernel takes the documents' count and longest length as host integers, so building its spans
waits for the device once per forward (llama.py builds them before the first block, from the whole
sequence; torchtitan takes the same wait). Inside compiled blocks the varlen call runs outside the graph
(torch.compiler.disable): its inputs' sizes change with every batch, and a graph that took them would
recompile for each new document count.
"""
from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.nn.functional as F
from torch import Tensor

VARLEN_DTYPES = (torch.float16, torch.bfloat16)
"""The dtypes flash attention computes in."""
VARLEN_MAX_HEAD_DIM = 256
"""Flash attention's largest head size (a multiple of 8)."""
UNSUPPORTED = (RuntimeError, TypeError, ValueError, NotImplementedError)
"""What varlen_attn raises where it cannot run (other arguments, no backward, no kernel for this GPU): the probe
answers "no" for good. An out-of-memory error among them says nothing about support (varlen_works)."""


def document_ids(input_ids: Tensor, end_id: int) -> Tensor:
    """[B, T] index of the document each token belongs to, counted from 0 in each row."""
    starts = torch.zeros_like(input_ids, dtype=torch.int64)
    starts[:, 1:] = (input_ids[:, :-1] == end_id).to(torch.int64)  # the token after an end starts a document
    return starts.cumsum(1)


def document_starts(documents: Tensor) -> Tensor:
    """[B, T] True at each document's first token (every row's first token starts one)."""
    first = torch.ones_like(documents, dtype=torch.bool)
    first[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return first


def positions_in_document(documents: Tensor) -> Tensor:
    """[B, T] each token's position within its own document (0 at its first token)."""
    steps = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    start_of_own = torch.where(document_starts(documents), steps, torch.zeros_like(steps)).cummax(1).values
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


class DocumentSpans:
    """The batch's documents as the varlen kernel's sequences. `bounds`: int32 [N + 1] offsets into the
    [B * T] flattened tokens (0, the first token of each later document, B * T; a row's first token always
    starts a document, so none spans two rows); `longest`: the longest document's length."""

    def __init__(self, bounds: Tensor, longest: int):
        self.bounds, self.longest = bounds, longest


def document_spans(documents: Tensor) -> DocumentSpans:
    """The spans of [B, T] document ids. Waits for the device once (nonzero's count sizes its result); the
    longest length is read right after, from a device with nothing left to run."""
    _outside_graphs()  # made here, before any compiled block calls it (it imports dynamo)
    b, t = documents.shape
    starts = document_starts(documents).flatten().nonzero().flatten()
    bounds = torch.cat([starts, starts.new_tensor([b * t])]).to(torch.int32)
    return DocumentSpans(bounds, int((bounds[1:] - bounds[:-1]).max()))


class DocumentMask:
    """What attention needs to keep each token within its document, built once per forward from the whole
    sequence (llama.py): the [B, T] document ids and, for the kernel the device runs, the dense mask
    ("sdpa") or the documents' spans ("varlen"). A layer whose dtype or head size varlen cannot take
    (mask_kernel) builds the dense mask from the ids itself."""

    def __init__(self, documents: Tensor, dense: Tensor | None = None, spans: DocumentSpans | None = None):
        self.documents, self.dense, self.spans = documents, dense, spans

    def dense_mask(self) -> Tensor:
        return self.dense if self.dense is not None else dense_mask(self.documents)


def attention_mask(documents: Tensor, kernel: str) -> DocumentMask:
    """The mask Attention takes, prepared for `kernel` (mask_kernel's answer for the device)."""
    if kernel == "varlen":
        return DocumentMask(documents, spans=document_spans(documents))
    if kernel == "sdpa":
        return DocumentMask(documents, dense=dense_mask(documents))
    raise ValueError(f"unknown document-masking kernel {kernel!r}: varlen or sdpa")


def mask_kernel(device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """The document-masking kernel for tensors of `dtype` with heads of `head_dim` on `device`: "varlen" where
    torch's flash varlen attention runs them (module docstring), else "sdpa" (a dense mask: any device, dtype
    and shape). The sequence length does not enter: varlen takes every length, 1 token included.

    llama.py asks with the device alone when it builds the mask (dtype and head size None: "if they fit",
    the model's dtype is not known there); each layer asks again with its q (document_attention)."""
    return "varlen" if varlen_device(device) and varlen_fits(dtype, head_dim) else "sdpa"


_KERNELS: dict[str, dict[str, str]] = {}
"""The kernel decided for each device so far, {"cuda:0": {"kernel": "varlen" | "sdpa", "why": ...}}: varlen_device's
cache (a plain dict, which torch.compile reads in a graph, where it would trace through an lru_cache and probe
again) and kernel_choices' answer."""


def varlen_device(device: torch.device | str) -> bool:
    """Whether `device` runs torch's flash varlen attention, decided once per device and process (_decide):
    `cuda` is the current CUDA device, the same as `cuda:0` there, not a second probe. A probe that could not tell
    (the device ran out of memory) answers False for this call only and keeps nothing: the next call asks again."""
    device = same_device(device)
    if str(device) not in _KERNELS:
        try:
            (_decide_outside_graphs() if torch.compiler.is_compiling() else _decide)(device)
        except torch.OutOfMemoryError as err:
            print(f"ayumi: document masking's varlen check on {device} was cut short (out of memory: {err}); the "
                  "dense mask this time, checked again next time", file=sys.stderr, flush=True)
            return False
    return _KERNELS[str(device)]["kernel"] == "varlen"


def same_device(device: torch.device | str) -> torch.device:
    """`device` with its index filled in (the current one, for a CUDA device named without), so that every name
    of one device is one key."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


def _decide(device: torch.device) -> None:
    """Decides `device`'s kernel (varlen_missing, then varlen_works), keeps it in _KERNELS and says it (stderr)."""
    why_not = varlen_missing(device)
    if why_not is None and not varlen_works(device):
        why_not = "varlen_attn failed its check against SDPA"
    kernel = "sdpa" if why_not else "varlen"
    _KERNELS[str(device)] = {"kernel": kernel, "why": why_not or "flash varlen attention passed its check"}
    print(f"ayumi: document masking on {device} runs {kernel}"
          + (f" (the dense mask: {why_not})" if why_not else " (flash varlen attention)"), file=sys.stderr, flush=True)


_decide_eagerly = None
"""_decide behind torch.compiler.disable, made the first time a compiled model asks (the probe's backward and its
print are no graph's)."""


def _decide_outside_graphs():
    """_decide as a compiled model must call it: outside its graph (made on first use: importing dynamo costs)."""
    global _decide_eagerly
    if _decide_eagerly is None:
        _decide_eagerly = torch.compiler.disable(_decide)
    return _decide_eagerly


def kernel_choices() -> dict[str, dict[str, str]]:
    """The document-masking kernel per device asked so far in this process, with why: {"cuda:0": {"kernel": "varlen"
    | "sdpa", "why": "..."}}; {} where document masking never ran. A layer whose dtype or head size flash cannot
    take (varlen_fits) runs sdpa on a varlen device too."""
    return {device: dict(choice) for device, choice in _KERNELS.items()}


def varlen_missing(device: torch.device) -> str | None:
    """What keeps `device` from running torch's flash varlen attention, or None: it needs CUDA (not ROCm, untried
    here) with flash attention built in, compute capability 8.0+, and a torch with torch.nn.attention.varlen."""
    if device.type != "cuda" or torch.version.hip or not torch.cuda.is_available():
        return f"no flash varlen on {'ROCm' if torch.version.hip else device.type} here"
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (2.9+)"
    if not torch.backends.cuda.is_flash_attention_available():
        return "this torch was built without flash attention"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        return f"compute capability {capability[0]}.{capability[1]}, flash attention needs 8.0+"
    return None


def varlen_works(device: torch.device) -> bool:
    """Whether varlen_attn really computes document masking here: one small grouped-head call, forward and
    backward, against SDPA with the dense mask. Checked once per device, so that a torch whose varlen_attn
    takes other arguments, or lacks a backward, leaves document masking on the dense kernel instead of
    failing the run's first step: False where it raises an UNSUPPORTED error or differs. Runs with gradients on
    whatever the caller's mode (its first call may come under torch.no_grad: an evaluation before the first
    step). Running out of memory says nothing about the kernel: that error goes through (varlen_device keeps
    no answer then)."""
    with torch.inference_mode(False), torch.enable_grad():
        generator = torch.Generator().manual_seed(0)
        documents = torch.tensor([[0] * 5 + [1] * 11 + [2] * 16]).to(device)
        q, k, v = (torch.randn(1, heads, 32, 32, generator=generator).to(device, torch.bfloat16).requires_grad_()
                   for heads in (4, 2, 2))
        try:
            out = varlen_attention(q, k, v, document_spans(documents))
            out.float().sum().backward()
        except torch.OutOfMemoryError:
            raise  # a RuntimeError too, but no answer
        except UNSUPPORTED:
            return False
        expected = masked_sdpa(q.detach(), k.detach(), v.detach(), dense_mask(documents))
        return bool(q.grad is not None and torch.isfinite(q.grad).all()
                    and torch.allclose(out.detach().float(), expected.float(), atol=3e-2))


def varlen_fits(dtype: torch.dtype | None, head_dim: int | None) -> bool:
    """Whether flash attention takes this dtype and head size (None: not asked)."""
    dtype_fits = dtype is None or dtype in VARLEN_DTYPES
    return dtype_fits and (head_dim is None or (head_dim % 8 == 0 and head_dim <= VARLEN_MAX_HEAD_DIM))


def document_attention(q: Tensor, k: Tensor, v: Tensor, mask: DocumentMask | Tensor) -> Tensor:
    """Causal attention within documents on [B, heads, T, head_dim] (K/V heads may be fewer): varlen where the
    mask has spans and q's dtype and head size fit, else SDPA with the dense mask (a plain boolean tensor is
    taken as that mask)."""
    if isinstance(mask, DocumentMask) and mask.spans is not None and varlen_fits(q.dtype, q.shape[-1]):
        return _outside_graphs()(q, k, v, mask.spans)
    dense = mask if isinstance(mask, Tensor) else mask.dense_mask()
    return masked_sdpa(q, k, v, dense)


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, dense: Tensor) -> Tensor:
    """SDPA with a boolean mask; K/V heads repeated to q's (the fused masked kernels need equal head counts)."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(n_rep, dim=1) if n_rep > 1 else x for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, spans: DocumentSpans) -> Tensor:
    """Causal attention within documents by the flash varlen kernel, [B, heads, T, head_dim] in and out: the
    tokens flattened to [B * T, heads, head_dim] (a view of the projections' layout), each document a
    sequence. Grouped K/V heads are read in place, as SDPA's causal flash path reads them."""
    b, heads, t, d = q.shape

    def tokens_major(x: Tensor) -> Tensor:
        return x.transpose(1, 2).reshape(b * t, x.shape[1], d)

    out = flash_varlen(tokens_major(q), tokens_major(k), tokens_major(v), spans.bounds, spans.longest)
    return out.view(b, t, heads, d).transpose(1, 2)


def flash_varlen(q: Tensor, k: Tensor, v: Tensor, bounds: Tensor, longest: int) -> Tensor:
    """torch's varlen_attn, causal, on [tokens, heads, head_dim] (K/V heads may be fewer)."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, bounds, bounds, longest, longest, **varlen_options(q.shape[1] != k.shape[1]))


@functools.lru_cache(maxsize=None)
def varlen_options(grouped: bool) -> dict:
    """varlen_attn's keywords for causal attention, by the installed torch's signature: its first release
    took `is_causal`, later ones `window_size=(-1, 0)`; where it has `enable_gqa` (2.12's, 2.13's), that
    must be set for fewer K/V heads. The flash kernel itself takes them (SDPA's GQA path relies on it), and
    the wrappers without the flag pass them through unchecked."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = inspect.signature(varlen_attn).parameters
    options = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    if grouped and "enable_gqa" in parameters:
        options["enable_gqa"] = True
    return options


_varlen_eager = None
"""varlen_attention behind torch.compiler.disable, made by the first spans (module docstring says why)."""


def _outside_graphs():
    """varlen_attention as compiled code must call it: outside the graph. Made on first use, not at import,
    so runs without document masking never import dynamo (as pretrain/engine/sequence_parallel.py)."""
    global _varlen_eager
    if _varlen_eager is None:
        _varlen_eager = torch.compiler.disable(varlen_attention)
    return _varlen_eager
