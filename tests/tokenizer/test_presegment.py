"""tokenizer.domains.<d>.presegment: the ja model's pieces stay inside the analyzer's words; clear config errors."""
from __future__ import annotations

import json
import sys

import pytest

from tests.tokenizer.conftest import tiny_overrides
from tokenizer.cli import main
from tokenizer.presegment import (DELIMITER, PresegmentStats, coverage_with_delimiters, crossing_tokens,
                                  load_analyzer, segment_line, word_boundaries)


def words_of(line: str) -> list[str]:
    """A stand-in analyzer: words are runs of one script (kana, kanji, latin), whitespace dropped."""
    import re

    return re.findall(r"[ぁ-ん]+|[ァ-ヶー]+|[一-龯]+|[A-Za-z]+|\S", line)


def test_boundaries_only_between_non_spaces():
    line = "ls コマンドは一覧を表示"
    cuts = word_boundaries(line, words_of)
    # ls|▁コマンド: the space already separates them (a delimiter there would forbid '▁コマンド').
    assert [line[:c][-1] + "|" + line[c] for c in cuts] == ["ド|は", "は|一", "覧|を", "を|表"]
    segmented, count = segment_line(line, words_of)
    assert count == 4 and segmented.replace(DELIMITER, "") == line
    assert segment_line("a" + DELIMITER + "b", words_of)[0] == "ab", "a delimiter in the text is not a boundary"


def test_crossing_tokens_and_coverage():
    # tokens [0,3) [3,4) [4,9): a boundary at 2 lies inside the first, one at 4 is between tokens.
    assert crossing_tokens([(0, 3), (3, 4), (4, 9)], [2, 4]) == 1
    assert crossing_tokens([(0, 3), (3, 4), (4, 9)], [1, 2, 5]) == 2
    stats = PresegmentStats("x", lines=1, chars=600, boundaries=400)
    # The same uncovered mass: (1 - c') * 1000 == (1 - 0.9995) * 600.
    assert coverage_with_delimiters(0.9995, stats) == pytest.approx(1 - 0.0005 * 0.6)
    assert coverage_with_delimiters(1.0, stats) == 1.0


def test_bad_value_names_the_field(corpus, tmp_path, capsys):
    code = main(["build", *tiny_overrides(corpus, tmp_path / "o"), "tokenizer.domains.ja.presegment=mecab"])
    err = capsys.readouterr().err
    assert code == 1 and "tokenizer.domains.ja.presegment='mecab'" in err and "none, fugashi, sudachi" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("analyzer,module,install", [
    ("fugashi", "fugashi", "pip install fugashi unidic-lite"),
    ("fugashi", "unidic_lite", "pip install fugashi unidic-lite"),
    ("sudachi", "sudachipy", "pip install sudachipy sudachidict_core"),
])
def test_missing_analyzer_names_the_pip_install(corpus, tmp_path, capsys, monkeypatch, analyzer, module, install):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    code = main(["build", *tiny_overrides(corpus, tmp_path / "o"), f"tokenizer.domains.ja.presegment={analyzer}"])
    err = capsys.readouterr().err
    assert code == 1 and f"tokenizer.domains.ja.presegment={analyzer} needs" in err and install in err, err
    assert not (tmp_path / "o").exists()


def training_segments(path) -> str:
    """The words SentencePiece trains on, as it sees them ('▁' for spaces and the line's prefix), joined by NULs."""
    segments = []
    for line in path.read_text(encoding="utf-8").splitlines():
        segments += ("▁" + line.replace(" ", "▁")).split(DELIMITER)
    return "\0".join(segments)


def multi_char_pieces(model) -> list[str]:
    from tokenizer.merge import load_proto

    proto = load_proto(model)
    return [p.piece for p in proto.pieces if p.type == p.NORMAL and len(p.piece.lstrip("▁")) >= 2]


@pytest.mark.slow
def test_fugashi_presegmented_ja_model_never_crosses_a_word(corpus, built, tmp_path, capsys):
    pytest.importorskip("fugashi", reason="the test extra installs fugashi and unidic-lite (pyproject.toml)")
    out = tmp_path / "pre"
    # The small fixture supports fewer pieces once no piece may span two words.
    args = tiny_overrides(corpus, out, **{"tokenizer.domains.ja.presegment": "fugashi", "keep_work": "true",
                                          "tokenizer.domains.ja.vocab_size": 400})
    assert main(["build", *args]) == 0, capsys.readouterr().err
    samples = out.with_name(out.name + ".work") / "samples"
    words = training_segments(samples / "ja.train.fugashi.txt")

    pieces = multi_char_pieces(out / "domains" / "ja.model")
    assert len(pieces) > 100
    crossing = [p for p in pieces if p not in words]
    assert crossing == [], f"pieces spanning two words: {crossing[:10]}"
    # The same text without presegmentation (the shared build) does learn pieces across words.
    assert [p for p in multi_char_pieces(built / "domains" / "ja.model") if p not in words]

    # Training only: the merge, the baseline and the held-out text see plain text, and ids round-trip.
    assert DELIMITER not in (samples / "ja.train.txt").read_text(encoding="utf-8")
    assert not [p for p in multi_char_pieces(out / "tokenizer.model") if DELIMITER in p]
    meta = json.loads((out / "tokenizer_meta.json").read_text())
    assert meta["samples"]["ja"]["presegment"]["boundaries"] > 0
    assert meta["config"]["domains"]["ja"]["presegment"] == "fugashi"
    ev = json.loads((out / "eval.json").read_text())
    assert all(m["roundtrip_ok"] for m in ev["results"]["merged"]["domains"].values())
    assert all(r["mismatches"] == 0 for r in ev["hf_parity"].values())


def test_analyzer_words_cover_the_line():
    pytest.importorskip("fugashi", reason="the test extra installs fugashi and unidic-lite (pyproject.toml)")
    analyze = load_analyzer("fugashi")
    line = "東京都に住んでいる学生です。ls -l で一覧を表示する"
    cuts = word_boundaries(line, analyze)
    pieces = [line[a:b] for a, b in zip([0] + cuts, cuts + [len(line)])]
    assert "".join(pieces) == line and "住ん" in pieces and "ls -l で" not in pieces
