"""The .bin/.idx shard format (Megatron's): round trip, dtypes, atomic writes, and clear errors on bad files."""
import hashlib
import struct

import numpy as np
import pytest

from data.packed import BlendedSamples, EodAppended, EpochPermutation, PackedSamples, ShuffledDomains
from data.shards import HEADER_SIZE, ShardFormatError, ShardReader, ShardWriter, dtype_for_vocab, find_shards


def write(prefix, docs, vocab=1000):
    with ShardWriter(prefix, vocab_size=vocab) as writer:
        writer.add_documents(docs)
    return ShardReader(prefix)


def test_round_trip_and_index_layout(tmp_path):
    docs = [[1, 2, 3], [], [4, 5], list(range(10))]
    reader = write(tmp_path / "s0", docs)
    assert reader.num_docs == 4 and reader.num_tokens == 15 and reader.num_sequences == 4
    assert [list(doc) for doc in reader] == docs
    assert reader.dtype == np.uint16
    raw = (tmp_path / "s0.idx").read_bytes()
    # Megatron's layout, field by field: magic, version, dtype code (8 = uint16), counts, then the arrays.
    assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack_from("<QBQQ", raw, 9) == (1, 8, 4, 5)
    assert HEADER_SIZE == 34 and len(raw) == 34 + 4 * 4 + 8 * 4 + 8 * 5
    assert np.frombuffer(raw, "<i4", 4, 34).tolist() == [3, 0, 2, 10]
    assert np.frombuffer(raw, "<i8", 4, 50).tolist() == [0, 6, 6, 10]  # byte pointers
    assert np.frombuffer(raw, "<i8", 5, 82).tolist() == [0, 1, 2, 3, 4]  # one sequence per document


def test_dtype_follows_megatrons_rule(tmp_path):
    assert dtype_for_vocab(65499) == np.uint16 and dtype_for_vocab(65500) == np.int32
    reader = write(tmp_path / "big", [[70000, 1]], vocab=100000)
    assert reader.dtype == np.int32 and list(reader[0]) == [70000, 1]
    assert (tmp_path / "big.bin").stat().st_size == 8


def test_writer_records_max_id_and_checksum(tmp_path):
    with ShardWriter(tmp_path / "s", vocab_size=1000) as writer:
        writer.add_documents([[5, 999, 3], [7]])
    assert writer.max_id == 999 and writer.num_docs == 2 and writer.num_bytes == 8
    assert writer.sha256 == hashlib.sha256((tmp_path / "s.bin").read_bytes()).hexdigest()


def test_add_packed_matches_one_by_one(tmp_path):
    docs = [[1, 2, 3], [7], [4, 5], list(range(10))]
    one_by_one = write(tmp_path / "a", docs)
    with ShardWriter(tmp_path / "b", vocab_size=1000) as writer:
        writer.add_packed(np.array([1, 2, 3, 7], dtype=np.int32), np.array([3, 1]))
        writer.add_packed(np.array([4, 5, *range(10)], dtype=np.int32), np.array([2, 10]))
        with pytest.raises(ValueError, match="add up to 3 tokens, got 2"):
            writer.add_packed(np.array([1, 2], dtype=np.int32), np.array([3]))
        with pytest.raises(ValueError, match="out of range"):
            writer.add_packed(np.array([1, 1000], dtype=np.int32), np.array([2]))
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert (tmp_path / "a.idx").read_bytes() == (tmp_path / "b.idx").read_bytes()
    assert [list(doc) for doc in one_by_one] == docs


def test_out_of_range_token_rejected(tmp_path):
    with pytest.raises(ValueError, match="out of range"):
        write(tmp_path / "s", [[5, 1000]], vocab=1000)
    assert not (tmp_path / "s.idx").exists() and not (tmp_path / "s.bin").exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_unclosed_writer_publishes_nothing(tmp_path):
    writer = ShardWriter(tmp_path / "s", vocab_size=100)
    writer.add_document([1, 2])
    assert find_shards(tmp_path) == []
    with pytest.raises(ShardFormatError, match="does not exist"):
        ShardReader(tmp_path / "s")
    writer.close()
    assert find_shards(tmp_path) == [tmp_path / "s"]


