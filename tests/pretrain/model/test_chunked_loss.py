"""model.loss_chunk_tokens: the LM head fused with its cross-entropy, in chunks, gradients made in forward (the
default). Equal to the plain path in fp32 (loss, z-loss, per-sample losses, every gradient); every GEMM in bf16
under bf16 training, three per chunk and none in backward (nothing recomputed); bf16 gradients as close to
fp32's as the plain bf16 path's; lower peak memory at vocabulary 50k (a process's peak RSS); the same losses
under ZeRO-3 on 2 ranks."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pretrain.model.chunked_loss import LMHead
from pretrain.model.config import ModelConfig
from pretrain.model.llama import IGNORE_INDEX, Llama
from tests.helpers import REPO, cpu_env, run_training, tiny_overrides, train_losses, write_tiny_corpus


def loss_and_grads(chunk: int, tie: bool, z_loss: float) -> tuple[dict, dict]:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      max_seq_len=32, tie_embeddings=tie, z_loss=z_loss, loss_chunk_tokens=chunk)
    model = Llama(cfg)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (3, 17), generator=generator)
    labels = torch.randint(0, 300, (3, 17), generator=generator)
    labels[0, :5] = IGNORE_INDEX
    labels[2, :] = IGNORE_INDEX  # a sample with nothing to learn
    out = model(ids, labels)
    out.loss.backward()
    values = {"loss": out.loss.detach(), "ce": out.ce_loss, "sample_loss": out.sample_loss,
              "sample_tokens": out.sample_tokens}
    return values, {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("tie, z_loss", [(False, 0.0), (True, 1e-3), (False, 1e-2)])
def test_chunks_equal_the_plain_loss_and_gradients(tie, z_loss):
    plain, plain_grads = loss_and_grads(0, tie, z_loss)
    for chunk in (1, 7, 64):  # one token, a chunk that does not divide 51 tokens, one chunk for everything
        chunked, grads = loss_and_grads(chunk, tie, z_loss)
        for key in plain:
            torch.testing.assert_close(chunked[key], plain[key])
        assert abs(float(chunked["loss"] - plain["loss"])) <= 1e-6 * abs(float(plain["loss"]))
        assert grads.keys() == plain_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-5, atol=1e-7)
    assert plain["sample_tokens"].tolist() == [12, 17, 0] and plain["sample_loss"][2] == 0


class MatmulRecorder(TorchDispatchMode):
    """Every matrix product torch runs while active: its name and its tensor arguments' dtypes."""

    def __init__(self):
        super().__init__()
        self.products: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation"):
            self.products.append((name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def head_inputs(dtype: torch.dtype, tokens: int = 37, hidden: int = 48, vocab: int = 1000):
    torch.manual_seed(0)
    head = LMHead(hidden, vocab)
    head.weight.data.normal_(0, 0.5)
    head = head.to(dtype)
    h = torch.randn(tokens, hidden).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,))
    labels[:5] = IGNORE_INDEX
    return head, h, labels, 1.0 / (labels != IGNORE_INDEX).sum().float()


def test_every_gemm_runs_in_bf16_and_nothing_is_recomputed():
    """37 tokens in chunks of 16: 3 chunks x (logits, hidden gradient, weight gradient), all bf16, none in backward."""
    head, h, labels, scale = head_inputs(torch.bfloat16)
    with MatmulRecorder() as forward:
        loss, _, _ = head(h, labels, 16, scale, 1e-3)
    with MatmulRecorder() as backward:
        loss.backward()
    assert len(forward.products) == 9
    assert all(dtypes and set(dtypes) == {torch.bfloat16} for _, dtypes in forward.products), forward.products
    assert backward.products == []
    assert h.grad.dtype == head.weight.grad.dtype == torch.bfloat16


def test_without_gradients_only_the_logits_are_computed():
    """Evaluation (no_grad): one GEMM per chunk, no gradient work."""
    head, h, labels, scale = head_inputs(torch.float32)
    with torch.no_grad(), MatmulRecorder() as recorder:
        loss, ce, _ = head(h, labels, 16, scale)
    assert len(recorder.products) == 3
    torch.testing.assert_close(loss, ce.sum() * scale)


