"""Checkpoint checksums without DeepSpeed: hashed as written, recorded in ayumi.json by every save mode, and
verified (damaged bytes, a truncated or missing file, an unreadable record, a checkpoint from before checksums)."""
import json

import pytest
import torch

from pretrain.checkpoint import integrity
from pretrain.checkpoint.checkpointer import META, Checkpointer, CheckpointCorrupt, tag_for
from pretrain.checkpoint.integrity import DAMAGED, UNVERIFIABLE, VERIFIED, hash_file, save_hashed, verify

MODEL = "mp_rank_00_model_states.pt"


class DeepSpeedLikeEngine:
    """Hands its state dict to the checkpoint engine stand-in (as DeepSpeed's save_checkpoint does) and copies a
    helper script into the folder itself (as DeepSpeed's ZeRO save copies zero_to_fp32.py)."""

    def __init__(self):
        self.weights = torch.arange(4096.0)

    def save(self, root, tag, client_state, collector=None):
        (root / tag).mkdir(parents=True, exist_ok=True)
        collector.save({"module": {"w": self.weights}, **client_state}, str(root / tag / MODEL))
        (root / tag / "zero_to_fp32.py").write_text("# recovery script\n")


def saved_record(tag_dir):
    return json.loads((tag_dir / META).read_text())[integrity.RECORD_KEY]


def flip_bytes(path, offset, count=8):
    data = bytearray(path.read_bytes())
    data[offset:offset + count] = bytes(255 - b for b in data[offset:offset + count])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("zipfile", [True, False])
def test_the_sum_taken_while_writing_is_the_files_own(tmp_path, zipfile):
    obj = {"a": torch.randn(300_000), "b": [torch.ones(3), "text"], "view": torch.arange(10)[2:5]}
    written = save_hashed(obj, tmp_path / "x.pt", zipfile=zipfile)
    assert written == hash_file(tmp_path / "x.pt") and written.size == (tmp_path / "x.pt").stat().st_size
    loaded = torch.load(tmp_path / "x.pt", weights_only=True)
    assert torch.equal(loaded["a"], obj["a"]) and loaded["view"].tolist() == [2, 3, 4]
    assert torch.serialization.get_crc32_options() is True, "torch's own switch is back as it was"


def test_torch_crc32_is_off_only_during_the_save_even_when_it_fails(tmp_path):
    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        save_hashed({"x": Unpicklable()}, tmp_path / "bad.pt", atomic=True)
    assert torch.serialization.get_crc32_options() is True
    assert list(tmp_path.iterdir()) == [], "the half-written temporary file is removed"


@pytest.mark.parametrize("async_writes", [False, True])
def test_every_file_of_a_save_is_recorded_and_verifies(tmp_path, async_writes):
    saver = Checkpointer(tmp_path / "ckpt", keep_last=2, rank=0, barrier=lambda: None, async_writes=async_writes)
    tag_dir = saver.save(DeepSpeedLikeEngine(), 10, {"train": {"step": 10}}, {"model": {}})
    saver.wait()
    record = saved_record(tag_dir)
    assert record["algorithm"] == "xxh3_128"
    assert sorted(record["files"]) == sorted(["ayumi_rank00000.pt", "ayumi_state.pt", MODEL, "zero_to_fp32.py"])
    for name, entry in record["files"].items():
        assert entry == hash_file(tag_dir / name).to_json(), name
    assert not list(tag_dir.glob(".*")), "markers and temporary files are gone once published"
    assert verify(tag_dir) == integrity.Verdict(VERIFIED, 4)


def test_rank0_records_the_sums_every_rank_left_in_its_marker(tmp_path):
    """A 2-rank world seen from rank 0: rank 1's marker (written as its writer thread writes it) carries its file's
    sum, which the record takes as given; publication waits for that marker."""
    saver = Checkpointer(tmp_path / "ckpt", keep_last=2, rank=0, barrier=lambda: None, world_size=2, async_writes=True)
    tag_dir = saver.save(DeepSpeedLikeEngine(), 10, {}, {})
    rank1_file = tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank1_sum = save_hashed({"exp_avg": torch.ones(8)}, rank1_file)
    integrity.write_sums(tag_dir / ".written_rank00001", {rank1_file.name: rank1_sum})
    saver.wait()
    assert saved_record(tag_dir)["files"][rank1_file.name] == rank1_sum.to_json()
    assert verify(tag_dir).status == VERIFIED


@pytest.fixture
def saved(tmp_path):
    saver = Checkpointer(tmp_path / "ckpt", keep_last=2, rank=0, barrier=lambda: None)
    return saver, saver.save(DeepSpeedLikeEngine(), 10, {"train": {}}, {"model": {}})


def test_overwritten_bytes_in_the_middle_of_a_file_are_found_and_named(saved):
    saver, tag_dir = saved
    flip_bytes(tag_dir / MODEL, (tag_dir / MODEL).stat().st_size // 2)
    verdict = verify(tag_dir)
    assert verdict.status == DAMAGED and verdict.problem == f"{MODEL} does not match the xxh3_128 checksum recorded at save"
    with pytest.raises(CheckpointCorrupt) as refused:
        saver.load(object(), tag_for(10))  # refused before the engine is asked for anything
    assert str(refused.value) == f"checkpoint {tag_dir} is damaged: {verdict.problem}"
    assert "\n" not in str(refused.value)


def test_a_truncated_or_missing_file_is_found_without_hashing(saved):
    _, tag_dir = saved
    size = (tag_dir / "ayumi_state.pt").stat().st_size
    with open(tag_dir / "ayumi_state.pt", "r+b") as handle:
        handle.truncate(size - 1)
    assert verify(tag_dir, share=(1, 2)).problem == f"ayumi_state.pt has {size - 1} bytes, {size} were recorded at save"
    (tag_dir / "ayumi_state.pt").unlink()
    assert verify(tag_dir).problem == f"ayumi_state.pt is missing ({size} bytes at save)"


def test_ranks_share_the_hashing(saved):
    """Files are hashed by the rank whose share holds them: the damage shows in exactly one of two shares."""
    _, tag_dir = saved
    flip_bytes(tag_dir / "zero_to_fp32.py", 0, 2)
    shares = [verify(tag_dir, share=(rank, 2)).status for rank in (0, 1)]
    assert sorted(shares) == [DAMAGED, VERIFIED]


def test_an_unreadable_record_is_damage_and_a_record_without_checksums_is_unverifiable(saved):
    _, tag_dir = saved
    meta = json.loads((tag_dir / META).read_text())
    del meta[integrity.RECORD_KEY]
    (tag_dir / META).write_text(json.dumps(meta))
    assert verify(tag_dir) == integrity.Verdict(UNVERIFIABLE)
    (tag_dir / META).write_text('{"step": 10, "tag": ')
    verdict = verify(tag_dir)
    assert verdict.status == DAMAGED and verdict.problem.startswith("ayumi.json cannot be read (")


def test_a_checkpoint_from_before_checksums_still_loads_and_says_so(saved):
    saver, tag_dir = saved
    meta = json.loads((tag_dir / META).read_text())
    del meta[integrity.RECORD_KEY]
    (tag_dir / META).write_text(json.dumps(meta))

    class Loads:
        def load(self, root, tag, universal=False):
            self.loaded = tag

    engine = Loads()
    shared, meta = saver.load(engine, tag_for(10))
    assert engine.loaded == tag_for(10) and shared == {"train": {}} and meta["verified"] is False
