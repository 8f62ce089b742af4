"""The demo corpus builder: the R lazy-load reader, the Japanese cleaning and quality filter,
the per-source splitters, the build's caching/atomicity/fallbacks, and (slow) the real build."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import shutil
import struct
import time
import zlib
from pathlib import Path

import pytest

from demo import corpus as dc

# --------------------------------------------------------------------------------------------
# A tiny R XDR serializer, written from R Internals §1.8, to make test streams
# --------------------------------------------------------------------------------------------

HEADER_V3 = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8"
UTF8, LATIN1 = 1 << 3, 1 << 2


def xdr_int(value: int) -> bytes:
    return struct.pack(">i", value)


def charsxp(text: str | None, encoding: int = UTF8) -> bytes:
    if text is None:
        return xdr_int(dc.CHARSXP) + xdr_int(-1)
    raw = text.encode("latin-1" if encoding == LATIN1 else "utf-8")
    return xdr_int(dc.CHARSXP | (encoding << 12)) + xdr_int(len(raw)) + raw


class Serializer:
    """Writes symbols once and references them afterwards, as R does."""

    def __init__(self):
        self.symbols: list[str] = []

    def symbol(self, name: str) -> bytes:
        if name in self.symbols:
            return xdr_int(((self.symbols.index(name) + 1) << 8) | dc.REFSXP)
        self.symbols.append(name)
        return xdr_int(dc.SYMSXP) + charsxp(name)

    def strsxp(self, values, attrs: dict[str, bytes] | None = None) -> bytes:
        body = xdr_int(len(values)) + b"".join(charsxp(v) if not isinstance(v, bytes) else v for v in values)
        return self._vector(dc.STRSXP, body, attrs)

    def intsxp(self, values, attrs=None) -> bytes:
        body = xdr_int(len(values)) + b"".join(xdr_int(dc.NA_INTEGER if v is None else v) for v in values)
        return self._vector(dc.INTSXP, body, attrs)

    def lglsxp(self, values) -> bytes:
        return self._vector(dc.LGLSXP, xdr_int(len(values)) + b"".join(xdr_int(int(v)) for v in values), None)

    def named_list(self, items: dict[str, bytes]) -> bytes:
        body = xdr_int(len(items)) + b"".join(items.values())
        return self._vector(dc.VECSXP, body, {"names": self.strsxp(list(items))})

    def _vector(self, sxp: int, body: bytes, attrs: dict[str, bytes] | None) -> bytes:
        flags = sxp | (dc.HAS_ATTR if attrs else 0)
        return xdr_int(flags) + body + (self.pairlist(attrs) if attrs else b"")

    def pairlist(self, items: dict[str, bytes]) -> bytes:
        out = b""
        for tag, value in items.items():
            out += xdr_int(dc.LISTSXP | dc.HAS_TAG) + self.symbol(tag) + value
        return out + xdr_int(dc.NILVALUE_SXP)


def write_lazyload_db(folder: Path, objects: dict[str, bytes], compression: str = "zlib") -> Path:
    """Rdata.rdx/.rdb holding each serialized object (bytes after the header) under its name."""
    rdb, offsets = b"", {}
    for name, item in objects.items():
        stream = HEADER_V3 + item
        size = struct.pack(">I", len(stream))
        if compression == "zlib":
            record = size + zlib.compress(stream)
        elif compression == "xz":
            record = size + b"Z" + lzma.compress(stream)
        else:
            record = size + b"2" + bz2.compress(stream)
        offsets[name] = (len(rdb), len(record))
        rdb += record
    s = Serializer()
    variables = s.named_list({name: s.intsxp(list(span)) for name, span in offsets.items()})
    flag = s.lglsxp([True]) if compression == "zlib" else s.intsxp([3 if compression == "xz" else 2])
    index = s.named_list({"variables": variables, "references": xdr_int(dc.VECSXP) + xdr_int(0), "compressed": flag})
    (folder / "Rdata.rdb").write_bytes(rdb)
    (folder / "Rdata.rdx").write_bytes(gzip.compress(HEADER_V3 + index))
    return folder / "Rdata.rdx"


@pytest.mark.parametrize("compression", ["zlib", "xz", "bzip2"])
def test_lazyload_reader_returns_character_vectors(tmp_path, compression):
    s = Serializer()
    novel = s.strsxp(["CHAPTER 1", "", "It is a truth universally acknowledged,", None, "caf\u00e9", "吾輩は猫である"])
    latin = Serializer().strsxp([charsxp("na\u00efve", LATIN1)])
    rdx = write_lazyload_db(tmp_path, {"book": novel, "latin": latin}, compression)

    objects = dc.read_lazyload_db(rdx)

    assert sorted(objects) == ["book", "latin"]
    assert list(objects["book"]) == ["CHAPTER 1", "", "It is a truth universally acknowledged,", None, "caf\u00e9", "吾輩は猫である"]
    assert objects["book"].rtype == dc.STRSXP
    assert list(objects["latin"]) == ["na\u00efve"]


def test_unserialize_resolves_symbol_references_and_attributes():
    s = Serializer()
    # Two vectors both named: the second "names" tag is written as a reference to the first.
    item = s.named_list({"a": s.strsxp(["x"], {"names": s.strsxp(["first"])}), "b": s.intsxp([1, None, 3])})
    value = dc.unserialize(HEADER_V3 + item)
    assert value.names == ["a", "b"]
    assert value.as_dict()["a"].names == ["first"]
    assert list(value.as_dict()["b"]) == [1, None, 3]
    assert s.symbols == ["names"]  # written once, referenced afterwards


def test_unserialize_rejects_what_it_cannot_read():
    with pytest.raises(dc.RFormatError, match="XDR"):
        dc.unserialize(b"A\n3\n")
    with pytest.raises(dc.RFormatError, match="truncated"):
        dc.unserialize(HEADER_V3 + Serializer().strsxp(["abc"])[:-6])
    with pytest.raises(dc.RFormatError, match="CLOSXP"):
        dc.unserialize(HEADER_V3 + xdr_int(3))


def test_lazyload_reader_checks_record_sizes(tmp_path):
    rdx = write_lazyload_db(tmp_path, {"book": Serializer().strsxp(["a line"])})
    rdb = bytearray((tmp_path / "Rdata.rdb").read_bytes())
    rdb[:4] = struct.pack(">I", 9999)  # header claims another size
    (tmp_path / "Rdata.rdb").write_bytes(bytes(rdb))
    with pytest.raises(dc.RFormatError, match=r"Rdata.rdb\[book\].*9999"):
        dc.read_lazyload_db(rdx)


# --------------------------------------------------------------------------------------------
# Japanese
# --------------------------------------------------------------------------------------------

JA_PROSE = ("termcap データベースは、文字単位で動作する端末やプリンタの機能を記述するための旧式の機構である。"
            "この機構は古いプログラムでの互換性のためだけに保持されているので、新しいプログラムは terminfo(5) "
            "データベースとそれに関連したライブラリを用いるべきである。") * 4


def test_japanese_spacing_fix():
    assert dc.join_japanese_spaces("場合、 要素はアルファベット順で ソートされます。 次に") == "場合、要素はアルファベット順でソートされます。次に"
    # Spaces beside Latin text and runs of spaces (table columns) are kept.
    assert dc.join_japanese_spaces("-l と合わせて --sort も") == "-l と合わせて --sort も"
    assert dc.join_japanese_spaces("名前  説明") == "名前  説明"


def test_rendered_page_cleanup_drops_header_footer_and_normalises():
    rendered = ("LS(1)      ユーザーコマンド      LS(1)\n\n\n名前\n       ls - ディレクトリの内容を 表示する\n\n\n\n"
                "説明\n       か\u3099 ファイル\n\nGNU coreutils 8.32     2021年5月     LS(1)\n")
    assert dc.clean_rendered_page(rendered) == "名前\nls - ディレクトリの内容を表示する\n\n説明\nがファイル"


def test_alias_pages_are_recognised():
    assert dc.is_alias_page('.\\" comment\n.so man2/stat.2\n')
    assert not dc.is_alias_page(".TH LS 1\n.SH 名前\nls \\- 一覧\n")


def test_quality_filter_on_small_examples():
    quality = dc.QualityFilter(min_chars=100, max_chars=5000, min_japanese_share=0.5, max_symbol_share=0.12)
    english = "This page was never translated and explains the options in English only. " * 4
    options = "書式\n" + "\n".join(f"-{c} [<値>|{{名前}}] --> 「ファイル」; (=既定)" for c in "abcdefgh")
    docs = [{"text": JA_PROSE}, {"text": "名前\nls - 一覧"}, {"text": english}, {"text": options}, {"text": JA_PROSE * 20}]

    assert quality.reason(JA_PROSE) is None
    assert dc.japanese_share(JA_PROSE) > 0.8 and dc.japanese_share(english) == 0.0
    assert dc.japanese_share(options) > 0.8 and dc.symbol_share(options) > 0.5 > 0.12 > dc.symbol_share(JA_PROSE)
    kept, dropped = dc.split_by_quality(docs, quality)
    assert kept == [docs[0]]
    assert dropped == {"low_japanese_share": 1, "too_long": 1, "too_many_symbols": 1, "too_short": 1}


# --------------------------------------------------------------------------------------------
# English, math, code
# --------------------------------------------------------------------------------------------


def test_austen_chapters_split_on_headings():
    lines = ["SENSE AND SENSIBILITY", "", "by Jane Austen", "", "CHAPTER 1", "", "The family of Dashwood",
             "had long been settled.", "", "Their estate was large.", "", "VOLUME II", "", "Chapter II", "",
             "Mrs. John Dashwood", None, "now installed herself."]
    assert dc.split_chapters(lines) == [
        "CHAPTER 1\n\nThe family of Dashwood had long been settled.\n\nTheir estate was large.",
        "Chapter II\n\nMrs. John Dashwood\n\nnow installed herself.",
    ]


def test_pari_sections_and_detex_keep_formulas():
    tex = ("\\input parimacro\n\\chapter{Functions}\n\\section{Transcendental}\\label{se:trans}\n"
           "\\subsec{incgam$(s,x)$}\\kbdsidx{incgam}\nIncomplete gamma $\\int_x^\\infty e^{-t}\\,dt$, see \\kbd{gamma},"
           " returns a \\typ{REAL}; \\fun{GEN}{incgam}{GEN s, GEN x}.\n\\bprog\n? incgam(1,2)\n@eprog\\noindent Done.\n")
    sections = dc.split_tex_sections(tex)
    assert [section.split("\n")[0][:12] for section in sections] == ["\\chapter{Fun", "\\section{Tra", "\\subsec{incg"]
    text = dc.detex_pari(sections[2])
    assert text.startswith("incgam$(s,x)$\nIncomplete gamma $\\int_x^\\infty e^{-t}\\,dt$, see gamma, returns a t_REAL")
    assert "incgam(GEN s, GEN x)" in text and "? incgam(1,2)" in text
    assert "\\kbdsidx" not in text and "@eprog" not in text and "\\noindent" not in text


def write_fake_stdlib(root: Path) -> Path:
    body = "def f():\n    return 1\n" * 60  # ~1.3 kB
    files = {"argparse.py": body, "tiny.py": "x = 1\n", "huge.py": "#" * (600 * 1024), "pkg/mod.py": body,
             "test/test_x.py": body, "pkg/tests/helper.py": body, "site-packages/dep.py": body,
             "__pycache__/argparse.py": body, "test_other.py": body}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_stdlib_extraction_keeps_library_files_only(tmp_path):
    root = write_fake_stdlib(tmp_path / "lib")
    assert [p.relative_to(root).as_posix() for p in dc.stdlib_files(root)] == ["argparse.py", "pkg/mod.py"]
    docs = dc.code_docs(root)
    assert docs[0]["source"] == "python-stdlib:argparse.py" and docs[0]["text"].startswith("def f():")


def test_real_stdlib_yields_hundreds_of_files():
    files = dc.stdlib_files(dc.stdlib_dir())
    names = {path.name for path in files}
    assert len(files) > 300 and {"argparse.py", "json"} & names == {"argparse.py"}
    assert not any("site-packages" in path.parts or "__pycache__" in path.parts for path in files)


# --------------------------------------------------------------------------------------------
# The build: fallbacks, user files, cache, atomic output
# --------------------------------------------------------------------------------------------


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    root = write_fake_stdlib(tmp_path / "stdlib")
    monkeypatch.setattr(dc, "stdlib_dir", lambda: root)
    return root


@pytest.fixture
def no_apt(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(dc.shutil, "which", lambda name: None if name in ("apt-get", "dpkg-deb") else real_which(name))


def test_without_apt_the_code_domain_is_built_and_the_message_explains(tmp_path, fake_stdlib, no_apt):
    messages: list[str] = []
    manifest = dc.build_demo_corpus(tmp_path / "corpus", progress=messages.append)

    assert manifest["complete"] is False
    assert sorted(manifest["domains"]) == ["code"] and manifest["domains"]["code"]["docs"] == 2
    assert sorted(manifest["missing"]) == ["en", "ja_clean", "ja_raw", "math"]
    text = "\n".join(messages)
    assert "`apt-get` is not on PATH" in text and "Debian/Ubuntu" in text
    assert "--use ja_raw=" in text and '"text" field' in text
    assert (tmp_path / "corpus" / "code.jsonl").is_file()
    assert dc.load_manifest(tmp_path / "corpus")["complete"] is False  # an incomplete corpus is not reused


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": text, "id": i}, ensure_ascii=False) + "\n" for i, text in enumerate(texts)))
    return path


def test_user_files_build_a_complete_corpus_that_is_cached(tmp_path, fake_stdlib, no_apt):
    ja = write_jsonl(tmp_path / "ja.jsonl", [JA_PROSE, "英語だけ? no: This is English text only, repeated. " * 20, "短い"])
    en = write_jsonl(tmp_path / "en.jsonl", ["It is a truth universally acknowledged."])
    math = write_jsonl(tmp_path / "math.jsonl", ["Let $x \\in \\mathbb{R}$."])
    out = tmp_path / "data" / "demo_corpus"

    manifest = dc.build_demo_corpus(out, user_files={"ja_raw": ja, "en": en, "math": math}, progress=lambda _: None)

    assert manifest["complete"] is True and manifest["missing"] == {}
    assert {d: manifest["domains"][d]["docs"] for d in dc.DOMAINS} == {"ja_raw": 3, "ja_clean": 1, "en": 1, "math": 1, "code": 2}
    assert manifest["ja_filter"]["dropped"] == {"low_japanese_share": 1, "too_short": 1}
    clean = [json.loads(line) for line in (out / "ja_clean.jsonl").read_text().splitlines()]
    assert clean == [{"text": JA_PROSE, "source": "user:ja.jsonl:1"}]
    # A licence is listed exactly when its file was copied beside the text.
    assert ("python.LICENSE" in manifest["licenses"]) == (out / "licenses" / "python.LICENSE").is_file()
    assert sorted(p.name for p in out.parent.iterdir()) == ["demo_corpus"]  # no partial folders left

    messages: list[str] = []
    stamp = (out / dc.MANIFEST_NAME).stat().st_mtime_ns
    assert dc.build_demo_corpus(out, progress=messages.append) == manifest
    assert "cached" in messages[0] and (out / dc.MANIFEST_NAME).stat().st_mtime_ns == stamp

    # Forced, without the user files and without apt: the rebuild would be incomplete, so the
    # complete corpus stays.
    messages.clear()
    assert dc.build_demo_corpus(out, force=True, progress=messages.append) == manifest
    assert "kept the existing complete corpus" in messages[-1] and "apt-get" in messages[-1]
    assert (out / dc.MANIFEST_NAME).stat().st_mtime_ns == stamp
    assert sorted(p.name for p in out.parent.iterdir()) == ["demo_corpus"]

    en2 = write_jsonl(tmp_path / "en2.jsonl", ["Emma Woodhouse, handsome, clever, and rich.", "Chapter two."])
    rebuilt = dc.build_demo_corpus(out, force=True, user_files={"ja_raw": ja, "en": en2, "math": math},
                                   progress=lambda _: None)
    assert rebuilt["domains"]["en"]["docs"] == 2 and dc.load_manifest(out) == rebuilt


def test_bad_user_files_name_file_line_and_fix(tmp_path, capsys):
    bad = tmp_path / "ja.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    assert dc.main_corpus(["--out", str(tmp_path / "c"), "--use", f"ja_raw={bad}"]) == 1
    assert f'{bad}:2: needs a string "text" field' in capsys.readouterr().err
    assert dc.main_corpus(["--out", str(tmp_path / "c"), "--use", "ja_raw"]) == 1
    assert "expected DOMAIN=FILE.jsonl" in capsys.readouterr().err
    assert dc.main_corpus(["--out", str(tmp_path / "c"), "--use", f"japanese={bad}"]) == 1
    assert "unknown domain(s) ['japanese']" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


# --------------------------------------------------------------------------------------------
# The real thing (downloads ~14 MB of Debian packages; ~30 s on 2 cores)
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_build_matches_the_recorded_figures(tmp_path):
    if shutil.which("apt-get") is None or shutil.which("groff") is None:
        pytest.skip("needs Debian's apt-get and groff (not Debian/Ubuntu)")
    out = tmp_path / "demo_corpus"
    try:
        dc.fetch_packages(dc.PACKAGES, tmp_path / "demo_packages", progress=lambda _: None)
    except dc.SourceUnavailable as err:
        pytest.skip(f"Debian packages unavailable: {err}")
    messages: list[str] = []
    manifest = dc.build_demo_corpus(out, progress=messages.append)
    print("\n".join(messages))

    assert manifest["complete"], manifest["missing"]
    figures = {d: (info["docs"], info["chars"]) for d, info in manifest["domains"].items()}
    # shared/CORPORA.md: 921 ja pages / 4.5 M chars, 269 chapters / 4.0 M, 1,794 math sections / 2.75 M,
    # 597 stdlib files / 11 M; versions move the counts a little, the recipes here a little more.
    assert 850 <= figures["ja_raw"][0] <= 1000 and 3.5e6 <= figures["ja_raw"][1] <= 5.5e6
    assert 0.4 * figures["ja_raw"][0] <= figures["ja_clean"][0] < figures["ja_raw"][0]
    assert 260 <= figures["en"][0] <= 280 and 3.5e6 <= figures["en"][1] <= 4.5e6
    assert 1500 <= figures["math"][0] <= 2200 and 2.0e6 <= figures["math"][1] <= 3.2e6
    assert figures["code"][0] >= 300 and figures["code"][1] >= 4e6
    assert set(manifest["packages"]) == set(dc.PACKAGES) and all(p["version"] for p in manifest["packages"].values())
    for package in dc.PACKAGES:
        assert "Copyright" in (out / "licenses" / f"{package}.copyright").read_text(errors="replace")
    first_en = json.loads((out / "en.jsonl").open().readline())["text"]
    assert first_en.startswith("CHAPTER 1\n\n") and "Dashwood" in first_en

    started = time.perf_counter()
    assert dc.build_demo_corpus(out, progress=lambda _: None) == manifest
    assert time.perf_counter() - started < 1.0
