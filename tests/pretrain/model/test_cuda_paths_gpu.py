"""Issue 47's CUDA-only paths on a real GPU (skipped without one; the CPU tests with stand-ins are
test_varlen_probe.py and test_chunked_loss_cuda_paths.py): the varlen check under no_grad, the fp32-output GEMM
probe and the global generator, model.compile=off compiling nothing, and the fused loss's memory at the 1b head's
shape with its chunk terms compiled by inductor.

    python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/pretrain/model/test_cuda_paths_gpu.py   # ~1 minute
"""
from __future__ import annotations

import pytest
import torch

from pretrain.model import chunked_loss, documents
from pretrain.model.config import ModelConfig
from pretrain.model.llama import Llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
MIB = 2**20


def test_varlen_is_found_under_no_grad(monkeypatch):
    """The first question under no_grad (downstream scoring before step 0), as `cuda`, then `cuda:0`: one check,
    with its backward, answering varlen on a GPU with flash attention."""
    monkeypatch.setattr(documents, "_KERNELS", {})
    with torch.no_grad():
        kernel = documents.mask_kernel(torch.device("cuda"), torch.bfloat16, 128)
    print("document kernels:", documents.kernel_choices())
    if documents.varlen_missing(documents.same_device("cuda")) is None:
        assert kernel == "varlen" and documents.mask_kernel(torch.device("cuda:0")) == "varlen"
    assert list(documents.kernel_choices()) == [f"cuda:{torch.cuda.current_device()}"]


def test_the_gemm_probe_keeps_the_generators_and_finds_out_dtype(monkeypatch):
    monkeypatch.setattr(chunked_loss, "_GEMM_PATHS", {})
    torch.manual_seed(7)
    cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state()
    kinds = chunked_loss._fp32_out_kind(f"cuda:{torch.cuda.current_device()}")
    print("gemm paths:", chunked_loss.gemm_path_choices())
    assert torch.equal(torch.get_rng_state(), cpu) and torch.equal(torch.cuda.get_rng_state(), cuda)
    if torch.__version__ >= "2.8":
        assert kinds == {"mm": "out_dtype", "addmm": "out_dtype"}


def test_compile_off_compiles_no_loss_kernel(monkeypatch):
    monkeypatch.setattr(chunked_loss, "_compiled_terms", None)
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: pytest.fail("model.compile=off compiled"))
    model = Llama(ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                              num_kv_heads=2, max_seq_len=64, loss_chunk_tokens=32, compile="off"))
    model = model.cuda().bfloat16()
    ids = torch.randint(0, 512, (2, 64), device="cuda")
    model(ids, ids).loss.backward()


def test_the_fused_loss_holds_no_fp32_copies_at_the_1b_heads_shape():
    """vocab 50176 x hidden 2048 (the 1b preset's head), 8192 tokens in chunks of 4096, bf16, chunk terms compiled:
    forward holds the fp32 weight gradient and one chunk's fp32 logits and bf16 gradient (no fp32 softmax beside
    them), and backward adds the bf16 weight gradient (no second fp32 copy of the weight gradient)."""
    vocab, hidden, tokens, chunk = 50176, 2048, 8192, 4096
    torch.manual_seed(0)
    head = chunked_loss.LMHead(hidden, vocab).cuda().bfloat16()
    h = (torch.randn(tokens, hidden, device="cuda") * 0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    scale = torch.tensor(1.0 / tokens, device="cuda")
    head(h, labels, chunk, scale)[0].backward()  # compiled and warmed up
    head.weight.grad = h.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss = head(h, labels, chunk, scale)[0]
    torch.cuda.synchronize()
    forward = torch.cuda.max_memory_allocated() - start
    torch.cuda.reset_peak_memory_stats()
    before_backward = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    backward = torch.cuda.max_memory_allocated() - before_backward
    fp32_weight, chunk_fp32 = vocab * hidden * 4, chunk * vocab * 4
    print(f"fused loss, forward peak above start {forward / MIB:.0f} MiB, backward peak above its start "
          f"{backward / MIB:.0f} MiB (fp32 V x h {fp32_weight / MIB:.0f} MiB, fp32 c x V {chunk_fp32 / MIB:.0f} MiB)")
    assert backward < fp32_weight  # the bf16 weight gradient and the hidden one's scaling: no fp32 V x h copy
    assert forward < fp32_weight + tokens * hidden * 2 + 2 * chunk_fp32  # logits + bf16 gradient, no fp32 softmax
    eager = chunked_loss.LMHead(hidden, vocab).cuda().bfloat16()
    eager.weight.data.copy_(head.weight.data)
    h2 = h.detach().clone().requires_grad_()
    eager_loss = eager(h2, labels, chunk, scale, compiled=False)[0]
    eager_loss.backward()
    torch.testing.assert_close(loss.detach(), eager_loss.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(head.weight.grad.float(), eager.weight.grad.float(), rtol=2e-2, atol=1e-6)
