"""tokenizer.domains.<d>.presegment: the ja model's pieces stay inside the analyzer's words; clear config errors."""
from __future__ import annotations

import json
import sys

import pytest

from common.status import BAD_INPUT
from tests.tokenizer.conftest import tiny_overrides
from tokenizer.cli import main
from tokenizer.presegment import PresegmentStats, count_words, crossing_tokens, load_analyzer, split_words, word_boundaries


def words_of(line: str) -> list[str]:
    """A stand-in analyzer: words are runs of one script (kana, kanji, latin), whitespace dropped."""
    import re

    return re.findall(r"[ぁ-ん]+|[ァ-ヶー]+|[一-龯]+|[A-Za-z]+|\S", line)


def test_boundaries_only_between_non_spaces():
    line = "ls コマンドは一覧を表示"
    # ls|▁コマンド: the space already separates them (SentencePiece starts '▁コマンド' there).
    assert split_words(line, words_of) == ["ls コマンド", "は", "一覧", "を", "表示"]
    stats = PresegmentStats("x")
    counts = count_words([line, "一覧\tを見る"], words_of, dummy_prefix=True, stats=stats)
    # The line's first word carries the dummy prefix's space; a tab (the word list's separator) is a boundary.
    assert counts == {" ls コマンド": 1, "は": 1, "一覧": 1, " 一覧": 1, "を": 2, "表示": 1, "見": 1, "る": 1}
    assert (stats.lines, stats.words, stats.tabs) == (2, 8, 1)
    assert count_words([line], words_of, dummy_prefix=False, stats=PresegmentStats("x"))["ls コマンド"] == 1


def test_crossing_tokens():
    # tokens [0,3) [3,4) [4,9): a boundary at 2 lies inside the first, one at 4 is between tokens.
    assert crossing_tokens([(0, 3), (3, 4), (4, 9)], [2, 4]) == 1
    assert crossing_tokens([(0, 3), (3, 4), (4, 9)], [1, 2, 5]) == 2


def test_bad_value_names_the_field(corpus, tmp_path, capsys):
    code = main(["build", *tiny_overrides(corpus, tmp_path / "o"), "tokenizer.domains.ja.presegment=mecab"])
    err = capsys.readouterr().err
    assert code == BAD_INPUT and "tokenizer.domains.ja.presegment='mecab'" in err and "none, fugashi, sudachi" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_presegment_needs_whitespace_kept(corpus, tmp_path, capsys):
    pytest.importorskip("fugashi", reason="the test extra installs fugashi and unidic-lite (pyproject.toml)")
    code = main(["build", *tiny_overrides(corpus, tmp_path / "o"), "tokenizer.domains.ja.presegment=fugashi",
                 "tokenizer.remove_extra_whitespaces=true"])
    err = capsys.readouterr().err
    assert code == BAD_INPUT and "tokenizer.remove_extra_whitespaces=false" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("analyzer,module,install", [
    ("fugashi", "fugashi", "pip install fugashi unidic-lite"),
    ("fugashi", "unidic_lite", "pip install fugashi unidic-lite"),
    ("sudachi", "sudachipy", "pip install sudachipy sudachidict_core"),
])
def test_missing_analyzer_names_the_pip_install(corpus, tmp_path, capsys, monkeypatch, analyzer, module, install):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    code = main(["build", *tiny_overrides(corpus, tmp_path / "o"), f"tokenizer.domains.ja.presegment={analyzer}"])
    err = capsys.readouterr().err
    assert code == BAD_INPUT and f"tokenizer.domains.ja.presegment={analyzer} needs" in err and install in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def template_japanese(path):
    """Japanese whose phrases recur in fixed combinations, so a model without presegmentation learns pieces
    across words (は東京, を読んで…): every subject × place × object × predicate, 30 documents."""
    import itertools

    who = ["学生は", "先生は", "子供たちは", "私の友人は", "会社員の父は", "隣に住む姉は"]
    where = ["東京の図書館で", "駅の近くの喫茶店で", "大学の研究室で", "静かな公園のベンチで", "家の台所で"]
    what = ["新しい本を", "日本語の文章を", "昔の手紙を", "難しい問題を", "温かいコーヒーを", "長い説明書を",
            "古い地図を", "友達の写真を", "小さな猫を"]
    how = ["ゆっくり読んでいる。", "毎日書いている。", "ずっと探していた。", "何度も考えている。", "静かに楽しんだ。",
           "丁寧に片付けた。", "急いで届けた。"]
    docs = ["".join(a + b + c + d for c, d in itertools.product(what, how)) for a, b in itertools.product(who, where)]
    path.write_text("\n\n".join(docs), encoding="utf-8")
    return path


