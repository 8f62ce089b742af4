"""The .bin/.idx shard format: round trip, dtypes, atomic writes, and clear errors on bad files."""
import numpy as np
import pytest

from data.packed import EpochPermutation, PackedSamples, ShuffledDomains
from data.shards import (
    HEADER_SIZE, ShardFormatError, ShardReader, ShardWriter, TokenizerMismatchError,
    check_tokenizer, find_shards,
)

SHA = "ab" * 32


def write(prefix, docs, vocab=1000, sha=SHA):
    with ShardWriter(prefix, vocab_size=vocab, tokenizer_sha256=sha) as writer:
        writer.add_documents(docs)
    return ShardReader(prefix)


def test_round_trip_and_header(tmp_path):
    docs = [[1, 2, 3], [], [4, 5], list(range(10))]
    reader = write(tmp_path / "s0", docs)
    assert reader.num_docs == 4 and reader.num_tokens == 15
    assert reader.tokenizer_sha256 == SHA and reader.vocab_size == 1000
    assert [list(doc) for doc in reader] == docs
    assert reader.dtype == np.uint16


def test_large_vocab_uses_uint32(tmp_path):
    reader = write(tmp_path / "big", [[70000, 1]], vocab=100000)
    assert reader.dtype == np.uint32 and list(reader[0]) == [70000, 1]
    assert (tmp_path / "big.bin").stat().st_size == 8


def test_add_packed_matches_one_by_one(tmp_path):
    docs = [[1, 2, 3], [7], [4, 5], list(range(10))]
    one_by_one = write(tmp_path / "a", docs)
    with ShardWriter(tmp_path / "b", vocab_size=1000, tokenizer_sha256=SHA) as writer:
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
    raw[:8] = b"NOTASHRD"
    (tmp_path / "s.idx").write_bytes(bytes(raw))
    with pytest.raises(ShardFormatError, match=r"s\.idx.*not an ayumi shard index"):
        ShardReader(tmp_path / "s")


def test_bad_version(tmp_path):
    write(tmp_path / "s", [[1, 2]])
    raw = bytearray((tmp_path / "s.idx").read_bytes())
    raw[8:12] = (99).to_bytes(4, "little")
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
    with pytest.raises(ShardFormatError, match="unfinished shard"):
        ShardReader(tmp_path / "s")


def test_tokenizer_mismatch_names_both(tmp_path):
    reader = write(tmp_path / "s", [[1]])
    check_tokenizer([reader], SHA, "tok/tokenizer.model")
    with pytest.raises(TokenizerMismatchError) as err:
        check_tokenizer([reader], "cd" * 32, "tok/tokenizer.model")
    assert SHA in str(err.value) and "cd" * 32 in str(err.value) and "tok/tokenizer.model" in str(err.value)


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
