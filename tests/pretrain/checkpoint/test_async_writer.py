"""Asynchronous checkpoint mechanics without DeepSpeed: staging copies, publication after every rank's
marker, failures reported at the wait (the real runs are in tests/pretrain/checkpoint/test_checkpoint_async_cpu.py)."""
import time

import pytest
import torch

from pretrain.checkpoint.checkpointer import LATEST, META, Checkpointer, CheckpointWriteFailed, latest_tag, tag_for
from pretrain.checkpoint.async_writer import HostBuffers, stage


class StagingEngine:
    """Hands its file to the collector as DeepSpeed's save_checkpoint hands each state dict to its checkpoint engine."""

    def __init__(self):
        self.weights = torch.arange(6.0)

    def save(self, root, tag, client_state, collector=None):
        (root / tag).mkdir(parents=True, exist_ok=True)
        assert collector is not None, "an async save stages through the collector"
        collector.save({"module": {"w": self.weights}, **client_state}, str(root / tag / "mp_rank_00_model_states.pt"))


def make(tmp_path, world_size=1, delay=0.0):
    return Checkpointer(tmp_path / "ckpt", keep_last=2, rank=0, barrier=lambda: None, world_size=world_size,
                        async_writes=True, write_delay_s=delay)


def test_staged_copies_do_not_follow_training(tmp_path):
    engine, ckpt = StagingEngine(), make(tmp_path, delay=0.3)
    ckpt.save(engine, 10, {"step": 10}, {})
    engine.weights.add_(100)  # the next step changes the weights in place while the write is pending
    ckpt.wait()
    saved = torch.load(tmp_path / "ckpt" / tag_for(10) / "mp_rank_00_model_states.pt", weights_only=True)
    assert saved["module"]["w"].tolist() == list(range(6)) and saved["ayumi_step"] == 10


def test_latest_moves_only_once_the_write_is_durable(tmp_path):
    engine, ckpt = StagingEngine(), make(tmp_path, delay=0.5)
    ckpt.save(engine, 10, {}, {})
    ckpt.wait()
    ckpt.save(engine, 20, {}, {})  # returns at once; the write sleeps 0.5 s first
    assert latest_tag(tmp_path / "ckpt") == tag_for(10) and not (tmp_path / "ckpt" / tag_for(20) / META).exists()
    assert ckpt.pending_step == 20
    ckpt.save(engine, 30, {}, {})  # waits for 20 first: one write in flight at most
    assert (tmp_path / "ckpt" / tag_for(20) / META).exists()
    ckpt.wait()
    assert (tmp_path / "ckpt" / LATEST).read_text().strip() == tag_for(30)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [LATEST, tag_for(20), tag_for(30)]  # keep_last=2


def test_rank0_publishes_when_every_ranks_marker_is_there(tmp_path):
    """World of 2, only rank 0 here: it publishes as soon as rank 1's `.written` marker appears."""
    ckpt = make(tmp_path, world_size=2)
    ckpt.save(StagingEngine(), 10, {}, {})
    tag_dir = tmp_path / "ckpt" / tag_for(10)
    time.sleep(0.3)
    assert not (tag_dir / META).exists(), "rank 1 has not written yet"
    (tag_dir / ".written_rank00001").touch()
    deadline = time.time() + 5
    while not (tmp_path / "ckpt" / LATEST).exists():  # written after ayumi.json: the publication's last step
        assert time.time() < deadline
        time.sleep(0.02)
    assert (tag_dir / META).exists() and (tmp_path / "ckpt" / LATEST).read_text().strip() == tag_for(10)
    ckpt.wait()
    assert not list(tag_dir.glob(".written_rank*"))


def test_another_ranks_failed_write_stops_publication_and_raises_at_the_wait(tmp_path):
    ckpt = make(tmp_path, world_size=2)
    ckpt.save(StagingEngine(), 10, {}, {})
    (tmp_path / "ckpt" / tag_for(10) / ".written_rank00001").touch()
    ckpt.wait()
    ckpt.save(StagingEngine(), 20, {}, {})
    (tmp_path / "ckpt" / tag_for(20) / ".failed_rank00001").write_text("OSError: No space left on device\n")
    with pytest.raises(CheckpointWriteFailed, match="No space left on device"):
        ckpt.wait()
    assert latest_tag(tmp_path / "ckpt") == tag_for(10)
    assert not (tmp_path / "ckpt" / tag_for(20)).exists(), "rank 0 removes the failed folder"


def test_host_buffers_are_reused_from_save_to_save():
    buffers = HostBuffers()
    first = stage({"a": torch.ones(4), "b": [torch.zeros(2, 2)]}, buffers)
    buffers.rewind()
    second = stage({"a": torch.full((4,), 2.0), "b": [torch.zeros(2, 2)]}, buffers)
    assert second["a"].data_ptr() == first["a"].data_ptr() and second["a"].tolist() == [2.0] * 4
