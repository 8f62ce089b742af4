"""A run whose newest checkpoint is damaged, as its user meets it (issue 39, papercut 6): one real 1-rank run on CPU
saves steps 4 and 8, then step 8 is damaged.

- `ayumi export hf` refuses step 8 and names the newest older checkpoint that verifies with the command that
  exports it; that command, run as printed, exports;
- a resume sets step 8 aside and logs `checkpoint_corrupt` at step 8 (the damaged checkpoint's own), not at
  step 4 (where the run resumed: `logged_at_step`, by which a later resume cuts events.jsonl back).

The intact run also serves issue 48's export papercut: `ayumi export hf` of a real checkpoint writes with the umask.
"""
from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.metrics import truncate_jsonl
from tests.helpers import REPO, cpu_env, read_jsonl, run_training, tiny_overrides

pytestmark = pytest.mark.slow

COMMON = ["train.eval_interval=0", "deepspeed.precision=fp32", "checkpoint.interval=4", "checkpoint.keep_last=0"]
MODEL = "mp_rank_00_model_states.pt"


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory) -> Path:
    """The root of an 8-step run with checkpoints 4 and 8 (kept intact: each test damages a copy)."""
    root = tmp_path_factory.mktemp("runs")
    proc = run_training(tiny_overrides(corpus, root, *COMMON, "train.max_steps=8"), nproc=1, launcher="fork")
    assert proc.returncode == 0, proc.stdout[-4000:]
    return root


def damaged_copy(trained: Path, tmp_path: Path) -> Path:
    """A copy of the run root whose step-8 model file has bytes flipped in the middle."""
    root = Path(shutil.copytree(trained, tmp_path / "runs"))
    damage(root / "cpu_tiny" / "checkpoints" / "step_0000008" / MODEL)
    return root


def damage(path: Path) -> None:
    """Flip 8 bytes in the middle of a file (its size stays: only the checksum can tell)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 8] = bytes(255 - b for b in data[middle:middle + 8])
    path.write_bytes(bytes(data))


def ayumi(*args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    """`ayumi ARGS` through the real entry, in its own process (under `umask` when given, as a shell sets it)."""
    start = None if umask is None else (lambda: os.umask(umask))
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300, preexec_fn=start)


def test_export_is_readable_by_others_under_umask_022_and_private_under_077(trained, tmp_path):
    """Issue 48, papercut: the export was 0700 with a 0600 model.safetensors whatever the umask."""
    checkpoint = trained / "cpu_tiny" / "checkpoints" / "step_0000008"
    for mask, folder_mode, file_mode in ((0o022, 0o755, 0o644), (0o077, 0o700, 0o600)):
        out = tmp_path / f"hf_{mask:03o}"
        done = ayumi("export", "hf", str(checkpoint), str(out), umask=mask)
        assert done.returncode == 0, done.stderr
        assert stat.S_IMODE(out.stat().st_mode) == folder_mode
        files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
        assert "model.safetensors" in files and "config.json" in files
        assert files == dict.fromkeys(files, file_mode), (oct(mask), files)


def test_export_of_a_damaged_newest_checkpoint_names_the_older_intact_one_and_its_command(trained, tmp_path):
    run = damaged_copy(trained, tmp_path) / "cpu_tiny"
    ckpts = run / "checkpoints"
    refused = ayumi("export", "hf", str(run), str(tmp_path / "hf"))
    assert refused.returncode == 2, refused.stderr
    [line] = refused.stderr.strip().splitlines()
    command = f"ayumi export hf {ckpts / 'step_0000004'} {tmp_path / 'hf'}"
    assert line == (f"ayumi export hf: checkpoint {ckpts / 'step_0000008'} is damaged: {MODEL} does not match the "
                    f"xxh3_128 checksum recorded at save. Fix: export the newest older checkpoint that verifies, "
                    f"step_0000004: {command}")
    assert not (tmp_path / "hf").exists()
    exported = ayumi(*shlex.split(command)[1:])  # the command as printed
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()
    # With step 4 damaged too, nothing older is intact: the refusal says so and how to look.
    damage(ckpts / "step_0000004" / MODEL)
    none_left = ayumi("export", "hf", str(run), str(tmp_path / "hf2"))
    assert none_left.returncode == 2 and none_left.stderr.strip().endswith(
        f"Fix: no older checkpoint beside it is intact; put an intact copy back, or list what verifies with "
        f"`ayumi checkpoint verify {ckpts}`"), none_left.stderr


def test_a_damaged_checkpoint_is_logged_at_its_own_step(trained, corpus, tmp_path):
    root = damaged_copy(trained, tmp_path)
    run = root / "cpu_tiny"
    proc = run_training(tiny_overrides(corpus, root, *COMMON, "train.max_steps=10"), nproc=1, launcher="fork")
    assert proc.returncode == 0, proc.stdout[-4000:]
    [corrupt] = [event for event in read_jsonl(run / "events.jsonl") if event["event"] == "checkpoint_corrupt"]
    assert corrupt["step"] == 8 and corrupt["logged_at_step"] == 4
    assert corrupt["checkpoint"] == str(run / "checkpoints" / "step_0000008")
    assert "[event] checkpoint_corrupt at step 8 (logged at step 4, " in proc.stdout
    assert "checkpoint_corrupt at step 4" not in proc.stdout
    # A later resume from step 4 cuts the logs back to it: the event, written there, stays.
    truncate_jsonl(run / "events.jsonl", 4)
    assert [e["event"] for e in read_jsonl(run / "events.jsonl")].count("checkpoint_corrupt") == 1
