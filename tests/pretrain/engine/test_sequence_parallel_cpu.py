"""Sequence parallelism (DeepSpeed Ulysses' DistributedAttention) on CPU ranks with gloo: real `pretrain.train`
jobs of the tiny Llama (4 query heads, 2 K/V heads).

A reference run on 1 rank and a parallel.sequence=2 run on 2 ranks see the same global batches: each of the 2
ranks computes half of every sequence, and attention exchanges heads for the whole sequence. Their per-step
losses must agree to fp32 rounding, and so must their validation losses (evaluation runs whole sequences).
Also: ZeRO-3 with document masking and restarted positions, an exact resume, a resume as plain data
parallelism, and the refusals.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    REPO, cpu_env, read_jsonl, run_training, tiny_overrides, train_losses, train_side_by_side, PARALLEL_COMPARISON,
    PARALLEL_COMPARISON_STEPS, write_tiny_corpus,
)

pytestmark = pytest.mark.slow

FP32_ZERO1, STEPS = PARALLEL_COMPARISON, PARALLEL_COMPARISON_STEPS


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The reference (1 rank) and the parallel.sequence=2 run (2 ranks) of the same job, trained once."""
    return train_side_by_side(tmp_path_factory.mktemp("sp"), FP32_ZERO1,
                              [("sp1", 1, []), ("sp2", 2, ["parallel.sequence=2"])])


def test_sp2_losses_equal_sp1_for_30_steps(runs):
    """Same global batch, same init: 2 ranks each computing half of every sequence train as 1 rank does."""
    assert "sequence-parallel 2 x data-parallel 1: 32 tokens of each sequence a rank" in runs["sp2_log"]
    one, two = train_losses(runs["sp1"]), train_losses(runs["sp2"])
    assert sorted(two) == list(range(1, STEPS + 1))
    worst = max(abs(one[s] - two[s]) for s in one)
    assert worst < 1e-5, f"largest per-step loss difference {worst:.2e}"
    assert two[STEPS] < 0.6 * two[1]  # it learns
    val = [[r for r in read_jsonl(run / "metrics.jsonl") if "val/loss" in r][-1] for run in (runs["sp1"], runs["sp2"])]
    assert val[1]["val/loss"] == pytest.approx(val[0]["val/loss"], abs=1e-5)
    for key in [k for k in val[0] if k.startswith("val/")]:
        assert val[1][key] == pytest.approx(val[0][key], abs=1e-5), key
    rendered = json.loads((runs["sp2"] / "deepspeed_config.json").read_text())
    # DeepSpeed counts the group's 2 ranks as data-parallel: each sample twice in its batch figure.
    assert (rendered["train_batch_size"], rendered["gradient_accumulation_steps"]) == (16, 2)


def test_sp2_resume_is_exact_and_resumes_as_data_parallel(runs):
    """Stopped at step 15 and resumed with parallel.sequence=2: the uninterrupted run's losses, bit for bit.
    The same checkpoint resumed with parallel.sequence=1 on the same 2 ranks (2 data-parallel ranks; ZeRO
    partitions over all ranks either way): the same data position, losses to fp32 rounding."""
    expected = train_losses(runs["sp2"])
    split = runs["root"] / "split"
    for steps in (15, STEPS):
        proc = run_training(tiny_overrides(runs["corpus"], split, *FP32_ZERO1, "parallel.sequence=2",
                                           f"train.max_steps={steps}"), launcher="fork")
        assert proc.returncode == 0, proc.stdout[-6000:]
    assert "resumed from" in proc.stdout and "re-sharded" not in proc.stdout
    assert train_losses(split / "cpu_tiny") == expected
    meta = json.loads((split / "cpu_tiny/checkpoints/step_0000015/ayumi.json").read_text())
    assert (meta["world_size"], meta["sequence_parallel"]) == (2, 2)

    other = runs["root"] / "as_dp"
    run_training(tiny_overrides(runs["corpus"], other, *FP32_ZERO1, "parallel.sequence=2", "train.max_steps=15"),
                 launcher="fork")
    proc = run_training(tiny_overrides(runs["corpus"], other, *FP32_ZERO1, "parallel.sequence=1"), launcher="fork")
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "resumed from" in proc.stdout
    got = train_losses(other / "cpu_tiny")
    assert sorted(got) == list(range(1, STEPS + 1))
    assert max(abs(got[s] - expected[s]) for s in range(16, STEPS + 1)) < 1e-5


