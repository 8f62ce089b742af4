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


def _token_root(root, shards: int = 3, docs_per_shard: int = 4):
    """A data root of one domain ('en'), each document 5 ids ending with EOS (2); returns its documents."""
    from data.token_root import TokenRoot

    docs = [np.array([3 + d % 400, 4, 5, 6, 2]) for d in range(shards * docs_per_shard)]
    with TokenRoot(root, vocab_size=512, eos_id=2) as out:
        for shard in range(shards):
            with out.shard("en") as writer:
                writer.add_documents(docs[shard * docs_per_shard:(shard + 1) * docs_per_shard])
    return docs


def test_a_listed_shard_opens_without_reading_its_index_and_checks_it_when_first_used(tmp_path):
    """Training opens ayumi's shards from the record's counts (two stats each: flat in the shard count); samples
    need no index. An index damaged in place (same size) is found, naming the file, when its documents are read,
    and by `ayumi data verify`."""
    from data.domains import open_run_data
    from data.integrity import verify_root

    docs = _token_root(tmp_path)
    idx = tmp_path / "en" / "train" / "part_00001.idx"
    raw = bytearray(idx.read_bytes())
    raw[34:38] = (7).to_bytes(4, "little")  # the first length of the shard: 5 -> 7, the file keeps its size
    idx.write_bytes(bytes(raw))
    manifest, train, _ = open_run_data(tmp_path, None, seq_len=4, verify="full")
    samples = train["en"]
    stream = np.concatenate(docs)
    assert [samples.sample(i).tolist() for i in range(len(samples))] == \
        [stream[i * 4:i * 4 + 5].tolist() for i in range(len(samples))]
    assert train["en"].readers[0].document(1).tolist() == docs[1].tolist()
    with pytest.raises(ShardFormatError, match=rf"^{idx}: sequences are not stored back to back .*Fix: re-run "
                                               r"`ayumi data prepare`"):
        samples.readers[1].document(0)
    assert [line.split(":")[0] for line in verify_root(tmp_path, manifest)] == [str(idx)]


def test_a_listed_index_of_the_wrong_size_or_missing_is_refused_at_open(tmp_path):
    from data.domains import open_run_data

    _token_root(tmp_path)
    idx = tmp_path / "en" / "train" / "part_00002.idx"
    idx.write_bytes(idx.read_bytes()[:-8])
    with pytest.raises(ShardFormatError, match=rf"^{idx}: 114 bytes, but the documents recorded for it need 122; "
                                               r"the file is truncated or corrupt\. Fix: re-run `ayumi data prepare`"):
        open_run_data(tmp_path, None, seq_len=4, verify="sizes")
    idx.unlink()
    with pytest.raises(ShardFormatError, match=rf"^shard index {idx} does not exist \(its \.bin does"):
        open_run_data(tmp_path, None, seq_len=4, verify="sizes")


def test_a_listed_index_replaced_after_opening_is_named_when_first_used(tmp_path):
    """The index read later must be the file that was opened: a shard prepared again (other documents, same
    counts) between the open and the first read of its documents is refused, not read as the old one."""
    from data.domains import open_run_data

    _token_root(tmp_path, shards=1)
    _, train, _ = open_run_data(tmp_path, None, seq_len=4, verify="sizes")
    prefix = tmp_path / "en" / "train" / "part_00000"
    with ShardWriter(prefix, vocab_size=512) as writer:  # written aside, renamed into place: a new inode
        writer.add_documents([np.array([9, 2]), np.array([9] * 6 + [2]), np.array([8, 2]), np.array([7] * 7 + [2])])
    with pytest.raises(ShardFormatError, match=rf"^{prefix}.idx: replaced by another file after it was opened"):
        train["en"].readers[0].document(0)
