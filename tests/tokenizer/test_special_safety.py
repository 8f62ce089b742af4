"""Text never becomes a special token: SentencePiece and the exported HF tokenizer give the same ids for
any text, including literal "<s>", "</s>", "<unk>", "<pad>", "▁", whitespace runs, CR/CRLF and rare
characters (a seeded property test: hypothesis is not a dependency)."""
from __future__ import annotations

import json
import random

import pytest

from common.status import BAD_INPUT

pytestmark = pytest.mark.slow

POOL = [
    "<s>", "</s>", "<unk>", "<pad>", "<", ">", "/", "s", "(?P<s>", r"\d+)", "<s>x</s>",  # special literals, halves
    " ", "  ", "    ", "\t", "\t\t", "\n", "\n\n", "\r", "\r\n", "\n\t\t", "\n    ", " \n ",  # whitespace runs
    "▁", "▁▁", " ▁",  # SentencePiece's own space symbol typed as text
    "😀", "🦜", "👩‍💻", "𠮷", "鷗", "吾輩は猫である", "数字", "the", "return", "def f(x):", "x = 1",
    "e\u0301", "\u0308", "a\u0323\u0302",  # combining marks
    "ＡＢＣ", "１２３", "　", "（全角）",  # full-width forms and the ideographic space
]
CASES = 3000


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(POOL) for _ in range(rng.randint(1, 12))) for _ in range(count)]


@pytest.fixture(scope="module")
def encoders(built):
    import sentencepiece as spm
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(built / "tokenizer.model"))
    return sp, Tokenizer.from_file(str(built / "tokenizer.json")), AutoTokenizer.from_pretrained(str(built))


def test_random_texts_give_identical_ids_and_never_a_special(encoders):
    sp, raw, hf = encoders
    texts = random_texts(14, CASES)
    specials = {sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()}
    raw_ids = [e.ids for e in raw.encode_batch(texts, add_special_tokens=False)]
    hf_ids = hf(texts, add_special_tokens=False)["input_ids"]
    for text, a, b in zip(texts, raw_ids, hf_ids):
        ids = sp.encode(text)
        assert not specials & set(ids), f"SentencePiece made a special id of {text!r}"
        assert a == ids, f"tokenizers ids differ on {text!r}"
        assert b == ids, f"transformers ids differ on {text!r}"
        assert hf.decode(ids) == sp.decode(ids), f"decoded text differs on {text!r}"
        if sp.decode(ids) == text:
            assert raw.decode(ids) == text, repr(text)
    # The pool's literals do come through as text: the property is not vacuous.
    assert sum("<s>" in t for t in texts) > CASES // 10
    assert sum(sp.decode(sp.encode(t)) == t for t in texts) > CASES // 2


def test_literal_specials_are_characters_with_no_extra_space(encoders):
    sp, raw, hf = encoders
    for text in ("(?P<s>x)", "<s>", "a</s>b", "<unk>", "x<pad>"):
        pieces = sp.encode(text, out_type=str)
        assert "".join(pieces).replace("▁", " ").lstrip(" ") == text  # no "▁" inserted after a literal
        assert raw.encode(text, add_special_tokens=False).tokens == pieces
        assert hf.decode(hf(text, add_special_tokens=False)["input_ids"]) == text


def test_specials_still_known_to_transformers_by_id(encoders, built):
    _, _, hf = encoders
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 3, 0)
    assert hf.decode([1, *hf("hi", add_special_tokens=False)["input_ids"], 2], skip_special_tokens=True) == "hi"
    assert json.loads((built / "tokenizer_config.json").read_text())["split_special_tokens"] is True


def test_underscore_symbol_is_a_space(encoders):
    """Documented behaviour: a literal "▁" is SentencePiece's space symbol, so it decodes as " " in both."""
    sp, _, hf = encoders
    ids = sp.encode("a▁b")
    assert ids == sp.encode("a b") and hf.decode(ids) == "a b" == sp.decode(ids)


def test_build_checks_the_probes(built):
    parity = json.loads((built / "tokenizer_meta.json").read_text())["hf_parity"]
    assert parity["_probes"]["docs"] > 5 and parity["_probes"]["mismatches"] == 0


def test_special_characters_are_kept_as_pieces():
    """A '<' no domain learned is still a piece, so HF's lattice never reaches for the '<s>' entry."""
    from tokenizer.merge import DomainPieces, select_pieces, special_chars

    chars = special_chars(["<unk>", "<s>", "</s>", "<pad>"])
    assert chars == ["<", "u", "n", "k", ">", "s", "/", "p", "a", "d"]
    domain = DomainPieces("ja", [("吾", -1.0), ("輩", -2.0), ("吾輩", -3.0)] + [(f"x{i}", -4.0 - i) for i in range(20)], 1.0, 30)
    chosen = dict(select_pieces([domain], 16, reserved={"<s>"}, required_chars=chars))
    assert all(ch in chosen for ch in chars) and chosen["<"] == "specials" and "吾" in chosen and len(chosen) == 16


def test_an_export_that_would_turn_special_text_into_specials_is_refused(tmp_path):
    """A SentencePiece model without pieces (or byte fallback) for the characters of "<s>": its HF export would
    read that text as the special token, so `ayumi tokenizer export` (build and expand alike) refuses it in one line
    and writes nothing."""
    import subprocess
    import sys

    import sentencepiece as spm

    from tests.helpers import REPO

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(("the quick brown fox jumps over the lazy dog " * 50 + "\n") * 20)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "plain"), vocab_size=30,
                                   model_type="unigram", byte_fallback=False, character_coverage=1.0)
    done = subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "tokenizer", "export", str(tmp_path / "plain.model"),
                           str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == BAD_INPUT, done.stderr[-2000:]  # a model file that cannot be exported is bad input
    assert done.stderr.startswith(f"ayumi tokenizer export: {tmp_path / 'plain.model'}: the Hugging Face export would "
                                  "encode '<s></s><unk><pad>' as ") and "Traceback" not in done.stderr
    assert not (tmp_path / "out").exists()