def test_ignored_tokens_with_huge_logits_stay_finite():
    """An ignored token's row is weighted 0 after its softmax: exp(logit) alone would overflow to inf, and inf * 0 is NaN."""
    head, h, labels, scale = head_inputs(torch.float32)
    with torch.no_grad():
        h[:5] *= 1e3  # logits of order 1e4 on the ignored rows
    loss, _, lse = head(h, labels, 16, scale, 1e-3)
    loss.backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(head.weight.grad).all()
    assert (lse[:5] == 0).all() and (h.grad[:5] == 0).all()


def test_bf16_gradients_are_as_close_to_fp32_as_the_plain_bf16_paths():
    """The fused head in bf16 (bf16 GEMMs, fp32 accumulation over chunks) strays from the fp32 gradients no
    further than the plain path in bf16 does (whole bf16 logits, then fp32 cross-entropy)."""
    def gradients(dtype, fused: bool):
        head, h, labels, scale = head_inputs(dtype, tokens=512, hidden=64, vocab=4000)
        if fused:
            loss = head(h, labels, 64, scale)[0]
        else:
            loss = F.cross_entropy(head(h).float(), labels, ignore_index=IGNORE_INDEX)
        loss.backward()
        return h.grad.float(), head.weight.grad.float()

    reference = gradients(torch.float32, fused=False)
    fused, plain = gradients(torch.bfloat16, fused=True), gradients(torch.bfloat16, fused=False)
    for ours, theirs, exact in zip(fused, plain, reference):
        ours_error, plain_error = (ours - exact).norm() / exact.norm(), (theirs - exact).norm() / exact.norm()
        assert ours_error <= 1.2 * plain_error + 1e-4, (float(ours_error), float(plain_error))


PEAK_SCRIPT = """
import resource, sys, torch
from pretrain.model.chunked_loss import LMHead
from pretrain.model.config import ModelConfig
from pretrain.model.llama import Llama
chunk = int(sys.argv[1])
torch.manual_seed(0)
model = Llama(ModelConfig(vocab_size=50_000, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=4,
                          num_kv_heads=4, max_seq_len=2048, loss_chunk_tokens=chunk))
ids = torch.randint(0, 50_000, (1, 2048))
model(ids[:, :8], ids[:, :8]).loss.backward()  # allocator and kernels warmed up, outside the measured part
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
loss = model(ids, ids).loss
loss.backward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before, float(loss.detach()))
"""


def test_peak_memory_of_the_loss_is_lower_at_vocab_50k():
    """2,048 tokens x 50,000 vocabulary: the plain path holds ~0.4 GB of fp32 logits (plus their gradient)."""
    def peak(chunk: int) -> tuple[int, float]:
        proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(chunk)], cwd=REPO, env=cpu_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        grown_kib, loss = proc.stdout.split()
        return int(grown_kib) * 1024, float(loss)

    plain_bytes, plain_loss = peak(0)
    chunked_bytes, chunked_loss = peak(256)
    assert chunked_loss == pytest.approx(plain_loss, rel=1e-6)
    logits_bytes = 2048 * 50_000 * 4
    assert plain_bytes > logits_bytes  # the plain path really materialises them
    assert chunked_bytes < plain_bytes / 3 and chunked_bytes < logits_bytes / 2


@pytest.mark.slow
def test_zero3_on_two_ranks_gives_the_plain_losses(tmp_path):
    corpus = write_tiny_corpus(tmp_path / "data")
    losses = {}
    for chunk in (0, 48):
        overrides = tiny_overrides(corpus, tmp_path / f"runs{chunk}", "deepspeed=zero3", "deepspeed.precision=fp32",
                                   f"model.loss_chunk_tokens={chunk}", "model.z_loss=1e-4", "train.max_steps=4",
                                   "train.eval_interval=0", "checkpoint.save_final=false")
        run = run_training(overrides, nproc=2, launcher="fork")
        assert run.returncode == 0, run.stdout[-3000:]
        losses[chunk] = train_losses(tmp_path / f"runs{chunk}" / "cpu_tiny")
    assert sorted(losses[0]) == [1, 2, 3, 4]
    for step, loss in losses[0].items():
        assert losses[48][step] == pytest.approx(loss, rel=1e-5)