def ja_only_build(corpus, ja, out, presegment):
    from tokenizer.cli import main as cli

    others = [o for d in ("en", "code", "math") for o in (f"tokenizer.domains.{d}.enabled=false",
                                                         f"tokenizer.domains.{d}.vocab_size=16")]
    args = tiny_overrides(corpus, out, **{"tokenizer.inputs.ja": ja, "tokenizer.total_vocab": 400,
                                          "tokenizer.domains.ja.vocab_size": 400,
                                          "tokenizer.domains.ja.character_coverage": 1.0, "keep_work": "true",
                                          "tokenizer.domains.ja.presegment": presegment})
    assert cli(["build", *args, *others]) == 0
    return out


def multi_char_pieces(model) -> list[str]:
    from tokenizer.merge import load_proto

    return [p.piece for p in load_proto(model).pieces if p.type == p.NORMAL and len(p.piece.lstrip("▁")) >= 2]


@pytest.mark.slow
def test_fugashi_presegmented_ja_model_never_crosses_a_word(corpus, tmp_path):
    pytest.importorskip("fugashi", reason="the test extra installs fugashi and unidic-lite (pyproject.toml)")
    from tokenizer.merge import load_proto

    ja = template_japanese(tmp_path / "ja.txt")
    out = ja_only_build(corpus, ja, tmp_path / "pre", "fugashi")
    samples = out.with_name(out.name + ".work") / "samples"
    words = {line.split("\t")[0].replace(" ", "▁") for line in
             (samples / "ja.words.fugashi.tsv").read_text(encoding="utf-8").splitlines()}
    in_words = "\0".join(words)

    pieces = multi_char_pieces(out / "domains" / "ja.model")
    assert len(pieces) >= 20 and {"公園", "ベンチ", "台所"} <= set(pieces)
    assert [p for p in pieces if p not in in_words] == [], "every piece lies inside one of fugashi's words"
    # The same text without presegmentation learns pieces across words.
    plain = multi_char_pieces(ja_only_build(corpus, ja, tmp_path / "plain", "none") / "domains" / "ja.model")
    assert len([p for p in plain if p not in in_words]) >= 10

    # Training only: the model encodes running text with the dummy prefix, the sample stays plain, ids round-trip.
    assert load_proto(out / "domains" / "ja.model").normalizer_spec.add_dummy_prefix
    assert not (samples / "ja.train.txt").read_text(encoding="utf-8").count("\t")
    meta = json.loads((out / "tokenizer_meta.json").read_text())
    assert meta["samples"]["ja"]["presegmented"]["fugashi"]["distinct"] == len(words)
    assert meta["config"]["domains"]["ja"]["presegment"] == "fugashi"
    ev = json.loads((out / "eval.json").read_text())
    assert ev["results"]["merged"]["domains"]["ja"]["roundtrip_ok"]
    assert all(r["mismatches"] == 0 for r in ev["hf_parity"].values())


def test_analyzer_words_cover_the_line():
    pytest.importorskip("fugashi", reason="the test extra installs fugashi and unidic-lite (pyproject.toml)")
    analyze = load_analyzer("fugashi")
    line = "東京都に住んでいる学生です。ls -l で一覧を表示する"
    cuts = word_boundaries(line, analyze)
    pieces = [line[a:b] for a, b in zip([0] + cuts, cuts + [len(line)])]
    assert "".join(pieces) == line and "住ん" in pieces and "ls -l で" not in pieces


def test_training_input_follows_each_builds_config(tmp_path):
    """Builds sharing one sample (a sweep over presegment=none,fugashi) each train on their own input."""
    pytest.importorskip("fugashi", reason="the test extra installs fugashi and unidic-lite (pyproject.toml)")
    from tokenizer.config import DomainConfig, TokenizerConfig
    from tokenizer.sample import DomainSample
    from tokenizer.train_spm import domain_training

    train = tmp_path / "ja.train.txt"
    train.write_text("東京都に住んでいる。\n名前はまだない。\n", encoding="utf-8")
    sample = DomainSample("ja", train, tmp_path / "ja.heldout.jsonl")
    plain, fugashi = DomainConfig(), DomainConfig(presegment="fugashi")
    cfg = TokenizerConfig(domains={"ja": plain})

    inputs, options = domain_training(cfg, fugashi, sample)
    assert inputs == [tmp_path / "ja.words.fugashi.tsv"]
    assert options["input_format"] == "tsv" and options["add_dummy_prefix"] is False
    assert {" 東京", "は", "。"} <= {line.split("\t")[0] for line in inputs[0].read_text(encoding="utf-8").splitlines()}
    assert sample.presegmented["fugashi"].lines == 2
    inputs, options = domain_training(cfg, plain, sample)
    assert inputs == [train] and "input_format" not in options and options["add_dummy_prefix"] is True
