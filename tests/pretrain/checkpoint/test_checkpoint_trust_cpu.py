"""Checkpoints verified before use, in real 2-rank runs on CPU (torchrun, and `ayumi train` where the exit status
matters).

One short run per ZeRO stage writes a few checkpoints (module fixtures, made once); each case damages a copy of
its run dir the way disks and people do (overwritten bytes in the middle of a file, a flipped byte, NaN in a weight
of a checkpoint saved before checksums), then resumes:

- ZeRO 0: the newest checkpoint's model file damaged, the next one's weights non-finite (no checksums to catch it):
  both set aside, the run resumes from the third with exactly the losses the uninterrupted run had after it
  (a clean resume from that checkpoint gives those: tests/pretrain/test_train_cpu.py), and keep_last never leaves
  a damaged checkpoint as the only one;
- ZeRO 1: an optimizer shard damaged and checkpoint.on_corrupt=refuse: `ayumi train` exits 2 with one line;
- ZeRO 2: a rollback ring checkpoint (a per-rank RNG file) damaged: the rollback verifies it and takes an older one;
- ZeRO 3 (background writes): the shared trainer state damaged, then a divergence right after the fallback resume:
  the stop blames the checkpoint, saves nothing, and `latest` still names the checkpoint resumed from.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint import integrity
from pretrain.checkpoint.checkpointer import complete_tags
from pretrain.checkpoint.integrity import VERIFIED, verify
from pretrain.tools.cli import main
from tests.helpers import read_jsonl, run_training, tiny_overrides, train_losses
from tests.pretrain.tools.test_train_exit_status import ayumi, ranks_said

pytestmark = pytest.mark.slow

COMMON = ["train.eval_interval=0", "deepspeed.precision=fp32", "checkpoint.keep_last=3"]
# A detector that judges from the first steps (the default waits 100), and a recovery scaled to 24-step runs.
QUICK_DETECTOR = ["stability.detector.warmup_steps=4", "stability.detector.min_history=4"]
RING = ["stability.recovery.ring_interval=4", "stability.recovery.rollback_steps=10",
        "stability.recovery.skip_batches=4", "stability.recovery.lr_cooldown_steps=8"]
BASE = {  # each stage's run: checkpoints every 8 steps (ZeRO 2: the ring's every 4 in between)
    0: ["deepspeed=zero0", "train.max_steps=24", "checkpoint.interval=8"],
    1: ["deepspeed=zero1", "train.max_steps=24", "checkpoint.interval=8"],
    2: ["deepspeed=zero2", "train.max_steps=24", "checkpoint.interval=8", *RING],
    3: ["deepspeed=zero3", "train.max_steps=24", "checkpoint.interval=8", "checkpoint.async_save=true"],
}
MODEL = "mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def base_run(corpus, tmp_path_factory):
    """stage -> the run root of that stage's base run, trained on first use and kept for the module."""
    made: dict[int, Path] = {}

    def get(stage: int) -> Path:
        if stage not in made:
            root = tmp_path_factory.mktemp(f"zero{stage}")
            proc = run_training(tiny_overrides(corpus, root, *COMMON, *BASE[stage]), launcher="fork")
            assert proc.returncode == 0, proc.stdout[-6000:]
            made[stage] = root
        return made[stage]
    return get


def copy_of(base_root: Path, tmp_path: Path) -> Path:
    """A copy of a base run's root to damage (the base stays intact for the other cases)."""
    return Path(shutil.copytree(base_root, tmp_path / "runs"))


