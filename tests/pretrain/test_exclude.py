"""data.exclude in the stream, without DeepSpeed: from its position on no sample holds a token of an excluded
document, in a stage at train.seq_len and in one of longer, length-filtered samples; every other sample stays where
it was; an excluded sample's place is taken by its stream's sample at the same place of the next epoch; `origin`
(what `ayumi batch` names) agrees with `get` (what the loader reads); the file's mistakes are one line each. The run
across resumes: tests/pretrain/test_replay_poison.py."""
from __future__ import annotations

import numpy as np
import pytest

from data.exclude import Entry, ExcludeError, check_documents, read_exclude_file
from data.packed import ShuffledDomains
from data.provenance import sample_pieces
from pretrain.excluded import apply_entries, source_shards
from tests.curriculum.test_stage_lengths import mixer_for, short_to_long, write_mixed_lengths

FROM = 200
"""The position the exclusion applies from (stage 1 ends at 45 x 16 + 3 tokens: sample 46)."""
DOCUMENTS = (("a", "part_00000", 1), ("a", "part_00000", 2), ("b", "part_00000", 7))
"""A long document of a (read by both stages) and a short one of a and b each (stage 1 only)."""


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return write_mixed_lengths(tmp_path_factory.mktemp("mixed"))


def holds_excluded(source, index: int) -> bool:
    stream, _, sample, samples = source.origin(index)
    domain = stream.split("@")[0]
    return any((domain, piece.shard, piece.document) in DOCUMENTS for piece in sample_pieces(samples, sample))


def test_the_mixer_leaves_the_documents_out_from_the_position_on(data_root):
    plain, excluding = mixer_for(data_root, short_to_long()), mixer_for(data_root, short_to_long())
    apply_entries(excluding, [Entry(FROM, DOCUMENTS)])
    replaced = 0
    for index in range(0, 800):
        tokens, domain = excluding.get(index)
        stream, epoch, sample, samples = excluding.origin(index)
        assert samples.sample(sample).tolist() == tokens.tolist(), index  # `ayumi batch` names what the loader reads
        if index < FROM or not holds_excluded(plain, index):
            assert tokens.tolist() == plain.get(index)[0].tolist(), index  # the past, and every other sample
            continue
        replaced += 1
        assert not holds_excluded(excluding, index), index
        plain_stream, plain_epoch, plain_sample, _ = plain.origin(index)
        assert (stream, domain) == (plain_stream, plain.get(index)[1]) and epoch > plain_epoch, index
    assert replaced > 10
    assert sum(holds_excluded(plain, i) for i in range(FROM)) > 0  # the documents were read before FROM, and stay
    assert excluding.stage_at_sample(799) == 1  # stage 2's longer, filtered samples were checked too


def test_shuffled_domains_leave_them_out_too(data_root):
    from data.domains import open_run_data

    _, train, _ = open_run_data(data_root, None, 16, verify="sizes", validation=False)
    plain, excluding = ShuffledDomains(train, seed=5), ShuffledDomains(train, seed=5)
    apply_entries(excluding, [Entry(FROM, DOCUMENTS)])
    for index in range(0, 600):
        if index < FROM or not holds_excluded(plain, index):
            assert excluding.get(index)[0].tolist() == plain.get(index)[0].tolist(), index
        else:
            assert not holds_excluded(excluding, index), index
            assert excluding.origin(index)[1] > plain.origin(index)[1]  # a later epoch's sample


def test_the_files_mistakes_are_named(data_root, tmp_path):
    listed = tmp_path / "exclude.txt"
    listed.write_text("# why\na part_00000 1\na part_00000:2  # the shard:document form\na part_00000 1\n")
    assert read_exclude_file(listed) == [("a", "part_00000", 1), ("a", "part_00000", 2)]
    shards = source_shards(mixer_for(data_root, short_to_long()))
    assert shards == {"a": {"part_00000": 120}, "b": {"part_00000": 120}}
    for line, says in (("a part_00000", f"{listed}:2: 'a part_00000' is not `domain shard document`"),
                       ("c part_00000 1", "domain 'c' is not one the run trains on (a, b)"),
                       ("a part_00009 1", "domain 'a' has no shard 'part_00009' (it has part_00000)"),
                       ("a part_00000 120", "shard a/part_00000 holds documents 0-119, not 120")):
        listed.write_text(f"# why\n{line}\n")
        with pytest.raises(ExcludeError) as err:
            check_documents(read_exclude_file(listed), shards, str(listed))
        assert says in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ExcludeError, match="no such file"):
        read_exclude_file(tmp_path / "missing.txt")


def test_excluding_a_whole_stream_is_refused_at_the_start_where_nothing_could_replace_it(data_root):
    from data.domains import open_run_data

    every_b = tuple(("b", "part_00000", doc) for doc in range(120))
    with pytest.raises(ExcludeError) as err:  # the mixer replaces a sample from its own stream: b has none left
        apply_entries(mixer_for(data_root, short_to_long()), [Entry(FROM, every_b)])
    assert "leaves no sample of domain 'b' to train on" in str(err.value) and "\n" not in str(err.value)
    _, train, _ = open_run_data(data_root, None, 16, verify="sizes", validation=False)
    shuffled = ShuffledDomains(train, seed=5)  # one order over both domains: a's samples take b's places
    apply_entries(shuffled, [Entry(FROM, every_b)])
    assert {shuffled.origin(index)[0] for index in range(FROM, FROM + 200)} == {"a"}
    with pytest.raises(ExcludeError, match="no sample to train on: its documents fill all"):
        apply_entries(ShuffledDomains(train, seed=5), [Entry(FROM, every_b + tuple(("a", "part_00000", d)
                                                                                   for d in range(120)))])


def test_a_weighted_blend_leaves_the_document_out_through_each_part_that_reads_it(tmp_path):
    from data.exclude import Exclusion
    from data.packed import BlendedSamples, PackedSamples
    from tests.data.test_shards import write

    # Part a (4 samples) repeated to 9, part b (8 samples) read at 3 of them: the blend of Megatron's --data-path.
    small = PackedSamples([write(tmp_path / "a", [list(range(4)), list(range(10, 15))], vocab=100)], seq_len=2)
    large = PackedSamples([write(tmp_path / "b", [list(range(50, 67))], vocab=100)], seq_len=2)
    blend = BlendedSamples([small, large], [0.75, 0.25], "mix")
    exclusion = Exclusion([("mix", blend)], [Entry(0, (("mix", "a", 0),))])
    holding = [i for i in range(len(blend)) if any(p.shard == "a" and p.document == 0
                                                   for p in sample_pieces(blend, i))]
    assert sorted(exclusion.by_stream[0]) == holding and len(holding) == 5  # a's samples 0 and 1, read at 0, 1, 4, 5, 8
