"""The tests' fork server (tests/rank_server.py) starts ranks that train exactly as torchrun's do.

Most multi-rank tests start their ranks from it, so what they prove about training holds only if a forked rank
is a real rank: the same per-step losses as under torchrun, bit for bit, a failing job's status and output
coming back, and the jobs it cannot serve (an environment read at import time) handed to a real launcher.
"""
from __future__ import annotations

import os

import pytest

from tests.helpers import _rank_server, cpu_env, run_training, tiny_overrides, train_losses, write_tiny_corpus

pytestmark = pytest.mark.slow


def test_forked_ranks_train_as_torchrun_ranks_do(tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    losses = {}
    for launcher in ("fork", "torchrun"):
        proc = run_training(tiny_overrides(corpus, tmp_path / launcher, "deepspeed=zero2", "train.max_steps=6",
                                           "checkpoint.interval=0", "train.eval_interval=0"), launcher=launcher)
        assert proc.returncode == 0, proc.stdout[-3000:]
        losses[launcher] = train_losses(tmp_path / launcher / "cpu_tiny")
    assert list(losses["fork"]) == list(range(1, 7))
    assert losses["fork"] == losses["torchrun"]


def test_a_failing_rank_fails_the_job_and_its_output_comes_back(tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    proc = run_training(tiny_overrides(corpus, tmp_path / "runs", "train.global_batch_size=10"), launcher="fork")
    assert proc.returncode != 0 and proc.args[0] == "rank_server"
    assert "global_batch_size" in proc.stdout


def test_an_environment_read_at_import_goes_to_a_real_launcher():
    server = _rank_server()
    assert server.serves(cpu_env())
    other_isa = "default" if os.environ.get("ATEN_CPU_CAPABILITY") == "avx2" else "avx2"  # the suite may run as avx2
    assert not server.serves(cpu_env(ATEN_CPU_CAPABILITY=other_isa))
    assert not server.serves(cpu_env(AYUMI_CONF_DIR="/elsewhere"))
