"""Spike recovery, update skipping, the loss-scale watchdog and escalation: real 2-rank DeepSpeed runs.

The workload is the tiny Llama on the repeated real-text corpus; faults come from the
`stability.inject` fire-drill settings, and every assertion reads the run dir (events.jsonl,
metrics.jsonl, checkpoints) the way a user would.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, cpu_env, read_jsonl, run_training, tiny_overrides

pytestmark = pytest.mark.slow

FP16_ENTRY = str(REPO / "tests" / "pretrain" / "fp16_train.py")
GLOBAL_BATCH = 8  # cpu_tiny: 8 samples of 64 tokens per step

# Detector and recovery scaled down to a 256-step run: warm-up 40 steps, a recovery checkpoint
# every 20 steps, roll back >= 20 steps, skip 10 batches, halve the LR for 30 steps.
STABILITY = [
    "train.tokens=131072", "checkpoint.interval=0",
    "stability.detector.warmup_steps=40", "stability.detector.min_history=30",
    "stability.recovery.ring_interval=20", "stability.recovery.rollback_steps=20",
    "stability.recovery.skip_batches=10", "stability.recovery.lr_cooldown_steps=30",
    "stability.recovery.ring_keep=20",  # keep older ring checkpoints: the restart test loads one
]
SPIKE_AT_150 = "+stability.inject.lr_multiply={150:50.0,151:50.0,152:50.0}"


def events_of(run_dir: Path, kind: str | None = None) -> list[dict]:
    events = read_jsonl(run_dir / "events.jsonl")
    return [e for e in events if kind is None or e["event"] == kind]


def train_records(run_dir: Path) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]


def check_ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-6000:]


@pytest.fixture(scope="module")
def recovered_run(corpus, tmp_path_factory) -> Path:
    """One run with an LR x50 spike at steps 150-152 and recovery on, stopped at step 200."""
    runs = tmp_path_factory.mktemp("recovered")
    proc = run_training(tiny_overrides(corpus, runs, "deepspeed=zero2", *STABILITY, SPIKE_AT_150, "train.max_steps=200"), launcher="fork")
    check_ok(proc)
    return runs / "cpu_tiny"


def test_spike_rolls_back_to_the_right_checkpoint_and_data_position(recovered_run):
    run_dir = recovered_run
    spike = events_of(run_dir, "spike")
    assert len(spike) == 1 and spike[0]["spike_start"] == 151  # step 150's update did the damage
    rollback = events_of(run_dir, "rollback")
    assert len(rollback) == 1
    # The newest recovery checkpoint at least rollback_steps (20) before the spike's start: 120.
    assert rollback[0]["to_step"] == 120 and rollback[0]["skip_batches"] == 10
    # The outlier steps before the spike was confirmed had their updates withheld.
    assert [e["step"] for e in events_of(run_dir, "skip_update")] == [152, 153]  # steps done, as logged
    skipped = events_of(run_dir, "batches_skipped")
    assert len(skipped) == 1
    assert (skipped[0]["skip_start"], skipped[0]["skip_stop"]) == (120 * GLOBAL_BATCH, 130 * GLOBAL_BATCH)
    assert json.loads((run_dir / "skipped_samples.json").read_text())["skips"] == [[960, 1040]]
    recovered = events_of(run_dir, "recovered")
    assert len(recovered) == 1 and recovered[0]["latency_s"] < 10


def test_recovery_cools_the_lr_and_training_continues(recovered_run):
    records = train_records(recovered_run)
    steps = [r["step"] for r in records]
    rollback_at = steps.index(154)  # the step on which the spike was confirmed
    after = records[rollback_at + 1:]
    assert after[0]["step"] == 121, "training resumes right after checkpoint 120"
    # First step after the rollback: LR x0.5 (the cool-down ramps back to 1 over 30 steps).
    before_spike = {r["step"]: r for r in records[:rollback_at]}
    assert after[0]["opt/lr"] == pytest.approx(0.5 * before_spike[121]["opt/lr"], rel=1e-6)
    assert after[0]["stability/lr_factor"] == pytest.approx(0.5)
    cooled = {r["step"]: r["stability/lr_factor"] for r in after}
    assert cooled[150] == pytest.approx(0.5 + 0.5 * 29 / 30)  # step index 149 = 29 steps into the ramp
    assert cooled[151] == 1.0
    # The injected faults do not fire again on the replay, and the loss is back where it was.
    assert [r["step"] for r in after][-1] == 200
    assert all(math.isfinite(r["train/loss"]) for r in after)
    assert after[-1]["train/loss"] < 1.5 * min(r["train/loss"] for r in records[:rollback_at] if r["step"] > 100)
    assert after[-1]["stability/recoveries"] == 1


def test_restart_after_recovery_keeps_the_count_and_never_replays_skipped_data(recovered_run, corpus):
    runs = recovered_run.parent
    # 1) The default restart (from `latest`) remembers the recovery.
    proc = run_training(tiny_overrides(corpus, runs, "deepspeed=zero2", *STABILITY, SPIKE_AT_150, "train.max_steps=205"), launcher="fork")
    check_ok(proc)
    records = train_records(recovered_run)
    assert records[-1]["step"] == 205 and records[-1]["stability/recoveries"] == 1
    # 2) Restarting the same run from a checkpoint older than the skip (ring checkpoint 100):
    #    the run dir's skip ledger makes it jump over samples [960, 1040) again at step 120.
    older = recovered_run / "checkpoints" / "recovery" / "step_0000100"
    assert (older / "ayumi.json").exists()
    proc = run_training(tiny_overrides(corpus, runs, "deepspeed=zero2", *STABILITY, "train.max_steps=125",
                                       f"checkpoint.load_from={older}"), launcher="fork")
    check_ok(proc)
    assert "resumed from" in proc.stdout and "step_0000100" in proc.stdout
    skips = events_of(recovered_run, "batches_skipped")
    assert len(skips) == 2 and skips[-1]["step"] == 120
    assert (skips[-1]["skip_start"], skips[-1]["skip_stop"]) == (960, 1040)


def test_repeated_spikes_stop_cleanly_with_a_saved_state(corpus, tmp_path):
    """max_recoveries=1: the second spike (faults at 150 and again at 200) stops the run."""
    runs = tmp_path / "runs"
    proc = run_training(tiny_overrides(
        corpus, runs, *STABILITY, "stability.recovery.max_recoveries=1",
        "+stability.inject.lr_multiply={150:50.0,151:50.0,152:50.0,200:50.0,201:50.0,202:50.0}"))
    assert proc.returncode != 0, "a stability stop must not look like a finished run"
    assert "exitcode  : 3" in proc.stdout, proc.stdout[-3000:]
    run_dir = runs / "cpu_tiny"
    stop = events_of(run_dir, "stop")
    assert len(stop) == 1 and stop[0]["step"] == 204
    message = stop[0]["message"]
    assert "recover" in message and "optim.lr" in message, message
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_0000204"
    assert "STOPPING" in proc.stdout


def test_fp16_overflow_storm_resets_the_scale_before_the_floor(corpus, tmp_path):
    """16 forced overflows in a row would halve a 2^12 scale below the floor (DeepSpeed raises
    there); the watchdog resets it to 2^16 first and training goes on."""
    runs = tmp_path / "runs"
    storm = "[" + ",".join(str(s) for s in range(60, 76)) + "]"
    proc = run_training(
        tiny_overrides(corpus, runs, "deepspeed=fp16", "deepspeed.initial_scale_power=12", "deepspeed.hysteresis=1",
                       "train.tokens=65536", f"stability.inject.fp16_overflow_steps={storm}"),
        entry=FP16_ENTRY, launcher="fork")
    check_ok(proc)
    run_dir = runs / "cpu_tiny"
    resets = events_of(run_dir, "loss_scale_reset")
    assert resets, "the watchdog never reset the scale"
    assert resets[0]["new_scale"] == 2.0**16 and resets[0]["loss_scale"] <= 8.0
    records = train_records(run_dir)
    scales = [r["opt/loss_scale"] for r in records]
    assert min(scales) >= 1.0
    assert records[-1]["step"] == 128 and math.isfinite(records[-1]["train/loss"])
    by_step = {r["step"]: r for r in records}
    # Every storm step was skipped by DeepSpeed's scaler; none was mistaken for a loss spike.
    assert by_step[76]["opt/skipped_steps"] - by_step[60]["opt/skipped_steps"] == 16
    assert not events_of(run_dir, "rollback") and not events_of(run_dir, "spike")


ADAM_CHECK = r"""
import json, os, sys, torch
sys.path.insert(0, {repo!r})
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from pretrain.config import compose_config, to_object
from pretrain.engine.distributed import exit_process, init_distributed
from pretrain.engine.train_engine import TrainEngine
from pretrain.model.llama import Llama

