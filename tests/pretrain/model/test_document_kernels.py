"""Document masking's kernels (pretrain/model/documents.py): which one runs for a device, dtype and head size, and that
each computes every packed document exactly as if it were alone, for odd lengths and tiny shapes too.

The flash varlen kernel needs CUDA; here a CPU stand-in takes its place (each span attended causally by SDPA on
its own, checking the spans it is handed), so what ayumi does around the kernel is tested: the spans found from
the documents, the flattened layout, grouped K/V heads, the choice per layer's dtype, and compiled blocks calling
it outside their graphs without recompiling when the documents change. The GPU acceptance run
(bench/gpu_acceptance.py, long_context) checks the real kernel."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pretrain.model import documents
from pretrain.model.documents import (
    attention_mask, dense_mask, document_attention, document_ids, document_spans, mask_kernel,
    varlen_device,
)
from pretrain.model.llama import Llama
from tests.pretrain.model.test_document_masking import tiny as masking_tiny, token_losses

END = 1


class ReferenceVarlen:
    """Stands in for documents.flash_varlen on the CPU: checks the spans, then attends each one causally alone."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, bounds, longest):
        self.calls += 1
        lengths = bounds[1:] - bounds[:-1]
        assert bounds.dtype == torch.int32 and bounds[0] == 0 and bounds[-1] == q.shape[0]
        assert (lengths > 0).all() and longest == lengths.max().item()
        assert q.shape[1] % k.shape[1] == 0 and q.stride(-1) == 1  # grouped K/V heads as they are, head dim packed
        n_rep = q.shape[1] // k.shape[1]
        pieces = []
        for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
            one = [x[start:end].transpose(0, 1)[None] for x in (q, k, v)]  # [1, heads, length, head_dim]
            y = F.scaled_dot_product_attention(one[0], one[1].repeat_interleave(n_rep, 1),
                                               one[2].repeat_interleave(n_rep, 1), is_causal=True)
            pieces.append(y[0].transpose(0, 1))
        return torch.cat(pieces)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The CPU as a device that runs varlen (the stand-in kernel); fp32 stays a dtype varlen does not take."""
    kernel = ReferenceVarlen()
    monkeypatch.setattr(documents, "varlen_device", lambda device: True)
    monkeypatch.setattr(documents, "flash_varlen", kernel)
    return kernel


@pytest.fixture
def fp32_varlen(fake_gpu, monkeypatch):
    """fake_gpu, with fp32 taken by varlen too, so fp32 models run the varlen route (exact comparisons)."""
    monkeypatch.setattr(documents, "VARLEN_DTYPES", (torch.float32, torch.bfloat16, torch.float16))
    return fake_gpu


def packed(lengths: list[int], rows: int = 1, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """inputs, labels of `rows` samples packing documents of `lengths` (each ends with END but the last, cut off);
    every row holds the same documents, rotated by one document per row."""
    generator = torch.Generator().manual_seed(seed)
    docs = []
    for i, length in enumerate(lengths):
        doc = torch.randint(2, 256, (length,), generator=generator)
        if i < len(lengths) - 1:
            doc[-1] = END
        docs.append(doc)
    samples = [torch.cat(docs[r % len(docs):] + docs[:r % len(docs)] + [torch.zeros(1, dtype=torch.long)])
               for r in range(rows)]
    tokens = torch.stack(samples)
    return tokens[:, :-1], tokens[:, 1:]


def tiny(**changes) -> Llama:
    return masking_tiny(**{"max_seq_len": 256, **changes})


def test_the_kernel_follows_what_the_device_dtype_and_head_size_support(monkeypatch):
    cpu = torch.device("cpu")
    assert not varlen_device(cpu)
    assert mask_kernel(cpu) == mask_kernel(cpu, torch.bfloat16, 128) == "sdpa"
    monkeypatch.setattr(documents, "varlen_device", lambda device: True)  # a GPU that runs flash varlen
    cuda = torch.device("cuda")
    assert mask_kernel(cuda) == "varlen"  # the device alone: llama.py prepares spans
    for dtype, head_dim in ((torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 8), (torch.bfloat16, 256)):
        assert mask_kernel(cuda, dtype, head_dim) == "varlen", (dtype, head_dim)
    # fp32 with 32-dim heads is the shape compiled FlexAttention crashed on; flash computes no fp32 and no head size
    # off a multiple of 8 or over 256: the dense mask takes those.
    for dtype, head_dim in ((torch.float32, 32), (torch.float32, 128), (torch.bfloat16, 36), (torch.bfloat16, 512)):
        assert mask_kernel(cuda, dtype, head_dim) == "sdpa", (dtype, head_dim)
    with pytest.raises(ValueError, match="varlen or sdpa"):
        attention_mask(torch.zeros(1, 4, dtype=torch.long), "flex")


def test_spans_mark_every_document_of_the_flattened_batch():
    inputs, _ = packed([5, 1, 90, 7, 3], rows=3)  # a 1-token document, a long one, a cut-off one; 105 tokens a row
    ids = document_ids(inputs, END)
    spans = document_spans(ids)
    expected, longest, t = [], 0, ids.shape[1]
    for row in range(ids.shape[0]):  # the same spans, found token by token
        start = 0
        for p in range(1, t + 1):
            if p == t or ids[row, p] != ids[row, p - 1]:
                expected.append(row * t + start)
                longest = max(longest, p - start)
                start = p
    assert spans.bounds.tolist() == expected + [ids.numel()]
    assert spans.longest == longest == 90
    # A row of one document and a row whose last token ends one: no span crosses rows, none is empty.
    ids = document_ids(torch.tensor([[7, 7, 7, 7], [7, 7, 7, END]]), END)
    assert document_spans(ids).bounds.tolist() == [0, 4, 8] and document_spans(ids).longest == 4


@pytest.mark.parametrize("length", [1, 2, 90, 257])
def test_the_varlen_route_computes_what_the_dense_mask_computes_with_gradients(fp32_varlen, length):
    """Tiny and odd lengths, grouped K/V heads: outputs and gradients of q, k, v equal the dense mask's."""
    torch.manual_seed(length)
    ids = torch.stack([torch.randint(0, 3, (length,)).sort().values for _ in range(2)])  # 1-3 documents a row
    q = torch.randn(2, 4, length, 32, requires_grad=True)
    k, v = (torch.randn(2, 2, length, 32, requires_grad=True) for _ in range(2))
    grad = torch.randn(2, 4, length, 32)

    def run(mask):
        out = document_attention(q, k, v, mask)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    varlen = run(attention_mask(ids, "varlen"))
    dense = run(attention_mask(ids, "sdpa"))
    assert fp32_varlen.calls == 1  # the varlen mask ran the kernel, the dense one did not
    for a, b in zip(varlen, dense):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), (a - b).abs().max()


