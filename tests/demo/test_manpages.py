"""Japanese (demo.manpages): groff rendering and cleanup, alias pages, the ja_clean quality filter,
and getting groff."""
from __future__ import annotations

import gzip
import shutil

import pytest

from demo import debian, manpages
from demo.base import SourceUnavailable
from tests.demo.helpers import JA_PROSE



def test_japanese_spacing_fix():
    assert manpages.join_japanese_spaces("場合、 要素はアルファベット順で ソートされます。 次に") == "場合、要素はアルファベット順でソートされます。次に"
    # Spaces beside Latin text and runs of spaces (table columns) are kept.
    assert manpages.join_japanese_spaces("-l と合わせて --sort も") == "-l と合わせて --sort も"
    assert manpages.join_japanese_spaces("名前  説明") == "名前  説明"


def test_rendered_page_cleanup_drops_header_footer_and_normalises():
    rendered = ("LS(1)      ユーザーコマンド      LS(1)\n\n\n名前\n       ls - ディレクトリの内容を 表示する\n\n\n\n"
                "説明\n       か\u3099 ファイル\n\nGNU coreutils 8.32     2021年5月     LS(1)\n")
    assert manpages.clean_rendered_page(rendered) == "名前\nls - ディレクトリの内容を表示する\n\n説明\nがファイル"


def test_alias_pages_are_recognised():
    assert manpages.is_alias_page('.\\" comment\n.so man2/stat.2\n')
    assert not manpages.is_alias_page(".TH LS 1\n.SH 名前\nls \\- 一覧\n")


def test_quality_filter_on_small_examples():
    quality = manpages.QualityFilter(min_chars=100, max_chars=5000, min_japanese_share=0.5, max_symbol_share=0.12)
    english = "This page was never translated and explains the options in English only. " * 4
    options = "書式\n" + "\n".join(f"-{c} [<値>|{{名前}}] --> 「ファイル」; (=既定)" for c in "abcdefgh")
    docs = [{"text": JA_PROSE}, {"text": "名前\nls - 一覧"}, {"text": english}, {"text": options}, {"text": JA_PROSE * 20}]

    assert quality.reason(JA_PROSE) is None
    assert manpages.japanese_share(JA_PROSE) > 0.8 and manpages.japanese_share(english) == 0.0
    assert manpages.japanese_share(options) > 0.8 and manpages.symbol_share(options) > 0.5 > 0.12 > manpages.symbol_share(JA_PROSE)
    kept, dropped = manpages.split_by_quality(docs, quality)
    assert kept == [docs[0]]
    assert dropped == {"low_japanese_share": 1, "too_long": 1, "too_many_symbols": 1, "too_short": 1}


@pytest.mark.skipif(shutil.which("groff") is None, reason="needs groff")
def test_a_page_is_rendered_into_a_document_and_aliases_are_skipped(tmp_path):
    root = tmp_path / "ja"
    (root / "man1").mkdir(parents=True)
    page = ".TH LS 1 2021 GNU\n.SH 名前\nls \\- ディレクトリの内容を\n表示する\n.SH 説明\nファイルの情報を一覧表示する。\n"
    (root / "man1" / "ls.1.gz").write_bytes(gzip.compress(page.encode()))
    (root / "man1" / "dir.1.gz").write_bytes(gzip.compress(b".so man1/ls.1\n"))
    (root / "man1" / "vdir.1.gz").symlink_to("ls.1.gz")

    assert manpages.man_page_files(root) == [root / "man1" / "dir.1.gz", root / "man1" / "ls.1.gz"]
    assert manpages.man_page_doc(root / "man1" / "dir.1.gz", root) is None
    assert manpages.man_page_doc(root / "man1" / "ls.1.gz", root) == {
        "text": "名前\nls - ディレクトリの内容を表示する\n\n説明\nファイルの情報を一覧表示する。",
        "source": "manpages-ja:man1/ls.1",
    }


def test_missing_groff_is_installed_only_where_allowed(monkeypatch):
    monkeypatch.setattr(manpages.shutil, "which", lambda name: None)
    monkeypatch.setattr(debian, "can_install", lambda: False)
    with pytest.raises(SourceUnavailable, match="sudo apt-get install groff-base"):
        manpages.ensure_groff(progress=lambda _: None)

    installed: list[str] = []
    monkeypatch.setattr(debian, "can_install", lambda: True)
    monkeypatch.setattr(debian, "install", installed.append)
    with pytest.raises(SourceUnavailable, match="still not on PATH"):
        manpages.ensure_groff(progress=lambda _: None)
    assert installed == ["groff-base"]