def test_zero3_data_parallel_document_masking_with_restarted_positions(tmp_path):
    """4 ranks: 2 sequence-parallel groups of 2, each its own samples (data parallelism), ZeRO-3 (parameters
    gathered per layer around the exchange), fp32, document masking built from the whole sequence and RoPE
    positions restarted per document, sliced per rank: as one rank computes it."""
    corpus = write_tiny_corpus(tmp_path / "corpus")
    common = ["deepspeed=zero3", "deepspeed.precision=fp32", "train.max_steps=12", "checkpoint.interval=0",
              "train.eval_interval=0", "model.attention=document", "model.restart_positions=true"]
    losses = {}
    for name, nproc, extra in (("one", 1, []), ("two", 4, ["parallel.sequence=2"])):
        proc = run_training(tiny_overrides(corpus, tmp_path / name, *common, *extra), nproc=nproc, launcher="fork")
        assert proc.returncode == 0, proc.stdout[-6000:]
        losses[name] = train_losses(tmp_path / name / "cpu_tiny")
    assert "sequence-parallel 2 x data-parallel 2" in proc.stdout
    assert sorted(losses["two"]) == list(range(1, 13))
    worst = max(abs(losses["one"][s] - losses["two"][s]) for s in losses["one"])
    assert worst < 1e-5, f"largest per-step loss difference {worst:.2e}"


@pytest.mark.parametrize("extra, says", [
    (["parallel.sequence=2", "parallel.tensor=2"], "parallel.sequence=2 with parallel.tensor=2: ayumi does not combine"),
    (["parallel.sequence=4", "model.num_kv_heads=2"], "parallel.sequence=4 must divide model.num_kv_heads=2"),
    (["parallel.sequence=2", "train.seq_len=63", "model.max_seq_len=64"], "parallel.sequence=2 must divide train.seq_len=63"),
    (["parallel.sequence=2", "train.num_gpus=3", "train.gpu_memory_gib=80"], "train.num_gpus=3 must divide by parallel.sequence=2"),
])
def test_what_does_not_combine_is_refused_in_one_line(extra, says):
    """Checked before any rank starts: `ayumi plan` (the same checks as the ranks') exits 2 with the field named."""
    proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "plan", "experiment=cpu_tiny",
                           "model.vocab_size=512", *extra],  # no data root: nothing for the vocabulary to follow
                          cwd=REPO, env=cpu_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert says in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr


def test_the_plan_divides_activations_by_the_group():
    """The memory plan: activations for seq_len / N tokens a rank, model states over every rank."""
    from pretrain.plan.memory import MemoryShape, activation_bytes, estimate_memory
    from pretrain.model.config import ModelConfig

    model = ModelConfig(hidden_size=256, intermediate_size=704, num_layers=2, num_heads=8, num_kv_heads=4,
                        max_seq_len=8192, vocab_size=1024)
    plain = MemoryShape(model, micro_batch=1, seq_len=8192, precision="bf16", zero_stage=1, data_parallel=2)
    split = MemoryShape(model, micro_batch=1, seq_len=8192, precision="bf16", zero_stage=1, data_parallel=1,
                        sequence_parallel=2)
    half = MemoryShape(model, micro_batch=1, seq_len=4096, precision="bf16", zero_stage=1, data_parallel=2)
    assert activation_bytes(split) == activation_bytes(half)
    assert activation_bytes(split) < activation_bytes(plain)
    states = [estimate_memory(s).model_states for s in (plain, split)]
    assert states[0] == states[1]  # ZeRO partitions over the same 2 ranks
