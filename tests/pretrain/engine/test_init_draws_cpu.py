"""A run that starts from a checkpoint draws no initial weights; a fresh run draws each parameter once.

Real training through pretrain.train (one rank, forked), its model build counted by tests/pretrain/engine/
init_count_train.py: the resume's weights come from the checkpoint, so drawing a full init first would only cost
start-up time (2-3 minutes at 7B when it was drawn on one CPU thread). That the loaded weights are the checkpoint's
is tested by the resume tests (tests/pretrain/test_train_cpu.py: the resumed losses equal the uninterrupted run's).
"""
from __future__ import annotations

import re

import pytest

from tests.helpers import REPO, run_training, tiny_overrides, train_losses

pytestmark = pytest.mark.slow

ENTRY = str(REPO / "tests" / "pretrain" / "engine" / "init_count_train.py")


def draws(output: str) -> list[tuple[int, int]]:
    return [(int(n), int(m)) for n, m in re.findall(r"init draws on rank 0: (\d+) of (\d+) parameters", output)]


@pytest.mark.parametrize("stage", ["zero1", "zero3"])
def test_a_resume_draws_no_initial_weights(corpus, tmp_path, stage):
    common = [f"deepspeed={stage}", "deepspeed.precision=fp32", "train.tokens=4096", "checkpoint.interval=0"]
    fresh = run_training(tiny_overrides(corpus, tmp_path, *common, "train.max_steps=2"), nproc=1, launcher="fork",
                         entry=ENTRY)
    assert fresh.returncode == 0, fresh.stdout[-6000:]
    [(drawn, total)] = draws(fresh.stdout)
    assert drawn == total > 0
    resumed = run_training(tiny_overrides(corpus, tmp_path, *common), nproc=1, launcher="fork", entry=ENTRY)
    assert resumed.returncode == 0, resumed.stdout[-6000:]
    assert "resumed from" in resumed.stdout
    assert draws(resumed.stdout) == [(0, total)]
    losses = train_losses(tmp_path / "cpu_tiny")
    assert sorted(losses) == list(range(1, 9))
    # Trained from the checkpoint's weights, not from the zeros the build left for the load to fill: the
    # resumed steps go on below the untrained model's loss.
    assert max(losses[s] for s in range(3, 9)) < losses[1]


def test_the_model_init_bench_runs_and_reports(tmp_path):
    """bench/model_init.py (build + init per 1e9 parameters, build_model against the former way) at the debug shape:
    it runs and ends with its two RESULT lines; the figures mean nothing at this size."""
    import os
    import subprocess
    import sys

    cmd = [sys.executable, str(REPO / "bench" / "model_init.py"), "--model", "debug", "--layers", "0", "--rounds", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, DS_ACCELERATOR="cpu"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert results == ["model_init", "model_init_resume"]
