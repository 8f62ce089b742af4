"""Readers of many shards hold no files open (data/shards.py: a root of 10,000 shards per domain must open)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from data.packed import PackedSamples
from data.shards import ShardFormatError, ShardReader, ShardWriter


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_open_shards_hold_no_descriptor_and_read_what_was_written(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, size=int(rng.integers(1, 40))) for _ in range(600)]
    for shard in range(60):  # 10 documents per shard
        with ShardWriter(tmp_path / f"part_{shard:05d}", vocab_size=512) as writer:
            writer.add_documents(docs[shard * 10:(shard + 1) * 10])
    before = _open_descriptors()
    readers = [ShardReader(tmp_path / f"part_{shard:05d}") for shard in range(60)]
    samples = PackedSamples(readers, seq_len=16)
    stream = np.concatenate(docs)
    for index in range(len(samples)):
        assert samples.sample(index).tolist() == stream[index * 16:index * 16 + 17].tolist()
    assert _open_descriptors() == before  # was two per shard: 120 more
    assert readers[7].document(3).tolist() == docs[73].tolist()  # the index, read again on first use


def test_a_shard_truncated_after_opening_is_named_when_read(tmp_path):
    with ShardWriter(tmp_path / "part_00000", vocab_size=512) as writer:
        writer.add_document(np.arange(100))
    reader = ShardReader(tmp_path / "part_00000", fix="remake it")
    os.truncate(reader.bin_path, 50)
    with pytest.raises(ShardFormatError, match=r"part_00000.bin: ended at byte 50 .*truncated.*Fix: remake it"):
        reader.slice(10, 60)


def test_a_shard_prepared_again_under_its_reader_is_named_not_read(tmp_path):
    """A map kept the file it was opened on; a read by path would find the new one (same name, other tokens):
    refused, naming the file, never read as if it were the same shard."""
    with ShardWriter(tmp_path / "part_00000", vocab_size=512) as writer:
        writer.add_document(np.arange(100))
    reader = ShardReader(tmp_path / "part_00000", fix="remake it")
    assert reader.slice(10, 20).tolist() == list(range(10, 20))
    with ShardWriter(tmp_path / "part_00000", vocab_size=512) as writer:  # written aside, then renamed into place
        writer.add_document(np.arange(100, 200))
    with pytest.raises(ShardFormatError, match=r"part_00000.bin: replaced by another file after it was opened.*"
                                               r"Fix: remake it"):
        reader.slice(10, 20)


def test_megatron_shards_read_with_separators_hold_no_descriptor_either(tmp_path):
    """Megatron data prepared without --append-eod is read with an end-of-document id after each document
    (EodAppended): its samples come through the same reads, so many such shards open no file and no map each."""
    from data.packed import EodAppended

    docs = [np.arange(5 * shard, 5 * shard + 5) for shard in range(20)]
    for shard, doc in enumerate(docs):
        with ShardWriter(tmp_path / f"part_{shard:05d}", vocab_size=512) as writer:
            writer.add_document(doc)
    before = _open_descriptors()
    shards = [EodAppended(ShardReader(tmp_path / f"part_{shard:05d}"), eod_id=511) for shard in range(20)]
    assert [shard.slice(0, 6).tolist() for shard in shards] == [doc.tolist() + [511] for doc in docs]
    assert _open_descriptors() == before  # the whole .bin was mapped for each shard (a descriptor each) before
