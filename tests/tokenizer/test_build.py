"""A real build on small real text: merge invariants, round-trip, HF-id equality, tokenizer info."""
from __future__ import annotations

import json

import pytest

from tokenizer import load_tokenizer_info, tokenizer_sha256
from tests.tokenizer.conftest import TINY_SIZES

pytestmark = pytest.mark.slow

TRICKY_TEXTS = [
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。",
    "def f(x):\n    if x:\n        return  x  *  2\n\treturn None\n\n\n",
    "   leading spaces, trailing spaces   ",
    "The roots of $a x^2 + b x + c = 0$ are $x = \\frac{-b \\pm \\sqrt{b^2 - 4ac}}{2a}$.",
    "rare characters fall back to bytes: 🦜 𠮷 ꙮ",
    "\nstarts with a newline\n\n  then indentation",
    "数字 1234567890 と English が混ざった文。",
    "",
]


def test_folder_holds_the_contract_files(built):
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "tokenizer_meta.json", "eval.json"):
        assert (built / name).is_file(), name
    assert not any(p.name.startswith(".") for p in built.parent.iterdir()), "a temporary folder was left behind"


def test_merged_model_invariants(built):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(built / "tokenizer.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    assert sp.get_piece_size() == TINY_SIZES["total_vocab"]
    assert len(set(pieces)) == len(pieces), "duplicate pieces"
    assert pieces[:5] == ["<unk>", "<s>", "</s>", "<pad>", "\n"]
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, 3)
    assert [sp.is_byte(i) for i in range(5, 5 + 256)] == [True] * 256 and pieces[5] == "<0x00>"
    scores = [sp.get_score(i) for i in range(5 + 256, sp.get_piece_size())]
    assert all(s < 0 for s in scores), "learned pieces need real (negative log-prob) scores, not 0"
    assert len(set(scores)) > 20, "scores look untuned"


def test_roundtrip_and_hf_ids_identical(built):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(built / "tokenizer.model"))
    hf = AutoTokenizer.from_pretrained(str(built))
    heldout = json.loads((built / "eval.json").read_text())
    assert heldout["hf_parity"] and all(r["mismatches"] == 0 for r in heldout["hf_parity"].values())
    assert all(r["roundtrip_ok"] for r in heldout["results"]["merged"]["domains"].values())
    for text in TRICKY_TEXTS:
        ids = sp.encode(text)
        assert sp.decode(ids) == text
        assert hf(text, add_special_tokens=False)["input_ids"] == ids, repr(text)
        assert hf.decode(ids) == text, repr(text)
    assert any(sp.is_byte(i) for i in sp.encode("🦜")), "unseen characters must use byte fallback"
    assert hf.bos_token == "<s>" and hf.eos_token == "</s>" and hf.pad_token == "<pad>"
    assert hf.convert_tokens_to_ids("<pad>") == 3


def test_whitespace_runs_survive(built):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(built / "tokenizer.model"))
    for text in ("a    b", "x\n        y", "  \t  "):
        assert sp.decode(sp.encode(text)) == text


def test_tokenizer_info(built):
    info = load_tokenizer_info(built)
    assert info.sha256 == tokenizer_sha256(built / "tokenizer.model")
    assert (info.vocab_size, info.unk_id, info.bos_id, info.eos_id, info.pad_id) == (TINY_SIZES["total_vocab"], 0, 1, 2, 3)


def test_eval_reports_baseline_and_metrics(built):
    payload = json.loads((built / "eval.json").read_text())
    results = payload["results"]
    assert set(results) == {"merged", "joint_baseline"}
    assert results["joint_baseline"]["vocab_size"] == results["merged"]["vocab_size"]
    ja = results["merged"]["domains"]["ja"]
    assert ja["chars_per_token"] == pytest.approx(ja["chars"] / ja["tokens"]) and ja["unk_rate"] == 0
    assert ja["byte_fallback_share"] > 0, "the fixture's rare kanji (coverage 0.98) must fall back to bytes"
    assert results["merged"]["domains"]["code"]["chars_per_token"] > 1.5  # ~2 with a 1000-piece vocabulary
    assert payload["comparison"]["total_tokens_ratio"] > 0