stage, precision, fault = {stage}, {precision!r}, {fault!r}
cfg = to_object(compose_config(["experiment=cpu_tiny", "model.vocab_size=512", f"deepspeed.zero_stage={{stage}}",
                                f"deepspeed.precision={{precision}}"]))
dist = init_distributed("cpu")
torch.manual_seed(0)
engine = TrainEngine(Llama(cfg.model), cfg, dist)
ids = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(1))
engine.set_update_gate(lambda: engine.current_grad_norm() is not None and
                       torch.isfinite(torch.tensor(engine.current_grad_norm())).item())

def step(bad):
    for micro in range(engine.grad_accum):
        out = engine.forward(ids[:, :-1], ids[:, 1:])
        loss = out.loss
        if bad and fault == "nan":
            loss = loss * float("nan")
        if bad and fault == "inf_grad":
            loss = loss * float("inf")
        engine.backward(loss)
        engine.withhold_next_update(False) if micro == 0 else None
        result = engine.micro_step()
    return result

def snapshot():
    opt = engine.client_optimizer
    # Every moment Adam holds (ZeRO-3 swaps sub-group tensors in and out of param_groups).
    moments = [state[key].clone() for state in opt.state.values() for key in ("exp_avg", "exp_avg_sq")]
    return engine.full_fp32_params(), moments

