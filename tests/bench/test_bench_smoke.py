"""Smoke test of bench/step_overhead.py: a tiny shape and a handful of steps, 2 CPU ranks.

Checks that both sides run under torchrun and that the output ends with a well-formed RESULT line
(bench/README.md); the figures themselves mean nothing at this size.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RESULT = re.compile(
    r"^RESULT (?P<name>\S+) ours=(?P<ours>[0-9.]+)ms baseline=(?P<base>[0-9.]+)ms ratio=(?P<ratio>[0-9.]+) "
    r"target=<=1\.05 ok=(?P<ok>true|false) spread=\S+ n=(?P<n>\d+) load=\S+ cpus=\d+$"
)


def test_step_overhead_smoke(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "step_overhead.py"), "--hidden", "64", "--layers", "2",
           "--heads", "4", "--seq", "32", "--micro-batch", "2", "--grad-accum", "2", "--warmup", "1",
           "--block", "2", "--rounds", "2", "--work", str(tmp_path / "work")]
    env = dict(os.environ, DS_ACCELERATOR="cpu", WANDB_MODE="offline", WANDB_SILENT="true", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    match = RESULT.match(last)
    assert match, last
    assert match["name"] == "step_overhead"
    ours, base, ratio = float(match["ours"]), float(match["base"]), float(match["ratio"])
    assert ours > 0 and base > 0 and ratio > 0  # ratio: median of per-round paired ratios, not ours/base
    assert match["n"] == "2"  # the spread is over the rounds' paired ratios
    # Metrics were really on: ayumi's run dir holds the jsonl with one record per ayumi step, and a W&B run.
    run_dir = tmp_path / "work" / "runs" / "bench_cpu"
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 1 + 2 * 2  # warm-up + rounds x block
    assert list((run_dir / "wandb").glob("offline-run-*"))
    assert "shape: Llama hidden 64" in proc.stdout
