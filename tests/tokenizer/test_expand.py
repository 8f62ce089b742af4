"""`ayumi tokenizer expand`: a base SentencePiece tokenizer (BPE as Llama 2, or unigram) plus a Japanese model's
pieces. Base ids and pieces never change, base-only text tokenizes as before, Japanese gets shorter, and the
exported tokenizer.json gives the same ids as SentencePiece."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.status import BAD_INPUT
from tests.data.helpers import JA_PARAGRAPHS, english_texts
from tests.helpers import REPO
from tokenizer.expand import ExpandError, expand

FIXTURES = Path(__file__).parent / "fixtures"


def train(path: Path, lines: list[str], vocab: int, model_type: str) -> Path:
    import sentencepiece as spm

    corpus = path.with_suffix(".txt")
    corpus.write_text("\n".join(line.replace("\n", " ") for line in lines), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(path.with_suffix("")), vocab_size=vocab,
                                   model_type=model_type, byte_fallback=True, character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    return path.with_suffix(".model")


@pytest.fixture(scope="module")
def texts() -> dict[str, list[str]]:
    ja = [line for line in (FIXTURES / "ja.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
    return {"en": english_texts()[:400], "ja": ja + JA_PARAGRAPHS}


@pytest.fixture(scope="module")
def source(tmp_path_factory, texts) -> Path:
    return train(tmp_path_factory.mktemp("ja") / "ja.model", texts["ja"], 700, "unigram")


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_base_ids_stay_and_japanese_gets_shorter(tmp_path, texts, source, model_type):
    import sentencepiece as spm

    base = train(tmp_path / "base.model", texts["en"], 600, model_type)
    result = expand(base, source, 900, tmp_path / "expanded")
    assert result.base_size == 600 and result.added == 300
    old = spm.SentencePieceProcessor(model_file=str(base))
    new = spm.SentencePieceProcessor(model_file=str(tmp_path / "expanded" / "tokenizer.model"))
    assert new.get_piece_size() == 900
    assert [new.id_to_piece(i) for i in range(600)] == [old.id_to_piece(i) for i in range(600)]
    assert [new.get_score(i) for i in range(600)] == [old.get_score(i) for i in range(600)]
    english = english_texts()[400:440]
    assert [new.encode(t) for t in english] == [old.encode(t) for t in english]  # base-only text: the same ids
    japanese = texts["ja"][-20:]
    before, after = (sum(len(m.encode(t)) for t in japanese) for m in (old, new))
    assert after < 0.8 * before
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tmp_path / "expanded" / "tokenizer.json"))
    for text in english[:5] + japanese[:10]:
        assert hf.encode(text, add_special_tokens=False).ids == new.encode(text)


def test_the_cli_writes_an_ayumi_tokenizer_folder(tmp_path, texts, source):
    from tokenizer import load_tokenizer_info

    base = train(tmp_path / "base.model", texts["en"], 600, "bpe")
    proc = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "tokenizer", "expand", str(base), str(source),
                           "--vocab", "700", "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "600 base pieces (ids unchanged) + 100 new = 700" in proc.stdout
    info = load_tokenizer_info(tmp_path / "out")
    assert info.vocab_size == 700 and info.eos_id == 2
    bad = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "tokenizer", "expand", str(base), str(source),
                          "--vocab", "500", "--out", str(tmp_path / "bad")], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == BAD_INPUT and "not larger than the base's 600 pieces" in bad.stderr
    assert not (tmp_path / "bad").exists()


def test_a_byte_level_base_is_refused_with_the_reason(tmp_path, source):
    (tmp_path / "llama3").mkdir()
    (tmp_path / "llama3" / "tokenizer.json").write_text("{}")
    with pytest.raises(ExpandError, match="byte-level BPE tokenizer"):
        expand(tmp_path / "llama3", source, 1000, tmp_path / "out")
