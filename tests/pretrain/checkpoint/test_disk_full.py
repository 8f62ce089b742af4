"""A real full disk during a checkpoint: a small tmpfs as checkpoint.dir, filled the way another job fills a
disk. The run stops with one line naming the disk and the fix, leaves no partial files, keeps the last good
checkpoint as `latest`, and resumes from it once there is room. Needs permission to mount a tmpfs (root, as
on the CI machines); skipped with the reason otherwise."""
from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.checkpointer import Checkpointer, CheckpointWriteFailed
from tests.helpers import REPO, cpu_env, run_training, tiny_overrides, write_tiny_corpus


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs, unmounted afterwards."""
    mount = tmp_path / f"disk_{uuid.uuid4().hex[:6]}"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24M", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): a real full disk needs it")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def fill(disk: Path) -> None:
    subprocess.run(["dd", "if=/dev/zero", f"of={disk / 'filler'}", "bs=64k"], capture_output=True)


def leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp" in p.name or p.stat().st_size == 0)


@pytest.mark.slow
@pytest.mark.parametrize("async_save, through", [("false", "ayumi train"), ("true", "torchrun")])
def test_a_disk_that_fills_during_the_run_stops_it_cleanly_and_it_resumes(small_disk, tmp_path, async_save, through):
    """Both save modes check for room before anything is staged or written, so both refuse alike here; a write
    that fails in the background is the in-process test below. One runs under `ayumi train` (what a user types:
    it exits 2, not torchrun's 1, and repeats the ranks' line last), the other under a raw torchrun (what a
    scheduler's script runs)."""
    corpus = write_tiny_corpus(tmp_path / "corpus")
    runs, ckpt = tmp_path / "runs", small_disk / "ckpt"
    # fp32 pinned: the message names the checkpoint's size, which `auto` would make depend on the CPU's bf16.
    overrides = tiny_overrides(corpus, runs, "train.tokens=1000000", "checkpoint.interval=20", f"checkpoint.dir={ckpt}",
                               f"checkpoint.async_save={async_save}", "deepspeed.precision=fp32")
    from pretrain.tools.launch import launcher_command

    cmd = ([sys.executable, "-m", "pretrain.tools.cli", "train", *overrides] if through == "ayumi train"
           else launcher_command("torchrun", 2, overrides))
    log = open(tmp_path / "log", "w")
    job = subprocess.Popen(cmd, cwd=REPO, env=cpu_env(), stdout=log, stderr=subprocess.STDOUT)
    latest = ckpt / "latest"
    deadline = time.time() + 180
    # Filled as soon as the step-20 save is published, so the step-40 save finds the disk full with 20 steps to
    # spare (waiting for metrics lines left a few steps, and on a loaded machine the job reached step 40 first).
    while not (latest.exists() and latest.read_text().strip() == "step_0000020"):
        assert time.time() < deadline and job.poll() is None, (tmp_path / "log").read_text()[-3000:]
        time.sleep(0.05)
    fill(small_disk)
    status = job.wait(timeout=180)
    log.close()
    output = (tmp_path / "log").read_text()
    lines = [line for line in output.splitlines() if line.startswith("pretrain.train:")]
    assert lines == [f"pretrain.train: the disk at {ckpt} is full: 0 B free, a checkpoint of this run needs about "
                     f"1.8 MiB; nothing of step 40 was kept and {ckpt / 'step_0000020'} is the last good checkpoint. "
                     "Fix: free space there (old runs, other files) or point checkpoint.dir at a larger disk, then "
                     "start the job again: it resumes from step_0000020"], output[-3000:]
    if through == "ayumi train":
        assert status == 2 and output.rstrip("\n").splitlines()[-1] == "ayumi train: " + lines[0].split(": ", 1)[1]
    else:
        assert status == 1  # torchrun's own report of any failed child
    assert "Traceback (most recent call last):\n  File \"" + str(REPO / "pretrain") not in output
    assert (ckpt / "latest").read_text().strip() == "step_0000020"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_0000020"] and leftovers(ckpt) == []
    (small_disk / "filler").unlink()
    resumed = run_training(tiny_overrides(corpus, runs, "train.tokens=1000000", "checkpoint.interval=20",
                                          f"checkpoint.dir={ckpt}", "train.max_steps=22"), launcher="fork")
    assert resumed.returncode == 0, resumed.stdout[-3000:]
    assert (ckpt / "latest").read_text().strip() == "step_0000022"  # it went on from step 20


class _Engine:
    """Writes a DeepSpeed-sized file with torch's own C++ writer, as the engine's save does (or hands
    it to the staging collector of an asynchronous save, as DeepSpeed's checkpoint engine call does)."""

    def save(self, root: Path, tag: str, client_state: dict, collector=None) -> None:
        (root / tag).mkdir(parents=True, exist_ok=True)
        state, path = {"module": torch.zeros(4 * 2**20)}, root / tag / "mp_rank_00_model_states.pt"  # 16 MiB
        if collector is not None:
            collector.save(state, str(path))
        else:
            torch.save(state, path)


def test_a_disk_that_fills_mid_write_keeps_the_last_checkpoint_and_no_partial_files(small_disk):
    """The room check passed (another writer filled the disk during the save): torch's writer fails, the
    rank removes what it wrote and says the disk is full, and `latest` still names the previous checkpoint."""
    root = small_disk / "ckpt"
    saver = Checkpointer(root, keep_last=3, rank=0, barrier=lambda: None, expected_bytes=1)
    saver.save(_Engine(), 10, {"step": 10}, {})  # 16 MiB of 24
    with pytest.raises(CheckpointWriteFailed) as refused:
        saver.save(_Engine(), 20, {"step": 20}, {})
    message = str(refused.value)
    assert message.startswith(f"the disk at {root} is full (") and "while saving step 20 on rank 0" in message
    assert f"{root / 'step_0000010'} is the last good checkpoint" in message
    assert (root / "latest").read_text().strip() == "step_0000010"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000010"] and leftovers(root) == []


def test_a_disk_that_fills_during_an_async_write_fails_at_the_wait_and_keeps_the_last_checkpoint(small_disk):
    """checkpoint.async_save: the save returns (staged), the background write hits the full disk, and
    the next agreement (the wait a later save or a drain does) raises the same one-line error."""
    root = small_disk / "ckpt"
    saver = Checkpointer(root, keep_last=3, rank=0, barrier=lambda: None, expected_bytes=1, async_writes=True)
    saver.save(_Engine(), 10, {"step": 10}, {})
    assert saver.wait() == root / "step_0000010"  # 16 MiB of 24, published
    saver.save(_Engine(), 20, {"step": 20}, {})  # staged: nothing has failed yet
    with pytest.raises(CheckpointWriteFailed) as refused:
        saver.wait()
    message = str(refused.value)
    assert message.startswith(f"the disk at {root} is full (") and "while saving step 20 on rank 0" in message
    assert f"{root / 'step_0000010'} is the last good checkpoint" in message
    assert (root / "latest").read_text().strip() == "step_0000010"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000010"] and leftovers(root) == []
