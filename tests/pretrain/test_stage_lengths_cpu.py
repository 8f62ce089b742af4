"""A short-to-long curriculum in real DeepSpeed runs on 2 CPU ranks: 64-token samples, then 256-token samples
with a larger RoPE base, switched in-process; exact resume on either side of the switch; sequence parallelism
across the switch; the checkpoint and the export carry the stage's RoPE. (The schedule, the streams, the
length filter and the refusals alone: tests/curriculum/test_stage_lengths.py.)"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import cpu_env, read_jsonl, run_training, tiny_overrides, train_losses, write_tiny_corpus

pytestmark = pytest.mark.slow

SHORT_TO_LONG = [
    "curriculum=tiny",
    "curriculum.stages=[{name:short,tokens:16384,weights:{ja:0.5,en:0.5}},"
    "{name:long,tokens:16384,seq_len:256,rope_theta:40000,weights:{ja:0.5,en:0.5}}]",
    "train.tokens=32768", "model.max_seq_len=256", "deepspeed=zero1", "deepspeed.precision=fp32",
    "checkpoint.interval=0", "checkpoint.keep_last=0", "train.eval_interval=0",
]
"""64 steps of 8 x 64 tokens: steps 1-32 at seq_len 64, steps 33-64 one 256-token sample per micro batch."""


def train(corpus: Path, run_root: Path, *extra: str) -> str:
    proc = run_training(tiny_overrides(corpus, run_root, *SHORT_TO_LONG, *extra), launcher="fork")
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def record(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / f"step_{step:07d}" / "ayumi.json").read_text())


def test_short_to_long_switches_in_process_resumes_exactly_and_exports_the_stage_rope(tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    whole = tmp_path / "whole"
    log = train(corpus, whole, "checkpoint.async_save=true", "checkpoint.interval=32")
    assert "stage 2/2 'long' begins at sample 256 (16,384 tokens)" in log and "at seq_len 256" in log
    assert "stage 2: RoPE theta 40000" in log
    rows = {r["step"]: r for r in read_jsonl(whole / "cpu_tiny" / "metrics.jsonl") if "train/loss" in r}
    assert sorted(rows) == list(range(1, 65))
    # The batches themselves have the stage's length (read from the tensors the model was given).
    assert {rows[s]["train/seq_len"] for s in range(1, 33)} == {64}
    assert {rows[s]["train/seq_len"] for s in range(33, 65)} == {256}
    assert rows[64]["curriculum/tokens/ja"] + rows[64]["curriculum/tokens/en"] == 32768
    # Step 32's asynchronous save is published while step 33 already trains with the long stage's RoPE: its record
    # holds the RoPE of step 32 (it held step 33's before the checkpointer copied the record at save).
    assert record(whole / "cpu_tiny", 32)["model"]["rope_theta"] == 10000.0
    assert record(whole / "cpu_tiny", 64)["model"]["rope_theta"] == 40000.0

    # Stopped before the switch, resumed (the switch happens in the resumed process), stopped inside the long
    # stage, resumed again (the RoPE is retuned at resume): the same losses, bit for bit.
    split = tmp_path / "split"
    train(corpus, split, "train.max_steps=28")
    second = train(corpus, split, "train.max_steps=40")
    third = train(corpus, split)
    assert "resumed from" in second and "resumed from" in third
    expected, got = train_losses(whole / "cpu_tiny"), train_losses(split / "cpu_tiny")
    assert [got[s] for s in range(1, 65)] == [expected[s] for s in range(1, 65)]
    assert record(split / "cpu_tiny", 28)["model"]["rope_theta"] == 10000.0
    assert record(split / "cpu_tiny", 40)["model"]["rope_theta"] == 40000.0

    # Sequence parallelism over the switch: each rank holds 32, then 128 tokens of every sample.
    sp = tmp_path / "sp"
    train(corpus, sp, "parallel.sequence=2")
    sp_losses = train_losses(sp / "cpu_tiny")
    assert [sp_losses[s] for s in range(1, 65)] == pytest.approx([expected[s] for s in range(1, 65)], rel=1e-5)

    # The export of a long-stage checkpoint carries the RoPE the model was trained with.
    out = tmp_path / "hf"
    proc = subprocess.run([str(Path(os.sys.executable).parent / "ayumi"), "export", "hf",
                           str(whole / "cpu_tiny" / "checkpoints"), str(out)],
                          env=cpu_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoConfig  # as a user loads it: transformers 5 keeps RoPE in rope_parameters

    config = AutoConfig.from_pretrained(out)
    assert config.rope_parameters["rope_theta"] == 40000.0