def overwrite_runs(path: Path, runs: int = 32, length: int = 8) -> None:
    """What the issue's user did: overwrite short runs of bytes in the middle of the file."""
    data = bytearray(path.read_bytes())
    start = len(data) // 3
    for i in range(runs):
        offset = start + i * (len(data) // (3 * runs))
        data[offset:offset + length] = bytes(255 - b for b in data[offset:offset + length])
    path.write_bytes(bytes(data))


def without_checksums(tag_dir: Path) -> None:
    """Make a checkpoint look like one saved before checksums were recorded."""
    meta = json.loads((tag_dir / "ayumi.json").read_text())
    del meta[integrity.RECORD_KEY]
    (tag_dir / "ayumi.json").write_text(json.dumps(meta))


def events(run_dir: Path, kind: str) -> list[dict]:
    return [event for event in read_jsonl(run_dir / "events.jsonl") if event["event"] == kind]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpoint_verify_finds_every_file_of_every_checkpoint_recorded_at_each_zero_stage(base_run, stage, capsys):
    """Each rank's files (DeepSpeed's shards, its RNG file) and rank 0's are in ayumi.json's record, the ring's too,
    synchronous saves and background ones (ZeRO 3) alike; `ayumi checkpoint verify` passes the run."""
    run = base_run(stage) / "cpu_tiny"
    assert main(["checkpoint", "verify", str(run)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out[1:-1]]
    folders = [run / row[0] for row in rows]
    ring = [f"checkpoints/recovery/step_{s:07d}" for s in (4, 12, 20)] if stage == 2 else []
    assert sorted(row[0] for row in rows) == sorted([f"checkpoints/step_{s:07d}" for s in (8, 16, 24)] + ring)
    assert all(row[-1] == "verified" for row in rows), out
    for folder in folders:
        recorded = json.loads((folder / "ayumi.json").read_text())[integrity.RECORD_KEY]["files"]
        on_disk = sorted(p.name for p in folder.iterdir() if p.name != "ayumi.json" and not p.name.startswith("."))
        assert sorted(recorded) == on_disk, folder
        assert {"ayumi_rank00000.pt", "ayumi_rank00001.pt", "ayumi_state.pt"} <= set(recorded)
        if stage:
            assert {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" for rank in (0, 1)} <= set(recorded)


def test_zero0_damaged_files_and_a_bad_state_fall_back_and_the_resume_is_exact(base_run, tmp_path, corpus):
    runs = copy_of(base_run(0), tmp_path)
    run = runs / "cpu_tiny"
    ckpts = run / "checkpoints"
    expected = train_losses(run)
    overwrite_runs(ckpts / "step_0000024" / MODEL)
    state = torch.load(ckpts / "step_0000016" / MODEL, weights_only=True)
    state["module"]["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    torch.save(state, ckpts / "step_0000016" / MODEL)
    without_checksums(ckpts / "step_0000016")  # its damage is no checksum's to find: the state check finds it
    without_checksums(ckpts / "step_0000008")  # loads, with a notice

    proc = run_training(tiny_overrides(corpus, runs, *COMMON, *BASE[0], "train.max_steps=32"), launcher="fork")
    assert proc.returncode == 0, proc.stdout[-6000:]
    corrupt = events(run, "checkpoint_corrupt")
    assert [Path(event["checkpoint"]).name for event in corrupt] == ["step_0000024", "step_0000016"]
    assert corrupt[0]["problem"] == f"{MODEL} does not match the xxh3_128 checksum recorded at save"
    assert corrupt[1]["problem"] == ("the state it loads cannot be trained from: weight model.layers.0.mlp.up_proj.weight "
                                     "holds non-finite values")
    assert corrupt[0]["message"] == (f"checkpoint {ckpts / 'step_0000024'} is damaged: {corrupt[0]['problem']}; set "
                                     "aside as step_0000024.corrupt (kept, never loaded again)")
    assert f"note: {ckpts / 'step_0000008'} records no checksums" in proc.stdout
    assert f"resumed from {ckpts / 'step_0000008'} at step 8" in proc.stdout
    got = train_losses(run)
    assert sorted(got) == list(range(1, 33))  # the metrics were cut back to step 8, not 24
    assert [got[step] for step in range(9, 25)] == [expected[step] for step in range(9, 25)]
    # The damaged folders are kept aside; keep_last=3 kept three checkpoints that verify, the newest `latest`.
    assert sorted(p.name for p in ckpts.glob("*.corrupt")) == ["step_0000016.corrupt", "step_0000024.corrupt"]
    assert complete_tags(ckpts) == ["step_0000016", "step_0000024", "step_0000032"]
    assert all(verify(ckpts / tag).status == VERIFIED for tag in complete_tags(ckpts))
    assert (ckpts / "latest").read_text().strip() == "step_0000032"


def test_zero1_refuse_exits_2_in_one_line_before_any_rank_trains(base_run, tmp_path, corpus):
    runs = copy_of(base_run(1), tmp_path)
    ckpts = runs / "cpu_tiny" / "checkpoints"
    shard = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    overwrite_runs(ckpts / "step_0000024" / shard, runs=4)
    metrics_before = (runs / "cpu_tiny" / "metrics.jsonl").read_text()
    proc = ayumi("train", *tiny_overrides(corpus, runs, *COMMON, *BASE[1], "train.max_steps=32",
                                          "checkpoint.on_corrupt=refuse"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    [line] = ranks_said(proc.stderr)
    assert line == (f"checkpoint {ckpts / 'step_0000024'} is damaged: {shard} does not match the xxh3_128 checksum "
                    "recorded at save. Fix: resume from the newest checkpoint that verifies with "
                    "checkpoint.on_corrupt=fallback (it sets this one aside), or name one with checkpoint.load_from "
                    "(`ayumi checkpoint verify RUN_DIR` lists which verify)")
    assert proc.stderr.rstrip("\n").splitlines()[-1] == f"ayumi train: {line}"
    assert complete_tags(ckpts) == ["step_0000008", "step_0000016", "step_0000024"] and not list(ckpts.glob("*.corrupt"))
    assert (runs / "cpu_tiny" / "metrics.jsonl").read_text() == metrics_before  # no rank trained a step


def test_zero2_a_rollback_verifies_its_ring_checkpoint_and_takes_an_older_one(base_run, tmp_path, corpus):
    runs = copy_of(base_run(2), tmp_path)
    run = runs / "cpu_tiny"
    ring = run / "checkpoints" / "recovery"
    assert complete_tags(ring) == ["step_0000004", "step_0000012", "step_0000020"]
    overwrite_runs(ring / "step_0000012" / "ayumi_rank00001.pt", runs=2)
    spike = "+stability.inject.lr_multiply={24:50.0,25:50.0,26:50.0}"  # right after the resume at 24
    proc = run_training(tiny_overrides(corpus, runs, *COMMON, *BASE[2], *QUICK_DETECTOR, spike, "train.max_steps=30"), launcher="fork")
    assert proc.returncode == 0, proc.stdout[-6000:]
    [rollback] = events(run, "rollback")
    assert rollback["to_step"] == 12  # the newest checkpoint >= 10 steps before the spike: the damaged ring one
    [corrupt] = events(run, "checkpoint_corrupt")
    assert corrupt["checkpoint"] == str(ring / "step_0000012")
    assert corrupt["problem"] == "ayumi_rank00001.pt does not match the xxh3_128 checksum recorded at save"
    [recovered] = events(run, "recovered")
    assert recovered["to_step"] == 8  # the newest older checkpoint that verifies (a long-term one)
    # Kept aside; the step_0000012 there now is the replay's own ring checkpoint, written after the rollback.
    assert (ring / "step_0000012.corrupt").is_dir() and verify(ring / "step_0000012").status == VERIFIED


def test_zero3_a_divergence_right_after_a_fallback_resume_saves_nothing_and_blames_the_checkpoint(base_run, tmp_path,
                                                                                                  corpus):
    runs = copy_of(base_run(3), tmp_path)
    run = runs / "cpu_tiny"
    ckpts = run / "checkpoints"
    expected = train_losses(run)
    overwrite_runs(ckpts / "step_0000024" / "ayumi_state.pt", runs=1, length=1)
    spike = "+stability.inject.lr_multiply={16:50.0,17:50.0,18:50.0}"  # at once after the resume from 16
    proc = run_training(tiny_overrides(corpus, runs, *COMMON, *BASE[3], *QUICK_DETECTOR, spike,
                                       "stability.action=stop", "checkpoint.interval=2", "train.max_steps=32"))
    assert proc.returncode == 1 and "exitcode  : 3" in proc.stdout, proc.stdout[-3000:]  # torchrun: the ranks' 3
    assert Path(events(run, "checkpoint_corrupt")[0]["checkpoint"]).name == "step_0000024"
    assert train_losses(run)[17] == expected[17]  # the resume from 16 is exact up to the injected fault
    [stop] = events(run, "stop")
    assert (f"after resuming from {ckpts / 'step_0000016'}: that checkpoint is the likely cause, not the data or the "
            "settings. Nothing was saved from this state") in stop["message"]
    assert f"check it (`ayumi checkpoint verify {ckpts / 'step_0000016'}`)" in stop["message"]
    assert "saved checkpoint" in proc.stdout or "staged; writing in the background" in proc.stdout  # step 18's save
    # Nothing of the diverged state is kept: step 18's checkpoint is gone, `latest` names the one resumed from.
    assert complete_tags(ckpts) == ["step_0000008", "step_0000016"]
    assert (ckpts / "latest").read_text().strip() == "step_0000016"
    assert (ckpts / "step_0000024.corrupt").is_dir()
