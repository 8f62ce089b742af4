"""model.loss_chunk_tokens: the LM head and cross-entropy in chunks, recomputed in backward. Equal to the plain
path (loss, z-loss, per-sample losses, every gradient; fp32), lower peak memory at vocabulary 50k (measured
as a process's peak RSS), and the same losses under ZeRO-3 on 2 ranks."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

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
        assert grads.keys() == plain_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-5, atol=1e-7)
    assert plain["sample_tokens"].tolist() == [12, 17, 0] and plain["sample_loss"][2] == 0


PEAK_SCRIPT = """
import resource, sys, torch
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
