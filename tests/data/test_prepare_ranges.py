"""Plain jsonl files reach the workers as byte ranges they read themselves (data/prepare.py jsonl_ranges,
data/workers.py read_range): the same blocks as the parent's reader, line numbers that run across blocks, and
one clear error for a file changed mid-run."""
from __future__ import annotations

import gzip
import json

import pytest

from common.corpus import CorpusError, read_jsonl_blocks
from data.config import CleanConfig
from data.prepare import jsonl_ranges, prepare
from data.workers import read_range
from tests.data.helpers import domain, make_config

BAD_LINES = {57: b'{"text": "unterminated\n', 143: json.dumps({"body": "no text"}).encode() + b"\n"}
SHORT_LINE = 190


def many_lines(en_texts: list[str]) -> bytes:
    """200 jsonl lines: two bad records and one too-short document far into the file (many blocks of 2 KiB in)."""
    lines = []
    for number in range(1, 201):
        text = "tiny" if number == SHORT_LINE else f"{number} {en_texts[number % len(en_texts)][:300]}"
        lines.append(BAD_LINES.get(number, json.dumps({"text": text}).encode() + b"\n"))
    return b"".join(lines)


def test_ranges_are_the_blocks_the_parents_reader_cuts(tmp_path, en_texts):
    path = tmp_path / "in.jsonl"
    path.write_bytes(many_lines(en_texts)[:-1])  # no newline after the last line
    size = path.stat().st_size
    for block_bytes in (1, 700, 2048, size, 2 * size):
        for span in (None, (0, size), _line_start(path, size // 3), _line_start(path, size // 2)):
            blocks = [block for _, block in read_jsonl_blocks(path, block_bytes, span)]
            ranges = list(jsonl_ranges(path, block_bytes, span))
            assert [read_range(*each) for each in ranges] == blocks
    assert [read_range(*each) for each in jsonl_ranges(path, 2048)][-1].endswith(b"}")


def _line_start(path, near: int) -> tuple[int, int]:
    """A span from the first line start after `near` to the end (as data/task_plan.py cuts a piece)."""
    data = path.read_bytes()
    return data.index(b"\n", near) + 1, len(data)


@pytest.mark.parametrize("workers", [0, 2])
def test_locations_count_lines_across_blocks(tmp_path, tokenizer_dir, en_texts, workers):
    plain = tmp_path / "in" / "plain.jsonl"
    plain.parent.mkdir()
    plain.write_bytes(many_lines(en_texts))
    packed = tmp_path / "in" / "packed.jsonl.gz"  # compressed: the parent reads it, the same numbering
    packed.write_bytes(gzip.compress(many_lines(en_texts)))
    for path in (plain, packed):
        dom = domain([path], clean=CleanConfig(min_chars=20, dedup="off"))
        cfg = make_config(tmp_path / f"root_{path.stem}", tokenizer_dir, {"en": dom}, workers=workers, chunk_mb=0.002)
        record = prepare(cfg)["domains"]["en"]
        assert record["docs_read"] == 198 and record["skipped"] == {"malformed_json": 1, "missing_field": 1}
        assert record["drop_examples"] == {"malformed_json": [f"{path}:57"], "missing_field": [f"{path}:143"],
                                           "too_short": [f"{path}:{SHORT_LINE}"]}
        cfg.strict = True
        with pytest.raises(CorpusError, match=rf"{path.name}:57: malformed JSON"):
            prepare(cfg)


def test_a_file_changed_after_it_was_cut_is_one_clear_error(tmp_path, en_texts):
    path = tmp_path / "in.jsonl"
    path.write_bytes(many_lines(en_texts))
    ranges = list(jsonl_ranges(path, 4096))
    path.write_bytes(many_lines(en_texts)[:5000])  # truncated after the parent cut it
    with pytest.raises(CorpusError, match=rf"{path} changed while it was read: .* Fix: leave the inputs alone"):
        read_range(*ranges[-1])
    path.unlink()
    with pytest.raises(CorpusError, match=rf"{path} could not be read at byte 0 .*No such file"):
        read_range(*ranges[0])
