"""Asynchronous checkpoints (checkpoint.async_save=true) in real 2-rank runs on CPU.

Resume from a checkpoint written in the background is exact; a kill -9 of the whole job while a
write is in flight leaves the previous `latest` valid and the resume exact from it; a spike
rollback with async writes behaves as with synchronous ones.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers import REPO, cpu_env, read_jsonl, run_training, run_whole_and_resumed, tiny_overrides, \
    train_losses

pytestmark = pytest.mark.slow

ASYNC = "checkpoint.async_save=true"


@pytest.mark.parametrize("stage", [0, 3])
def test_resume_from_async_checkpoints_is_exact(corpus, tmp_path, stage):
    """Saves every 4 steps written in the background (each waits for the previous one), stop at 16,
    resume: losses equal the uninterrupted run's; every folder is complete and published."""
    common = [f"deepspeed=zero{stage}", "train.tokens=16384", "checkpoint.interval=4", "checkpoint.keep_last=2", ASYNC]
    expected, got, proc = run_whole_and_resumed(corpus, tmp_path, common, stop_at=16)
    assert "writing in the background" in proc.stdout
    checkpoints = tmp_path / "split" / "cpu_tiny" / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_0000032"
    folders = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_"))
    assert folders == ["step_0000028", "step_0000032"], folders  # keep_last=2, pruned after each wait
    for folder in folders:
        assert json.loads((checkpoints / folder / "ayumi.json").read_text())["tag"] == folder
        assert not list((checkpoints / folder).glob(".written_rank*")), "markers are removed once published"
    assert sorted(got) == list(range(1, 33))
    assert [got[s] for s in range(17, 33)] == [expected[s] for s in range(17, 33)]


def test_kill_9_during_an_async_write_resumes_from_the_previous_checkpoint(corpus, tmp_path):
    """`ayumi train` (torchrun, 2 ranks, ZeRO-3), saves every 4 steps, each background write held
    back 4 s: once step 8 is staged and step 4 is published, kill -9 the launcher and both ranks.
    step_0000008 is incomplete, `latest` names step 4, and the resume gives the uninterrupted losses."""
    runs = tmp_path / "runs"
    common = ["deepspeed=zero3", "train.tokens=1000000", "checkpoint.interval=4", ASYNC]
    overrides = tiny_overrides(corpus, runs, *common, "checkpoint.inject_write_delay_s=4")
    checkpoints = runs / "cpu_tiny" / "checkpoints"
    log = open(tmp_path / "job.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pretrain.tools.cli", "train", *overrides], cwd=REPO, env=cpu_env(),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    try:
        while time.time() < deadline:
            latest = checkpoints / "latest"
            if (checkpoints / "step_0000008").is_dir() and latest.is_file() and \
                    latest.read_text().strip() == "step_0000004":
                break
            assert proc.poll() is None, (tmp_path / "job.log").read_text()[-4000:]
            time.sleep(0.05)
        else:
            pytest.fail("step 8 was never staged after step 4 was published: "
                        + (tmp_path / "job.log").read_text()[-4000:])
    finally:  # kill -9 of the launcher and both ranks (which run in sessions of their own), mid-write
        job = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for process in job:
            process.kill()
        proc.wait()
        _, alive = psutil.wait_procs(job, timeout=30)
        assert alive == []
    assert not (checkpoints / "step_0000008" / "ayumi.json").exists()
    assert (checkpoints / "latest").read_text().strip() == "step_0000004"

    resumed = run_training(tiny_overrides(corpus, runs, *common, "train.max_steps=10"), launcher="fork")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "resumed from" in resumed.stdout and "step_0000004" in resumed.stdout
    whole_runs = tmp_path / "whole"
    whole = run_training(tiny_overrides(corpus, whole_runs, *common, "train.max_steps=10"), launcher="fork")
    assert whole.returncode == 0, whole.stdout[-4000:]
    got, expected = train_losses(runs / "cpu_tiny"), train_losses(whole_runs / "cpu_tiny")
    assert [got[s] for s in range(5, 11)] == [expected[s] for s in range(5, 11)]
    assert (checkpoints / "latest").read_text().strip() == "step_0000010"  # the final save, drained at the end


def test_spike_rollback_with_async_writes_matches_synchronous(corpus, tmp_path):
    """The recovery ring written in the background: the spike at 150 rolls back to the same ring
    checkpoint, and every loss before and after equals a run with synchronous saves."""
    from tests.pretrain.stability.test_stability_cpu import SPIKE_AT_150, STABILITY

    runs = {}
    for mode in ("false", "true"):
        root = tmp_path / mode
        proc = run_training(tiny_overrides(corpus, root, "deepspeed=zero2", *STABILITY, SPIKE_AT_150,
                                           "train.max_steps=180", f"checkpoint.async_save={mode}"), launcher="fork")
        assert proc.returncode == 0, proc.stdout[-6000:]
        runs[mode] = root / "cpu_tiny"
    recovered = {mode: [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "recovered"]
                 for mode, run in runs.items()}
    assert len(recovered["true"]) == 1
    assert recovered["true"][0]["to_step"] == recovered["false"][0]["to_step"]
    assert train_losses(runs["true"]) == train_losses(runs["false"])
    ring = runs["true"] / "checkpoints" / "recovery"
    assert all((p / "ayumi.json").is_file() for p in ring.iterdir() if p.name.startswith("step_"))


def test_sigterm_with_async_writes_drains_before_exit_and_resumes_exactly(corpus, tmp_path):
    """SIGTERM to `ayumi train` with async saves: the stop's checkpoint is written and published before the
    ranks exit 0 (the end of the run drains), and the resume is exact."""
    from tests.pretrain.job.test_signals import assert_resumes_exactly, saved_stop, start_and_wait

    runs = tmp_path / "runs"
    overrides = tiny_overrides(corpus, runs, "train.tokens=1000000", "checkpoint.interval=0", ASYNC,
                               "checkpoint.inject_write_delay_s=2")
    proc, ranks, log = start_and_wait("ayumi", overrides, runs / "cpu_tiny", tmp_path / "log")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, (tmp_path / "log").read_text()[-3000:]
    log.close()
    assert "writing in the background" in (tmp_path / "log").read_text()
    saved = saved_stop(runs / "cpu_tiny")  # latest names the stop's step: published before exit
    assert not list((runs / "cpu_tiny" / "checkpoints").glob("step_*/.written_rank*"))
    assert_resumes_exactly(corpus, runs, tmp_path, saved)
