"""Checkpoint folder mechanics without DeepSpeed: completeness marker, `latest`, pruning."""
import json

import pytest
import torch

from pretrain.checkpoint.checkpointer import (
    LATEST, META, CheckpointError, Checkpointer, CheckpointWriteFailed, complete_tags, latest_tag,
    resolve_checkpoint, tag_for,
)


class FakeEngine:
    """Writes a file where DeepSpeed would write its shards (the mechanism under test is ayumi's)."""

    def __init__(self, fail=False, error=None, shards=0):
        self.fail = fail
        self.error = error or OSError("No space left on device")
        self.shards = shards
        """ZeRO optimizer shards to write, as that many data-parallel ranks would (their names say the layout)."""

    def save(self, root, tag, client_state, collector=None):
        (root / tag).mkdir(parents=True, exist_ok=True)
        torch.save({"module": {}}, root / tag / "mp_rank_00_model_states.pt")  # written directly: rank 0 hashes it
        for rank in range(self.shards):
            torch.save({"optimizer_state_dict": {"param_slice_mappings": [{}]}},
                       root / tag / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        if self.fail:
            raise self.error


class LoadingEngine(FakeEngine):
    """Also records loads, as (tag, universal)."""

    def __init__(self):
        super().__init__()
        self.loads = []

    def load(self, root, tag, universal=False):
        self.loads.append((tag, universal))

    def own_names(self):
        return set()


def make(tmp_path, keep=2):
    return Checkpointer(tmp_path / "checkpoints", keep_last=keep, rank=0, barrier=lambda: None)


def test_save_marks_complete_and_points_latest(tmp_path):
    ckpt = make(tmp_path)
    path = ckpt.save(FakeEngine(), 10, {"train": {}}, {"model": {}})
    assert (path / META).exists() and json.loads((path / META).read_text())["step"] == 10
    assert (tmp_path / "checkpoints" / LATEST).read_text().strip() == tag_for(10)
    assert resolve_checkpoint(tmp_path / "checkpoints") == (tmp_path / "checkpoints", tag_for(10))
    assert resolve_checkpoint(tmp_path) == (tmp_path / "checkpoints", tag_for(10))  # the run dir works too


def test_crash_mid_save_keeps_latest_on_the_previous_checkpoint(tmp_path):
    ckpt = make(tmp_path)
    ckpt.save(FakeEngine(), 10, {}, {})
    with pytest.raises(CheckpointWriteFailed, match="failed on rank 0: No space left on device; nothing of step 20 was kept"):
        ckpt.save(FakeEngine(fail=True), 20, {}, {})
    root = tmp_path / "checkpoints"
    assert not (root / tag_for(20)).exists()  # rank 0 removed what the failed save left
    assert latest_tag(root) == tag_for(10)
    assert complete_tags(root) == [tag_for(10)]


def test_a_save_that_fails_for_another_reason_than_the_disk_gives_no_disk_advice(tmp_path):
    """A peer lost in the save's collectives (a drill's stopped rank, resumed after the watchdog ended the job):
    the line says what failed and where to resume, not to free space."""
    ckpt = make(tmp_path)
    ckpt.save(FakeEngine(), 10, {}, {})
    lost = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9605: Connection reset by peer")
    with pytest.raises(CheckpointWriteFailed) as failed:
        ckpt.save(FakeEngine(fail=True, error=lost), 20, {}, {})
    root = tmp_path / "checkpoints"
    assert str(failed.value) == (f"saving {root / tag_for(20)} failed on rank 0: {lost}; nothing of step 20 was kept "
                                 f"and {root / tag_for(10)} is the last good checkpoint. Fix: start the job again: it "
                                 f"resumes from {tag_for(10)}")


def test_latest_pointing_at_an_incomplete_folder_falls_back(tmp_path):
    ckpt = make(tmp_path)
    ckpt.save(FakeEngine(), 10, {}, {})
    root = tmp_path / "checkpoints"
    (root / tag_for(20)).mkdir()
    (root / LATEST).write_text(tag_for(20))
    assert latest_tag(root) == tag_for(10)


def test_keep_last_prunes_old_and_incomplete(tmp_path):
    ckpt = make(tmp_path, keep=2)
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        ckpt.save(FakeEngine(), step, {}, {})
    (root / tag_for(25)).mkdir()  # a crashed save between 20 and 30
    ckpt.save(FakeEngine(), 30, {}, {})
    assert complete_tags(root) == [tag_for(20), tag_for(30)]
    assert not (root / tag_for(10)).exists() and not (root / tag_for(25)).exists()


def test_a_checkpoint_of_another_zero_stage_is_refused_with_the_fix(tmp_path):
    saved = make(tmp_path).save(FakeEngine(), 10, {}, {"world_size": 2, "zero_stage": 1})
    other_stage = Checkpointer(tmp_path / "checkpoints", keep_last=2, rank=0, barrier=lambda: None, world_size=2, zero_stage=3)
    with pytest.raises(CheckpointError, match=r"saved with ZeRO stage 1, this run uses stage 3.*deepspeed=zero1"):
        other_stage.load(LoadingEngine(), saved.name)


def test_stage0_loads_directly_on_another_number_of_ranks(tmp_path):
    saved = make(tmp_path).save(FakeEngine(), 10, {"train": 1}, {"world_size": 2, "zero_stage": 0})
    engine = LoadingEngine()
    one_rank = Checkpointer(tmp_path / "checkpoints", keep_last=2, rank=0, barrier=lambda: None, world_size=1, zero_stage=0)
    shared, meta = one_rank.load(engine, saved.name)
    assert engine.loads == [(saved.name, False)] and shared == {"train": 1} and "resharded_from" not in meta


def test_a_conversion_the_disk_cannot_hold_is_refused_before_it_starts(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    saved = make(tmp_path).save(FakeEngine(shards=2), 10, {}, {"world_size": 2, "zero_stage": 2})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 8, 8))
    engine = LoadingEngine()
    one_rank = Checkpointer(tmp_path / "checkpoints", keep_last=2, rank=0, barrier=lambda: None, world_size=1, zero_stage=2)
    with pytest.raises(CheckpointError, match=r"cannot load .* on 1 ranks: converting .* needs ~[0-9.]+ (B|KiB|MiB|GiB) free .*resume on the number"):
        one_rank.load(engine, saved.name)
    assert engine.loads == [] and not (tmp_path / "checkpoints" / "universal").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_checkpoints_files_follow_the_umask_and_are_never_world_writable(tmp_path, umask):
    """docs/checkpoints.md: ayumi widens no permission; the folders and every file (the rank's RNG file, the shared
    state, ayumi.json, `latest`) get what the user's umask leaves."""
    import os

    kept = os.umask(umask)
    try:
        make(tmp_path).save(FakeEngine(), 10, {"train": {}}, {})
    finally:
        os.umask(kept)
    made = [tmp_path / "checkpoints", *(tmp_path / "checkpoints").rglob("*")]
    assert len(made) >= 6
    for path in made:
        mode = path.stat().st_mode & 0o777
        assert mode & umask == 0 and mode == (0o777 if path.is_dir() else 0o666) & ~umask, (path, oct(mode))
