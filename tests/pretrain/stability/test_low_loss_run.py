"""Issue 46's case, trained for real: a clean run whose loss goes low and noisy has no stability event.

The tiny corpus repeated (two short documents, read dozens of times), 2 ranks, fp32, 512 steps: by step ~340 the loss
is 0.02-0.10 from one step to the next around a median near 0.04. The divergence rule before issue 46 (a relative
rise of the baseline alone) called that wobble a climb: rollbacks, the LR cut for good, and a stop at step ~335.
"""
from __future__ import annotations

import pytest

from tests.helpers import read_jsonl, run_training, tiny_overrides

pytestmark = pytest.mark.slow

ISSUE_46 = ["deepspeed.precision=fp32", "train.tokens=262144", "checkpoint.interval=40"]
"""The issue's command line on top of experiment=cpu_tiny: 512 steps of 8 x 64 tokens, nothing injected."""


def test_a_clean_low_loss_run_has_no_spike_rollback_or_stop(corpus, tmp_path):
    proc = run_training(tiny_overrides(corpus, tmp_path, *ISSUE_46), launcher="fork")
    run_dir = tmp_path / "cpu_tiny"
    events = read_jsonl(run_dir / "events.jsonl")
    alarms = [f"{e['event']}@{e['step']}: {e.get('message', '')[:120]}" for e in events
              if e["event"] in ("spike", "rollback", "stop", "skip_update")]
    assert alarms == [], "\n".join(alarms)
    assert proc.returncode == 0, proc.stdout[-4000:]
    losses = {r["step"]: r["train/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r}
    assert max(losses) == 512
    tail = sorted(losses[s] for s in range(413, 513))
    # The case is the issue's: a low loss whose single steps vary several-fold.
    assert tail[50] < 0.06 and tail[-1] / tail[0] > 2.5, (tail[0], tail[50], tail[-1])
