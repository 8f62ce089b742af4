"""Streaming corpus readers: formats, skip counting, strict mode, globbing."""
from __future__ import annotations

import gzip
import json

import pytest

from common.corpus import (
    CorpusError, ReadStats, detect_format, expand_inputs, iter_documents, iter_file, parse_jsonl_block, read_jsonl_blocks,
)


def write_jsonl_with_faults(path):
    lines = [b'{"text": "first"}', b"not json", b'{"body": "x"}', b'{"text": 5}', b"\xff\xfe{}", b"", b'{"text": "last"}']
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_jsonl_skips_and_counts_each_fault(tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl_with_faults(path)
    stats = ReadStats()
    docs = list(iter_file(path, stats=stats))
    assert [d.text for d in docs] == ["first", "last"]
    assert docs[1].location == f"{path}:7"
    assert stats.skipped == {"malformed_json": 1, "missing_field": 1, "not_a_string": 1, "invalid_utf8": 1}
    assert stats.examples["malformed_json"] == [f"{path}:2"]
    assert stats.files_read == 1 and stats.docs_read == 2


@pytest.mark.parametrize("block_bytes", [1, 7, 40, 1 << 20])
@pytest.mark.parametrize("final_newline", [True, False])
def test_jsonl_blocks_parse_like_the_line_reader(tmp_path, block_bytes, final_newline):
    # Workers parse raw blocks; whatever the block size, they must see the same documents, line
    # numbers and faults as the line-by-line reader.
    path = tmp_path / "a.jsonl"
    write_jsonl_with_faults(path)
    if not final_newline:
        path.write_bytes(path.read_bytes().rstrip(b"\n"))
    stats = ReadStats()
    expected = [(doc.text, int(doc.location.rsplit(":", 1)[1])) for doc in iter_file(path, stats=stats)]
    texts, lines, skips = [], [], []
    for first_line, block in read_jsonl_blocks(path, block_bytes):
        assert block.endswith(b"\n") or block == path.read_bytes()[-len(block):], "blocks hold whole lines"
        block_texts, block_lines, block_skips, block_line_count = parse_jsonl_block(block, first_line, "text")
        assert block_line_count == block.count(b"\n") + (not block.endswith(b"\n"))
        texts += block_texts
        lines += block_lines
        skips += block_skips
    assert list(zip(texts, lines)) == expected
    assert sorted(skip.reason for _, skip in skips) == sorted(
        reason for reason, count in stats.skipped.items() for _ in range(count))
    assert [line for line, _ in skips] == [2, 3, 4, 5]
    assert parse_jsonl_block(b"", 1, "text") == ([], [], [], 0)


def test_strict_raises_naming_file_and_line(tmp_path):
    path = tmp_path / "a.jsonl"
    write_jsonl_with_faults(path)
    with pytest.raises(CorpusError, match=r"a\.jsonl:2: malformed JSON.*Fix"):
        list(iter_file(path, strict=True))


def test_invalid_utf8_in_text_file_skips_only_that_line(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("一行目\n".encode() + b"bad \xc3\x28 line\n" + "三行目\n".encode())
    stats = ReadStats()
    assert [d.text for d in iter_file(path, stats=stats)] == ["一行目", "三行目"]
    assert stats.skipped == {"invalid_utf8": 1} and stats.examples["invalid_utf8"] == [f"{path}:2"]


@pytest.mark.parametrize("unit,expected", [
    ("line", ["a b", "c", "d"]),
    ("paragraph", ["a b\nc", "d"]),
    ("file", ["a b\nc\n\nd"]),
])
def test_text_units(tmp_path, unit, expected):
    path = tmp_path / "t.txt"
    path.write_text("a b\nc\n\nd\n", encoding="utf-8")
    assert [d.text for d in iter_file(path, text_unit=unit)] == expected


def test_compressed_jsonl(tmp_path):
    import zstandard

    payload = "".join(json.dumps({"content": f"doc {i}"}) + "\n" for i in range(3)).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(payload))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(payload))
    docs = list(iter_documents([str(tmp_path / "*.jsonl.*")], text_field="content"))
    assert [d.text for d in docs] == ["doc 0", "doc 1", "doc 2"] * 2


def test_parquet_by_row_group_and_hf_dataset(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None, "c", ""]}), tmp_path / "p.parquet", row_group_size=2)
    datasets.Dataset.from_dict({"text": ["x", "y"]}).save_to_disk(str(tmp_path / "ds"))
    stats = ReadStats()
    docs = list(iter_documents([str(tmp_path)], stats=stats))
    assert [(d.text, d.location.rsplit(":", 1)[1]) for d in docs] == [("x", "0"), ("y", "1"), ("a", "0"), ("c", "2")]  # sorted: ds/ before p.parquet
    assert detect_format(tmp_path / "ds") == "hf"
    assert stats.skipped == {"missing_field": 1, "empty_text": 1}


def test_empty_and_unreadable_files_are_counted(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    stats = ReadStats()
    assert list(iter_documents([str(tmp_path / "*")], stats=stats)) == []
    assert stats.skipped == {"empty_file": 1, "unreadable_file": 1}


def test_expand_inputs_sorts_dedupes_and_names_a_pattern_matching_nothing(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ("b.jsonl", "a.jsonl", "sub/c.txt"):
        (tmp_path / name).write_text("{}")
    paths = expand_inputs([str(tmp_path / "**" / "*.*"), str(tmp_path / "a.jsonl")])
    assert [p.name for p in paths] == ["a.jsonl", "b.jsonl", "c.txt"]
    with pytest.raises(CorpusError, match="nothing-here"):
        expand_inputs([str(tmp_path / "nothing-here" / "*.jsonl")])


def test_unknown_extension_says_how_to_fix(tmp_path):
    with pytest.raises(CorpusError, match="cannot tell the format"):
        detect_format(tmp_path / "data.bin")


def test_read_stats_merge_caps_examples():
    a, b = ReadStats(), ReadStats()
    for i in range(4):
        a.skip("malformed_json", f"a:{i}")
        b.skip("malformed_json", f"b:{i}")
    a.merge(b)
    assert a.skipped["malformed_json"] == 8 and len(a.examples["malformed_json"]) == 5
    assert a.to_dict()["skipped"] == {"malformed_json": 8}


def test_replace_dir_swaps_whole_folders_and_leaves_nothing_behind(tmp_path):
    from common.files import replace_dir, write_text_atomic

    target = tmp_path / "out"
    for version in ("v1", "v2"):
        new = tmp_path / f".out.tmp-{version}"
        new.mkdir()
        write_text_atomic(new / "file.txt", version)
        replace_dir(new, target)
        assert (target / "file.txt").read_text() == version and not new.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "no temporary or set-aside folder is left"