def test_incomplete_folder_is_refused(built, tmp_path):
    import shutil

    from tokenizer.info import TokenizerNotFoundError

    copy = tmp_path / "tok"
    shutil.copytree(built, copy)
    (copy / "tokenizer.json").unlink()
    with pytest.raises(TokenizerNotFoundError, match="missing tokenizer.json"):
        load_tokenizer_info(copy)
    with pytest.raises(TokenizerNotFoundError, match="does not exist"):
        load_tokenizer_info(tmp_path / "nope")


def test_pad_to_multiple_and_eval_cli(corpus, tmp_path, capsys):
    from tests.tokenizer.conftest import tiny_overrides
    from tokenizer.cli import main

    out = tmp_path / "padded"
    args = tiny_overrides(corpus, out, **{"tokenizer.pad_to_multiple_of": 64, "tokenizer.total_vocab": 900,
                                         "tokenizer.evaluate.baseline": "false", "tokenizer.merge.em_iterations": 1})
    assert main(["build", *args]) == 0
    assert load_tokenizer_info(out).vocab_size == 960
    capsys.readouterr()
    assert main(["eval", str(out), "--texts", f"ja={corpus['ja']}", f"math={corpus['math']}",
                 "--compare", f"hf={out}", "--json", str(tmp_path / "e.json")]) == 0
    table = capsys.readouterr().out
    assert "ja" in table and "math" in table and "hf" in table
    results = json.loads((tmp_path / "e.json").read_text())["results"]
    assert results["padded"]["domains"]["ja"]["tokens"] == results["hf"]["domains"]["ja"]["tokens"]


def test_hf_ids_identical_on_very_long_documents(built, corpus):
    """SentencePiece sums path scores in float32, HF in float64: the merged model's scores sit on a
    binary grid (merge.score_quantum) so both sums are exact and long documents split alike."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(built / "tokenizer.model"))
    hf = AutoTokenizer.from_pretrained(str(built))
    # Every fixture file (jsonl lines included) back to back: one document of tens of thousands of tokens.
    long_text = "\n\n".join(corpus[domain].read_text(encoding="utf-8") for domain in ("ja", "code", "math", "en"))
    ids = sp.encode(long_text)
    assert len(ids) > 20_000, "the test needs a document far longer than float32 rounding tolerates"
    assert hf(long_text, add_special_tokens=False)["input_ids"] == ids


def test_quantized_scores_are_on_the_grid():
    from tokenizer.merge import quantize_scores
    from tokenizer.proto import pb

    proto = pb().ModelProto()
    normal = pb().ModelProto.SentencePiece.NORMAL
    for score in (-3.14159, -10.0625, -7.3):
        proto.pieces.add(piece=f"p{score}", score=score, type=normal)
    proto.pieces.add(piece="<unk>", score=0.0, type=pb().ModelProto.SentencePiece.UNKNOWN)
    assert quantize_scores(proto, 0.125) == 3
    assert [p.score for p in proto.pieces] == [-3.125, -10.0, -7.25, 0.0]
    with pytest.raises(ValueError, match="power of two"):
        quantize_scores(proto, 0.1)



def test_bpe_build_round_trips_with_identical_hf_ids(corpus, tmp_path):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    from tests.tokenizer.conftest import tiny_overrides
    from tokenizer.cli import main

    out = tmp_path / "bpe"
    # BPE models share more pieces across domains than unigram ones: give them ~10% more room.
    overrides = [o.replace(f"vocab_size={TINY_SIZES['en']}", f"vocab_size={TINY_SIZES['en'] + 60}")
                 for o in tiny_overrides(corpus, out)]
    assert main(["build", *overrides, "tokenizer.model_type=bpe"]) == 0
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    assert sp.get_piece_size() == TINY_SIZES["total_vocab"]
    report = json.loads((out / "eval.json").read_text())
    assert all(r["roundtrip_ok"] for r in report["results"]["merged"]["domains"].values())
    assert all(r["mismatches"] == 0 for r in report["hf_parity"].values())
    hf = AutoTokenizer.from_pretrained(str(out))
    for text in TRICKY_TEXTS:
        assert hf(text, add_special_tokens=False)["input_ids"] == sp.encode(text), repr(text)
