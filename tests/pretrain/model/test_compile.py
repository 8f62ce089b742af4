"""model.compile: each decoder block (or the whole model) compiled with torch.compile (inductor runs on CPU).
Parameter names stay Hugging Face's; a compiled 2-rank run gives the eager run's losses under ZeRO-0 and ZeRO-3
(with activation checkpointing there), and the shapes stay static (one compile per block)."""
from __future__ import annotations

import pytest
import torch

from pretrain.model.config import ModelConfig
from pretrain.model.llama import Llama


def test_auto_is_off_on_cpu_and_blocks_keep_their_names():
    model = Llama(ModelConfig())
    names = [name for name, _ in model.named_parameters()]
    assert model.compile_for("auto", "cpu") == "off"
    assert Llama(ModelConfig()).compile_for("auto", "cuda") == "blocks"  # compiling is lazy: nothing runs here
    assert model.compile_for("blocks", "cpu") == "blocks"
    assert [name for name, _ in model.named_parameters()] == names


@pytest.mark.slow
@pytest.mark.parametrize("zero, extra", [("zero0", []), ("zero3", ["deepspeed.activation_checkpointing=every_2"])])
def test_compiled_blocks_give_the_eager_losses_on_two_ranks(tmp_path, zero, extra):
    from tests.helpers import run_training, tiny_overrides, train_losses, write_tiny_corpus

    corpus = write_tiny_corpus(tmp_path / "data")
    losses = {}
    for mode in ("off", "blocks"):
        overrides = tiny_overrides(corpus, tmp_path / mode, f"deepspeed={zero}", "deepspeed.precision=fp32",
                                   f"model.compile={mode}", "train.max_steps=4", "train.eval_interval=0",
                                   "checkpoint.save_final=false", *extra)
        run = run_training(overrides, nproc=2, timeout=600, launcher="fork")
        assert run.returncode == 0, run.stdout[-3000:]
        assert "Recompiling" not in run.stdout
        losses[mode] = train_losses(tmp_path / mode / "cpu_tiny")
    assert sorted(losses["off"]) == [1, 2, 3, 4]
    for step, loss in losses["off"].items():
        assert losses["blocks"][step] == pytest.approx(loss, rel=1e-5)


def test_a_compiled_block_compiles_once_for_a_static_shape():
    torch._dynamo.reset()
    model = Llama(ModelConfig())
    model.compile_for("blocks", "cpu")
    ids = torch.randint(0, 512, (2, 16))
    from torch._dynamo.utils import counters

    counters.clear()
    for _ in range(3):
        model(ids, ids).loss.backward()
    assert counters["stats"]["unique_graphs"] == 1  # blocks share one code object: compiled once, reused
