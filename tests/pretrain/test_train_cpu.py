"""Real DeepSpeed training on CPU: 2 ranks, gloo, the tiny Llama, a repeated real-text corpus.

Each job is a real `torchrun` (or `deepspeed` launcher) run of pretrain.train, checked through
its run dir (metrics.jsonl, events.jsonl, checkpoints) and its exit code.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    REPO, cpu_env, free_port, read_jsonl, run_training, run_whole_and_resumed, tiny_overrides, train_losses,
    write_tiny_corpus,
)

pytestmark = pytest.mark.slow

FP16_ENTRY = str(REPO / "tests" / "pretrain" / "fp16_train.py")


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-6000:]


def metrics(run_dir: Path) -> list[dict]:
    return [rec for rec in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in rec]


def test_every_zero_stage_trains_in_bf16(corpus, tmp_path):
    """ZeRO 0/1/2/3 with bf16 on 2 ranks: the loss falls, all stages start from the same weights (the same first
    loss) and see the same first gradient, and ZeRO-0's losses follow ZeRO-1's (DeepSpeed's stage-0 wrapper no
    longer counts a warm-up step: forget_warm_up_step)."""
    first_norms, all_losses = {}, {}
    for stage in (0, 1, 2, 3):
        runs = tmp_path / f"zero{stage}"
        proc = run_training(tiny_overrides(corpus, runs, f"deepspeed=zero{stage}", "deepspeed.precision=bf16", "train.tokens=12288",
                                           "stability.precision_check_every=1"), launcher="fork")
        check_ok(proc)
        records = metrics(runs / "cpu_tiny")
        assert [r["step"] for r in records] == list(range(1, 25))
        losses = all_losses[stage] = [r["train/loss"] for r in records]
        assert all(math.isfinite(x) for x in losses)
        assert sum(losses[-4:]) / 4 < 0.75 * sum(losses[:4]) / 4, f"ZeRO-{stage} loss did not fall: {losses}"
        norms = [r["opt/grad_norm"] for r in records]
        assert all(n is not None and math.isfinite(n) and n > 0 for n in norms), norms
        first_norms[stage] = norms[0]
        # Per-group norms, gathered from ZeRO's partitions, combine to DeepSpeed's global norm.
        groups = {k: v for k, v in records[0].items() if k.startswith("opt/grad_norm/")}
        assert {"opt/grad_norm/embedding", "opt/grad_norm/block_0", "opt/grad_norm/block_1",
                "opt/grad_norm/final_norm", "opt/grad_norm/lm_head"} == set(groups)
        assert math.sqrt(sum(v * v for v in groups.values())) == pytest.approx(norms[0], rel=1e-3)
        assert all(r["stability/update_ratio/lm_head"] > 0 for r in records if "stability/update_ratio/lm_head" in r)
        assert records[-1]["tokens"] == 24 * 8 * 64
        vals = [r for r in read_jsonl(runs / "cpu_tiny" / "metrics.jsonl") if "val/ja/loss" in r]
        assert vals and vals[-1]["val/ja/loss"] < 4.5 and vals[-1]["val/en/loss"] < 4.5
        # The fp32 evaluation beside the bf16 one (gathered from ZeRO partitions) agrees closely.
        assert all(abs(v["val/ja/fp32_gap"]) < 0.05 and v["val/ja/loss_fp32"] > 0 for v in vals)
    # The same seed gives the same initial weights at every stage (each parameter drawn from its own generator,
    # seeded from the seed and its name: pretrain/engine/train_engine.py build_model), so the first step's loss is
    # the same number at every stage (bit for bit on the CPU) and its gradient the same to the reductions' rounding.
    first_losses = {stage: losses[0] for stage, losses in all_losses.items()}
    for stage in first_losses:
        assert first_losses[stage] == pytest.approx(first_losses[1], rel=1e-6), first_losses
        assert first_norms[stage] == pytest.approx(first_norms[1], rel=1e-3), first_norms
    gaps = {stage: max(abs(a - b) / b for a, b in zip(all_losses[stage], all_losses[1])) for stage in (0, 2, 3)}
    print("largest relative loss gap to ZeRO-1 over 24 steps:", gaps)
    assert gaps[0] <= 5e-3, gaps  # 1.6e-3 measured; 2.9e-2 while the warm-up step counted


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_dynamic_loss_scale(corpus, tmp_path, stage):
    """fp16 through the real DeepSpeed fp16 optimizer (test-only CPU switch, see fp16_train.py).

    Starting at a loss scale of 2^24 makes the scaled gradients overflow: DeepSpeed skips those
    steps and halves the scale until training proceeds, and the loss still falls.
    """
    runs = tmp_path / "runs"
    proc = run_training(
        tiny_overrides(corpus, runs, f"deepspeed.zero_stage={stage}", "deepspeed.precision=fp16",
                       "deepspeed.initial_scale_power=24", "deepspeed.hysteresis=1", "train.tokens=16384"),
        entry=FP16_ENTRY, launcher="fork",
    )
    check_ok(proc)
    records = metrics(runs / "cpu_tiny")
    scales = [r["opt/loss_scale"] for r in records]
    assert scales[0] < 2.0**24 and scales[-1] <= scales[0]
    assert records[-1]["opt/skipped_steps"] >= 1
    losses = [r["train/loss"] for r in records]
    assert sum(losses[-4:]) / 4 < 0.8 * sum(losses[:4]) / 4, losses
    applied = [r for r in records if r["opt/grad_norm"] is not None and math.isfinite(r["opt/grad_norm"])]
    assert applied, "no step reported a finite unscaled grad norm"
    assert all(r["opt/grad_norm"] < 100 for r in applied[-5:]), "grad norm is not unscaled"


def test_resume_reproduces_the_uninterrupted_run(corpus, tmp_path):
    """2N steps in one go == N steps, stop, resume N more: identical per-step losses (ZeRO-2)."""
    common = ["deepspeed=zero2", "train.tokens=16384", "checkpoint.interval=0"]
    expected, got, proc = run_whole_and_resumed(corpus, tmp_path, common, stop_at=16)
    full, split = tmp_path / "full", tmp_path / "split"
    assert json.loads((split / "cpu_tiny/checkpoints/step_0000016/ayumi.json").read_text())["step"] == 16
    assert "step_0000016" in proc.stdout
    assert sorted(got) == list(range(1, 33))
    assert [got[s] for s in range(17, 33)] == [expected[s] for s in range(17, 33)]
    val_full = [r for r in read_jsonl(full / "cpu_tiny/metrics.jsonl") if "val/loss" in r][-1]
    val_split = [r for r in read_jsonl(split / "cpu_tiny/metrics.jsonl") if "val/loss" in r][-1]
    assert val_full["val/loss"] == val_split["val/loss"]


def test_zero3_resume_on_another_number_of_ranks_is_exact(corpus, tmp_path):
    """ZeRO-3: 16 steps on 1 rank, then 2 ranks to the end == 2 ranks all the way, loss for loss.

    A ZeRO-3 checkpoint's optimizer state is cut per rank, so it is loaded through DeepSpeed's
    universal form. ZeRO-3 on 1 and on 2 ranks gives identical losses on this job, so anything
    the conversion loses (weights, Adam moments or step, a group's weight decay) shows.
    They do the same arithmetic with bf16 gradient sums: with fp32 ones (the default) the 1-rank
    run's two micro-batches add up unrounded where the 2-rank reduce-scatter rounds to bf16.
    """
    common = ["deepspeed=zero3", "deepspeed.grad_accum_dtype=bf16", "train.tokens=16384", "checkpoint.interval=0"]
    expected, got, proc = run_whole_and_resumed(corpus, tmp_path, common, stop_at=16, first_ranks=1, then_ranks=2)
    assert "re-sharded from 1 ranks to 2 through DeepSpeed's universal checkpoint" in proc.stdout
    split = tmp_path / "split"
    checkpoints = split / "cpu_tiny" / "checkpoints"
    assert not (checkpoints / "universal").exists(), "the converted copy is removed once loaded"
    assert json.loads((checkpoints / "step_0000032" / "ayumi.json").read_text())["world_size"] == 2
    assert sorted(got) == list(range(1, 33))
    assert [got[s] for s in range(17, 33)] == pytest.approx([expected[s] for s in range(17, 33)], rel=1e-6)


def test_zero3_builds_the_model_partitioned_with_the_same_init(tmp_path):
    """deepspeed.zero3_init: no rank ever holds a whole parameter, yet the initial weights (and
    the weight-decay groups) are those of the model built whole from the same seed, and no rank's global
    generator moved (each parameter draws from its own, seeded from the config's seed and its name)."""
    script = str(REPO / "tests" / "pretrain" / "zero3_init_check.py")
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), script, str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    decay, no_decay = results[0]["groups"]
    assert decay > 0 and no_decay > 0
    for rank, result in enumerate(results):
        assert result == dict(rank=rank, partitioned=True, same_init=True, same_decay_split=True,
                              groups=[decay, no_decay], same_generator=True)


def test_zero1_resume_on_fewer_ranks(corpus, tmp_path):
    """ZeRO-1 (the default): 2 ranks to step 16, then 1 rank. The first steps after the resume
    match the 2-rank run exactly (same weights, moments and data); later ones only drift as a
    1-rank run does from a 2-rank one (a different reduction order in bf16)."""
    common = ["deepspeed=zero1", "train.tokens=16384", "checkpoint.interval=0"]
    expected, got, proc = run_whole_and_resumed(corpus, tmp_path, common, stop_at=16, first_ranks=2, then_ranks=1)
    # Why it converted, from the files (ayumi.json's world_size alone decides nothing: test_checkpoint_paths_cpu.py)
    assert ("re-sharded from 2 ranks to 1 through DeepSpeed's universal checkpoint (its folder holds optimizer states "
            "cut for 2 data-parallel rank(s), this run has 1)") in proc.stdout
    assert [got[17], got[18]] == pytest.approx([expected[17], expected[18]], rel=1e-6)
    assert [got[s] for s in range(19, 33)] == pytest.approx([expected[s] for s in range(19, 33)], rel=2e-2)


def test_sigterm_saves_and_resume_continues(corpus, tmp_path):
    """SIGTERM mid-run (as SLURM preemption sends it): every rank finishes the step, saves, exits 0."""
    runs = tmp_path / "runs"
    from pretrain.tools.launch import launcher_command

    cmd = launcher_command("torchrun", 2, tiny_overrides(corpus, runs, "train.tokens=1000000",
                                                        "checkpoint.interval=0"), master_port=free_port())
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    metrics_file = runs / "cpu_tiny" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 5:
            break
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("training never reached step 5: " + (tmp_path / "log.txt").read_text()[-3000:])
    os.killpg(proc.pid, signal.SIGTERM)  # the whole job: launcher and both ranks
    proc.wait(timeout=120)
    log.close()
    output = (tmp_path / "log.txt").read_text()
    assert "stop requested (SIGTERM received)" in output, output[-4000:]
    events = read_jsonl(runs / "cpu_tiny" / "events.jsonl")
    stop = [e for e in events if e["event"] == "signal_stop"]
    assert len(stop) == 1
    saved_step = stop[0]["step"]
    ckpt = runs / "cpu_tiny" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == f"step_{saved_step:07d}"
    # torchrun's agent reports its own SIGTERM with a traceback; no rank may fail in ayumi's code.
    assert f'File "{REPO / "pretrain"}' not in output, output[-4000:]
    resumed = run_training(tiny_overrides(corpus, runs, "train.tokens=1000000", "checkpoint.interval=0",
                                          f"train.max_steps={saved_step + 3}"), launcher="fork")
    check_ok(resumed)
    steps = sorted(train_losses(runs / "cpu_tiny"))
    assert steps == list(range(1, saved_step + 4))


def test_sigterm_single_process_exits_zero(corpus, tmp_path):
    """Without a launcher in between, the exit status after SIGTERM is exactly 0."""
    runs = tmp_path / "runs"
    cmd = [str(Path(os.sys.executable)), "-m", "pretrain.train",
           *tiny_overrides(corpus, runs, "train.tokens=1000000", "checkpoint.interval=0")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics_file = runs / "cpu_tiny" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-4000:]
    assert "(signal" in out


def test_deepspeed_launcher_with_hydra_and_wandb_offline(corpus, tmp_path):
    """As users launch it: `deepspeed --num_gpus 2 --module pretrain.train ...` (its --local_rank
    flag included), ZeRO-1, W&B offline; the run dir holds config, metrics and the W&B run."""
    runs = tmp_path / "runs"
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(free_port()), "--module", "pretrain.train",
           "experiment=cpu_tiny", f"data.root={corpus}", f"run_root={runs}", "deepspeed=zero1",
           "train.tokens=8192", "logging=wandb_offline"]
    cmd[0] = str(Path(os.sys.executable).parent / "deepspeed")
    proc = subprocess.run(cmd, cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    check_ok(proc)
    run_dir = runs / "cpu_tiny"
    config = (run_dir / "config.yaml").read_text()
    assert "zero_stage: 1" in config and f"root: {corpus}" in config
    assert json.loads((run_dir / "deepspeed_config.json").read_text())["zero_optimization"]["stage"] == 1
    assert len(metrics(run_dir)) == 16
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert offline[0].name.endswith(run_id)
    wandb_files = list(offline[0].glob("*.wandb"))
    assert wandb_files and wandb_files[0].stat().st_size > 0
    # The history reached W&B: the offline record holds the metric names.
    assert b"train/loss" in wandb_files[0].read_bytes()


def test_batch_arithmetic_error_is_reported(corpus, tmp_path):
    proc = run_training(tiny_overrides(corpus, tmp_path, "train.global_batch_size=10"))
    assert proc.returncode != 0
    assert "train.global_batch_size=10 is not a multiple of train.micro_batch_size=4 x 2" in proc.stdout


def test_zero3_checkpoint_exports_to_transformers(corpus, tmp_path):
    """fp32 ZeRO-3 on 2 ranks -> `ayumi export hf RUN_DIR/checkpoints OUT` -> transformers reproduces the
    run's own final validation loss (so the partitioned weights were gathered correctly)."""
    import numpy as np
    import torch
    import transformers

    from data.packed import PackedSamples

    runs = tmp_path / "runs"
    check_ok(run_training(tiny_overrides(corpus, runs, "deepspeed=zero3", "deepspeed.precision=fp32",
                                         "train.tokens=8192"), launcher="fork"))
    run_dir = runs / "cpu_tiny"
    out = tmp_path / "hf"
    proc = subprocess.run([str(Path(os.sys.executable).parent / "ayumi"), "export", "hf", str(run_dir / "checkpoints"),
                           str(out)], cwd=REPO, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    check_ok(proc)
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    model = transformers.LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    logged = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "val/ja/loss" in r][-1]
    for domain in ("ja", "en"):
        samples = PackedSamples.from_directory(corpus / domain / "val", 64)
        count = min(16, len(samples))
        tokens = torch.from_numpy(np.stack([samples.sample(i) for i in range(count)]).astype(np.int64))
        with torch.no_grad():
            logits = model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        assert float(loss) == pytest.approx(logged[f"val/{domain}/loss"], abs=1e-4)


HOOK_ENTRY = str(REPO / "tests" / "pretrain" / "hook_train.py")


def test_a_step_hook_is_called_every_step_on_every_rank_and_its_metrics_are_logged(corpus, tmp_path):
    """The seam a new per-step concern plugs into (pretrain/hooks.py): a hook appended to the trainer
    `build_trainer` returns sees before_update then after_step for each of the 12 steps, on both ranks, with the
    step numbers and tokens the metrics use, and what it adds to report.metrics reaches metrics.jsonl."""
    runs = tmp_path / "runs"
    check_ok(run_training(tiny_overrides(corpus, runs, "train.tokens=6144", "deepspeed.precision=fp32"),
                          entry=HOOK_ENTRY, launcher="fork"))
    run_dir = runs / "cpu_tiny"
    expected = []
    for index in range(12):
        expected += [["before_update", index], ["after_step", index, index + 1, (index + 1) * 8 * 64, True]]
    for rank in (0, 1):
        assert json.loads((run_dir / f"hook_calls_rank{rank}.json").read_text()) == expected
    logged = {r["step"]: r["test/hook_calls"] for r in metrics(run_dir)}
    assert logged == {step: 2 * step for step in range(1, 13)}
