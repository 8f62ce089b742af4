"""Smoke test of bench/gpu_speed.py on the CPU: the worker path (ayumi's trainer with model.compile and
activation checkpointing, the memory plan beside it) runs end to end, so the GPU benchmark is ready when a
GPU is. The figures mean nothing here."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.slow


def test_gpu_speed_runs_its_combinations_on_the_cpu(tmp_path):
    work = tmp_path / "work"
    cmd = [sys.executable, str(REPO / "bench" / "gpu_speed.py"), "--cpu-smoke", "--compile", "off,blocks",
           "--checkpointing", "full", "--steps", "2", "--warmup", "1", "--work", str(work)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    for mode in ("off", "blocks"):
        result = json.loads((work / f"tiny_{mode}_full.json").read_text())
        assert result["tokens_per_s"] > 0 and result["compiled"] == mode and result["planned_peak"] > 0
    assert "every combination ran through the trainer" in proc.stdout


def test_gpu_speed_without_cuda_measures_nothing():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_speed.py")], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "no CUDA device visible: nothing measured" in proc.stdout