def test_bad_magic(tmp_path):
    write(tmp_path / "s", [[1, 2]])
    raw = bytearray((tmp_path / "s.idx").read_bytes())
    raw[:9] = b"NOTASHARD"
    (tmp_path / "s.idx").write_bytes(bytes(raw))
    with pytest.raises(ShardFormatError, match=r"s\.idx.*not a Megatron indexed-dataset index"):
        ShardReader(tmp_path / "s")


def test_old_ayumi_index_names_the_command_that_rewrites_it(tmp_path):
    write(tmp_path / "s", [[1, 2]])
    (tmp_path / "s.idx").write_bytes(b"AYUMIIDX" + bytes(96 + 16))  # the version-1 header and two offsets
    with pytest.raises(ShardFormatError, match=r"s\.idx.*AYUMIIDX.*re-run `ayumi data prepare`"):
        ShardReader(tmp_path / "s")


def test_pointers_that_are_not_back_to_back_are_refused(tmp_path):
    write(tmp_path / "s", [[1, 2], [3]])
    raw = bytearray((tmp_path / "s.idx").read_bytes())
    struct.pack_into("<q", raw, 34 + 8 + 8, 2)  # second sequence said to start at byte 2, not 4
    (tmp_path / "s.idx").write_bytes(bytes(raw))
    with pytest.raises(ShardFormatError, match="not stored back to back"):
        ShardReader(tmp_path / "s")


def test_bad_version(tmp_path):
    write(tmp_path / "s", [[1, 2]])
    raw = bytearray((tmp_path / "s.idx").read_bytes())
    raw[9:17] = (99).to_bytes(8, "little")
    (tmp_path / "s.idx").write_bytes(bytes(raw))
    with pytest.raises(ShardFormatError, match="version 99"):
        ShardReader(tmp_path / "s")


def test_truncated_index_and_data(tmp_path):
    write(tmp_path / "s", [[1, 2, 3], [4]])
    idx = (tmp_path / "s.idx").read_bytes()
    (tmp_path / "s.idx").write_bytes(idx[:HEADER_SIZE - 3])
    with pytest.raises(ShardFormatError, match="truncated index"):
        ShardReader(tmp_path / "s")
    (tmp_path / "s.idx").write_bytes(idx[:-4])
    with pytest.raises(ShardFormatError, match="truncated or corrupt"):
        ShardReader(tmp_path / "s")
    (tmp_path / "s.idx").write_bytes(idx)
    (tmp_path / "s.bin").write_bytes((tmp_path / "s.bin").read_bytes()[:-2])
    with pytest.raises(ShardFormatError, match=r"s\.bin.*truncated"):
        ShardReader(tmp_path / "s")


def test_bin_without_idx_is_reported_unfinished(tmp_path):
    write(tmp_path / "s", [[1]])
    (tmp_path / "s.idx").unlink()
    with pytest.raises(ShardFormatError, match="unfinished or damaged shard"):
        ShardReader(tmp_path / "s")


def test_packed_samples_span_shards(tmp_path):
    write(tmp_path / "a", [list(range(0, 7))], vocab=100)
    write(tmp_path / "b", [list(range(7, 20))], vocab=100)
    samples = PackedSamples.from_directory(tmp_path, seq_len=4)
    assert samples.num_tokens == 20 and len(samples) == 4  # (20 - 1) // 4
    assert list(samples.sample(1)) == [4, 5, 6, 7, 8]  # crosses the a|b boundary
    assert list(samples.sample(3)) == [12, 13, 14, 15, 16]
    with pytest.raises(IndexError):
        samples.sample(4)