step(False)
params, moments = snapshot()
result = step(True)
params2, moments2 = snapshot()
same_params = all(torch.equal(params[k], params2[k]) for k in params)
same_moments = len(moments) > 0 and all(torch.equal(a, b) for a, b in zip(moments, moments2))
finite = all(torch.isfinite(m).all().item() for m in moments2) and all(torch.isfinite(p).all().item() for p in params2.values())
applied = result.applied and not engine.update_was_withheld()
step(False)
params3, _ = snapshot()
moved = any(not torch.equal(params2[k], params3[k]) for k in params2)
print("RESULT " + json.dumps(dict(same_params=same_params, same_moments=same_moments, finite=finite,
                                  applied=applied, moved_after=moved)))
exit_process(0)
"""


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "bf16")])
@pytest.mark.parametrize("fault", ["nan", "inf_grad"])
def test_nonfinite_step_leaves_weights_and_adam_moments_untouched(stage, precision, fault):
    script = ADAM_CHECK.format(repo=str(REPO), stage=stage, precision=precision, fault=fault)
    env = cpu_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(__import__("tests.helpers", fromlist=["free_port"]).free_port()))
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result == dict(same_params=True, same_moments=True, finite=True, applied=False, moved_after=True)


def test_adaptive_clipping_follows_the_percentile_of_recent_norms(corpus, tmp_path):
    """After 10 accepted steps the clip threshold becomes the p90 of the unclipped norms seen so far."""
    import numpy as np

    runs = tmp_path / "runs"
    check_ok(run_training(tiny_overrides(corpus, runs, "train.tokens=16384", "stability.clip.enabled=true",
                                         "stability.clip.warmup_steps=10", "stability.clip.window=1000"), launcher="fork"))
    records = train_records(runs / "cpu_tiny")
    norms = [r["opt/grad_norm"] for r in records]
    thresholds = [r["opt/clip_threshold"] for r in records]
    # The threshold logged with step k is the one for the next step: static (1.0) until 10 norms are in.
    assert thresholds[:9] == [1.0] * 9
    for k in range(10, len(records)):
        assert thresholds[k - 1] == pytest.approx(np.percentile(norms[:k], 90), rel=1e-6)
    assert "stability/clipped_share" in records[-1]
