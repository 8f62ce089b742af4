"""The curriculum inside real DeepSpeed runs: a mid-run stage switch, per-domain metrics in
metrics.jsonl and the W&B offline run, and a resume on a different number of ranks."""
from __future__ import annotations

import pytest

from tests.helpers import read_jsonl, run_training, run_whole_and_resumed, tiny_overrides

pytestmark = pytest.mark.slow


def check_ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-6000:]


def test_stage_switch_with_per_domain_metrics_and_wandb(corpus, tmp_path):
    runs = tmp_path / "runs"
    check_ok(run_training(tiny_overrides(corpus, runs, "curriculum=tiny", "logging=wandb_offline"), launcher="fork"))
    run_dir = runs / "cpu_tiny"
    switches = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "stage_switch"]
    # conf/curriculum/tiny.yaml: stage 2 starts at 24,000 tokens = sample 375, inside step 47.
    assert [(e["step"], e["stage"]) for e in switches] == [(1, 1), (47, 2)]
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]
    by_step = {r["step"]: r for r in records}
    assert by_step[46]["curriculum/stage"] == 1 and by_step[47]["curriculum/stage"] == 2
    assert all("train/loss/ja" in r and "train/loss/en" in r for r in records)
    # Stage 1 is 80% ja, stage 2 70% en: the trained-token counters follow the weights.
    ja46, en46 = by_step[46]["curriculum/tokens/ja"], by_step[46]["curriculum/tokens/en"]
    assert ja46 / (ja46 + en46) == pytest.approx(0.8, abs=0.02)
    ja_added = by_step[128]["curriculum/tokens/ja"] - by_step[50]["curriculum/tokens/ja"]
    en_added = by_step[128]["curriculum/tokens/en"] - by_step[50]["curriculum/tokens/en"]
    assert en_added / (ja_added + en_added) == pytest.approx(0.7, abs=0.02)
    # Re-warmup of stage 2 (4 steps): the LR of the switching step's successor is a quarter of plain cosine.
    assert by_step[48]["opt/lr"] < 0.5 * by_step[46]["opt/lr"]
    vals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/ja/loss" in r]
    assert vals and "val/en/loss" in vals[-1]
    offline = list((run_dir / "wandb").glob("offline-run-*/*.wandb"))
    assert len(offline) == 1
    blob = offline[0].read_bytes()
    for key in (b"curriculum/stage", b"train/loss/ja", b"curriculum/tokens/en", b"val/en/loss", b"events/table"):
        assert key in blob, key


def test_resume_on_fewer_ranks_continues_the_same_stream(corpus, tmp_path):
    """2 ranks to step 60, then 1 rank to the end == 2 ranks all the way (ZeRO-0 loads at any size)."""
    common = ["curriculum=tiny", "deepspeed=zero0", "checkpoint.interval=0"]
    expected, got, _ = run_whole_and_resumed(corpus, tmp_path, common, stop_at=60, first_ranks=2, then_ranks=1)
    assert sorted(got) == list(range(1, 129))
    assert [got[s] for s in range(61, 129)] == pytest.approx([expected[s] for s in range(61, 129)], rel=1e-5)


def test_a_switch_after_the_detector_warm_up_raises_no_alarm(corpus, tmp_path):
    """A stage switch on a step boundary, long after the detector's warm-up and the first stage's grace: the
    loss of the new stage's first step jumps ~4x (English only, then Japanese bytes the model never saw), and
    the switch's grace period covers that very step, so a clean run has no alarm at all. Before the fix the
    step was judged first and its update withheld ("loss 9.598 is 328% above its baseline").

    The grad norm is left out of the verdicts here: a 2-layer byte model's gradient at a switch to unseen
    bytes is a real outlier, which the detector rightly keeps judging during the grace period."""
    runs = tmp_path / "runs"
    stages = ("curriculum.stages=[{name:english,tokens:30720,weights:{en:1.0}},"  # 60 steps x 512 tokens
              "{name:japanese,tokens:34816,weights:{ja:1.0}}]")
    check_ok(run_training(tiny_overrides(corpus, runs, "curriculum=tiny", stages, "deepspeed=zero0",
                                         "stability.detector.warmup_steps=20", "stability.detector.min_history=15",
                                         "stability.detector.use_grad_norm=false"), launcher="fork"))
    events = read_jsonl(runs / "cpu_tiny" / "events.jsonl")
    assert [(e["step"], e["stage"]) for e in events if e["event"] == "stage_switch"] == [(1, 1), (61, 2)]
    alarms = [e for e in events if e["event"] in ("skip_update", "spike", "rollback", "stop")]
    assert alarms == [], alarms
    losses = {r["step"]: r for r in read_jsonl(runs / "cpu_tiny" / "metrics.jsonl") if "train/loss" in r}
    assert losses[61]["train/loss"] > 2.5 * losses[60]["train/loss"]  # the jump the grace period absorbed
    assert losses[61]["stability/skipped_updates"] == 0