@pytest.mark.parametrize("restart", [True, False])
def test_the_varlen_route_gives_each_document_its_losses_alone(fp32_varlen, restart):
    lengths = [37, 90, 1, 12, 64, 52]  # 256 tokens: the acceptance run's 90-token document, a 1-token one, odd lengths
    model = tiny(attention="document", document_end_id=END, restart_positions=restart)
    inputs, labels = packed(lengths)
    whole = token_losses(model, inputs, labels)[0]
    assert fp32_varlen.calls == model.cfg.num_layers
    start = 0
    for length in lengths:
        alone = token_losses(model, inputs[:, start:start + length], labels[:, start:start + length])[0]
        gap = (whole[start:start + length] - alone).abs().max()
        assert gap <= (2e-6 if restart else 2e-5), (length, gap)  # RoPE's distances only, without restart
        start += length
    with pytest.MonkeyPatch.context() as patch:  # the same model on the dense mask
        patch.setattr(documents, "varlen_device", lambda device: False)
        dense = token_losses(model, inputs, labels)[0]
    assert torch.allclose(whole, dense, rtol=0, atol=2e-6)
    plain = token_losses(tiny(restart_positions=restart), inputs, labels)[0]  # causal: later documents see earlier
    assert (plain[37:] - whole[37:]).abs().max() > 1e-2


def test_each_layer_picks_by_its_dtype(fake_gpu):
    """On a varlen device the mask carries spans; fp32 attention still takes the dense mask (built from the ids),
    bf16 the varlen kernel, and both keep tokens within their documents."""
    inputs, _ = packed([5, 90, 3])
    ids = document_ids(inputs, END)
    mask = attention_mask(ids, mask_kernel(inputs.device))
    assert mask.spans is not None and mask.dense is None
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 98, 32), torch.randn(1, 2, 98, 32), torch.randn(1, 2, 98, 32)
    reference = document_attention(q, k, v, dense_mask(ids))  # a plain boolean mask still works
    fp32 = document_attention(q, k, v, mask)
    assert fake_gpu.calls == 0 and torch.allclose(fp32, reference, rtol=0, atol=1e-6)
    bf16 = document_attention(*(x.bfloat16() for x in (q, k, v)), mask)
    assert fake_gpu.calls == 1 and torch.allclose(bf16.float(), reference, rtol=0, atol=3e-2)


@pytest.mark.parametrize("kernel, recompute", [("varlen", ""), ("varlen", "attention"), ("sdpa", "")])
def test_compiled_blocks_never_recompile_for_new_documents(request, kernel, recompute):
    """Compiled blocks (static shapes) over batches whose documents differ in count and length: the varlen call
    runs outside the graph and the dense mask keeps its shape, so nothing recompiles, and the losses and
    gradients are the eager model's."""
    kernel_calls = request.getfixturevalue("fp32_varlen") if kernel == "varlen" else None
    torch._dynamo.reset()
    eager = tiny(attention="document", document_end_id=END, restart_positions=True).train()
    compiled = tiny(attention="document", document_end_id=END, restart_positions=True).train()
    if recompute:
        for model in (eager, compiled):
            model.set_activation_checkpointing(recompute)
    for block in compiled.model.layers:
        block.compile(dynamic=False, backend="aot_eager")
    batches = [packed([40, 60, 28], rows=2, seed=1), packed([127, 1], rows=2, seed=2),
               packed([9] * 13 + [11], rows=2, seed=3)]  # 128 tokens a row each time

    def step(model, batch):
        model.zero_grad()
        loss = model(*batch).loss
        loss.backward()
        return loss.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    step(compiled, batches[0])  # compiles
    with torch._dynamo.config.patch(error_on_recompile=True):
        for batch in batches:
            (loss, grad), (eager_loss, eager_grad) = step(compiled, batch), step(eager, batch)
            assert torch.allclose(loss, eager_loss, rtol=0, atol=1e-6)
            assert torch.allclose(grad, eager_grad, rtol=0, atol=1e-6)
    if kernel_calls is not None:
        assert kernel_calls.calls >= 2 * len(batches) * compiled.cfg.num_layers
