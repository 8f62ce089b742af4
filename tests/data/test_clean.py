"""Cleaning filters: each is pure, configurable, and names the reason it drops a document."""
import hashlib
import random
import re
import unicodedata

import pytest

from data.clean import Cleaner, DropCounts, content_key, script_share, symbol_share, tidy_whitespace
from data.config import CleanConfig


def test_tidy_whitespace():
    raw = "\ufeff  Title  \r\n\r\nline one\t \nline\x00 two   \n\n\n\n\nend  \n\n"
    assert tidy_whitespace(raw) == "Title\n\nline one\nline two\n\nend"
    assert tidy_whitespace("a   b\t\tc") == "a   b\t\tc"  # spacing inside lines kept (code)
    assert tidy_whitespace("a   b\t\tc", collapse_spaces=True) == "a b c"
    assert tidy_whitespace("    indented\n        more") == "indented\n        more"


def test_normalization_forms():
    text = "ｶﾀｶﾅ ＡＢＣ　１２３ e\u0301"
    assert Cleaner(CleanConfig(normalize="NFKC", tidy_whitespace=False))(text)[0] == "カタカナ ABC 123 é"
    assert Cleaner(CleanConfig(normalize="NFC", tidy_whitespace=False))(text)[0] == "ｶﾀｶﾅ ＡＢＣ　１２３ é"
    assert Cleaner(CleanConfig(normalize="none", tidy_whitespace=False))(text)[0] == text


@pytest.mark.parametrize("cfg, text, reason", [
    (CleanConfig(), " \n\t \n", "empty_after_clean"),
    (CleanConfig(min_chars=10), "short", "too_short"),
    (CleanConfig(max_chars=5), "far too long", "too_long"),
    (CleanConfig(script="ja", min_script_share=0.5), "This is English with 一 kanji", "low_script_share"),
    (CleanConfig(script="latin", min_script_share=0.5), "これは日本語です", "low_script_share"),
    (CleanConfig(max_symbol_share=0.3), "!!! ??? ### $$$ word", "too_many_symbols"),
])
def test_each_filter_names_its_reason(cfg, text, reason):
    assert Cleaner(cfg)(text) == (None, reason)


def test_filters_keep_good_documents():
    cfg = CleanConfig(normalize="NFKC", min_chars=5, max_chars=100, script="ja", min_script_share=0.6, max_symbol_share=0.3)
    assert Cleaner(cfg)("吾輩は猫である。名前はまだ無い。") == ("吾輩は猫である。名前はまだ無い。", None)


def test_script_share():
    assert script_share("ひらがなカタカナ漢字", "ja") == 1.0
    assert script_share("abc かな", "ja") == pytest.approx(2 / 5)
    assert script_share("12345 !!!", "latin") == 0.0  # no letters at all
    assert script_share("Crème brûlée", "latin") == 1.0
    assert symbol_share("a!") == 0.5 and symbol_share("") == 0.0


def test_normalized_key_ignores_spacing_and_width_only():
    key = content_key("Hello world\nsecond line", "normalized")
    assert len(key) == 16
    assert content_key("Hello  world second\tline", "normalized") == key
    assert content_key("Ｈｅｌｌｏ world\nsecond line", "normalized") == key  # full-width letters: NFKC folds them
    assert content_key("Hello world\nsecond line!", "normalized") != key
    assert content_key("hello world\nsecond line", "normalized") != key  # case matters


PY_4 = "def f(x):\n    if x:\n        return 1\n    return 2"
PY_2 = "def f(x):\n  if x:\n    return 1\n  return 2"  # the same code, indented by 2


@pytest.mark.parametrize("mode", ["exact", "off"])
def test_exact_key_is_the_cleaned_bytes(mode):
    for text in (PY_4, "ＡＢＣ１２３ full width", "plain"):
        assert content_key(text, mode) == hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
    assert content_key(PY_4, mode) != content_key(PY_2, mode)
    assert content_key("ＡＢＣ１２３", mode) != content_key("ABC123", mode)


def test_cleaner_key_follows_the_domain_dedup_mode():
    # A code domain (NFC, indentation kept): indentation and width are content under exact only.
    exact, normalized = (Cleaner(CleanConfig(normalize="NFC", dedup=mode)) for mode in ("exact", "normalized"))
    (py_4, _), (py_2, _) = exact(PY_4), exact(PY_2)
    assert py_4 != py_2, "cleaning keeps the indentation"
    assert exact.key(py_4) != exact.key(py_2) and normalized.key(py_4) == normalized.key(py_2)
    wide, narrow = exact("ＡＢＣ１２３")[0], exact("ABC123")[0]
    assert wide == "ＡＢＣ１２３", "NFC keeps the width"
    assert exact.key(wide) != exact.key(narrow) and normalized.key(wide) == normalized.key(narrow)
    assert exact.key(py_4) == exact.key(exact(PY_4 + "  \n\n")[0]), "what cleaning removes is not content"


def test_drop_counts_keep_first_locations_only():
    counts = DropCounts()
    for i in range(8):
        counts.add("too_short", f"f.jsonl:{i}")
    counts.add("duplicate", "g.jsonl:1")
    assert counts.counts == {"too_short": 8, "duplicate": 1} and counts.total == 9
    assert counts.examples["too_short"] == [f"f.jsonl:{i}" for i in range(5)]


def _tidy_by_definition(text: str, collapse_spaces: bool) -> str:
    """tidy_whitespace written the plain way, to check the fast paths against."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ufeff]", "", text)
    if collapse_spaces:
        lines = [" ".join(line.split()) for line in text.split("\n")]
    else:
        lines = [line.rstrip() for line in text.split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _key_by_definition(text: str) -> bytes:
    """The normalized key's definition: blake2b-128 of the NFKC form with every whitespace character removed."""
    canonical = "".join(unicodedata.normalize("NFKC", text).split())
    return hashlib.blake2b(canonical.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def test_fast_paths_agree_with_the_plain_definitions():
    # Every whitespace and control character Python knows, full-width forms, and kana: the
    # byte-level shortcuts in tidy_whitespace and the normalized key must not change a single result.
    alphabet = list("ab \t\n\r\x00\x07\x0b\x0c\x1c\x1f\x7f\ufeff\x85\xa0\u1680\u2000\u200a\u2028\u2029\u202f"
                    "\u205f\u3000ｱＡ漢アé①")
    rng = random.Random(0)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(3000)]
    texts += ["plain ascii line  \nnext\t\n\n\n\nend ", "全角　スペース　\n行末", "\x85\u2028"]
    for text in texts:
        for collapse in (False, True):
            assert tidy_whitespace(text, collapse) == _tidy_by_definition(text, collapse), repr(text)
        assert content_key(text, "normalized") == _key_by_definition(text), repr(text)