def test_epoch_permutation_is_deterministic_and_complete():
    order = EpochPermutation(50, seed=3)
    first = [order(g)[1] for g in range(50)]
    second = [order(g)[1] for g in range(50, 100)]
    assert sorted(first) == list(range(50)) and sorted(second) == list(range(50))
    assert first != second  # each epoch reshuffles
    again = EpochPermutation(50, seed=3)
    assert [again(g)[1] for g in range(100)] == first + second


def test_shuffled_domains_covers_every_sample(tmp_path):
    write(tmp_path / "ja" / "s", [list(range(41))], vocab=100)
    write(tmp_path / "en" / "s", [list(range(50, 71))], vocab=100)
    source = ShuffledDomains({
        "ja": PackedSamples.from_directory(tmp_path / "ja", 4),
        "en": PackedSamples.from_directory(tmp_path / "en", 4),
    }, seed=0)
    seen = [source.get(g) for g in range(source.num_samples)]
    assert source.num_samples == 10 + 5
    assert sum(1 for _, domain in seen if domain == 0) == 10
    en = sorted(tuple(tokens) for tokens, domain in seen if domain == 1)
    assert en[0] == (50, 51, 52, 53, 54)


def test_eod_appended_reads_a_separator_after_every_document(tmp_path):
    reader = write(tmp_path / "s", [[1, 2, 3], [4], [5, 6]], vocab=100)
    view = EodAppended(reader, eod_id=99)
    assert view.num_tokens == 9
    assert view.slice(0, 9).tolist() == [1, 2, 3, 99, 4, 99, 5, 6, 99]
    assert view.slice(2, 6).tolist() == [3, 99, 4, 99] and view.slice(3, 4).tolist() == [99]
    samples = PackedSamples([view], seq_len=4)
    assert samples.sample(1).tolist() == [4, 99, 5, 6, 99]


def test_blended_samples_follow_the_weights(tmp_path):
    small = PackedSamples([write(tmp_path / "a", [list(range(9))], vocab=100)], seq_len=2)   # 4 samples
    large = PackedSamples([write(tmp_path / "b", [list(range(50, 67))], vocab=100)], seq_len=2)  # 8 samples
    blend = BlendedSamples([small, large], [0.75, 0.25], "mix")
    assert len(blend) == 12 and blend.counts == [9, 3]
    picked = [blend.sample(i).tolist() for i in range(12)]
    assert picked[:9] == [small.sample(i % 4).tolist() for i in range(9)]  # repeated in order
    assert picked[9:] == [large.sample(i).tolist() for i in (0, 2, 5)]  # evenly spaced
    # `reading` is `locate`'s inverse (data.exclude finds a document's blend samples with it): each blend sample
    # is read back from where it reads, exactly once.
    for part, inner_samples in enumerate(blend.parts):
        back = [index for inner in range(len(inner_samples)) for index in blend.reading(part, inner)]
        assert sorted(back) == list(range(int(blend._starts[part]), int(blend._starts[part + 1])))
        assert all(blend.locate(index) == (part, inner) for inner in range(len(inner_samples))
                   for index in blend.reading(part, inner))


def test_a_damaged_sample_is_refused_with_the_file_named(tmp_path):
    write(tmp_path / "s", [list(range(20))], vocab=100)
    samples = PackedSamples([ShardReader(tmp_path / "s")], seq_len=4, name="en", vocab_size=20)
    assert samples.sample(0).tolist() == [0, 1, 2, 3, 4]
    raw = bytearray((tmp_path / "s.bin").read_bytes())
    raw[2 * 6:2 * 6 + 2] = (77).to_bytes(2, "little")  # token 6 overwritten in place
    (tmp_path / "s.bin").write_bytes(bytes(raw))
    damaged = PackedSamples([ShardReader(tmp_path / "s")], seq_len=4, name="en", vocab_size=20)
    with pytest.raises(ShardFormatError, match=r"s\.bin: token 6 of the stream is id 77.*\[0, 20\).*ayumi data verify"):
        damaged.sample(1)
