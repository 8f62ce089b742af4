"""English (demo.austen): chapters from the novels' lines, and the novels from a lazy-load database."""
from __future__ import annotations

import pytest

from demo import austen
from demo.base import DemoCorpusError
from demo.debian import Package
from tests.demo.helpers import Serializer, write_lazyload_db


def test_austen_chapters_split_on_headings():
    lines = ["SENSE AND SENSIBILITY", "", "by Jane Austen", "", "CHAPTER 1", "", "The family of Dashwood",
             "had long been settled.", "", "Their estate was large.", "", "VOLUME II", "", "Chapter II", "",
             "Mrs. John Dashwood", None, "now installed herself."]
    assert austen.split_chapters(lines) == [
        "CHAPTER 1\n\nThe family of Dashwood had long been settled.\n\nTheir estate was large.",
        "Chapter II\n\nMrs. John Dashwood\n\nnow installed herself.",
    ]


def fake_package(tmp_path, novels: dict[str, list[str]]) -> Package:
    """An unpacked r-cran-janeaustenr holding `novels` (name -> lines) in its lazy-load database."""
    root = tmp_path / "unpacked"
    data = austen.austen_rdx(Package(austen.PACKAGE, "1.0.0-1", tmp_path / "x.deb", root)).parent
    data.mkdir(parents=True)
    s = Serializer()
    write_lazyload_db(data, {name: s.strsxp(lines) for name, lines in novels.items()}, "xz")
    return Package(austen.PACKAGE, "1.0.0-1", tmp_path / "x.deb", root)


def test_the_six_novels_become_one_document_per_chapter(tmp_path):
    novels = {key: [title.upper(), "", "CHAPTER 1", "", f"{title} begins.", "", "CHAPTER 2", "", "It ends."]
              for key, title in austen.AUSTEN_TITLES.items()}
    docs = austen.austen_docs(fake_package(tmp_path, novels))
    assert len(docs) == 12
    assert docs[0] == {"text": "CHAPTER 1\n\nSense and Sensibility begins.",
                       "source": "r-cran-janeaustenr:sensesensibility:chapter1"}
    assert docs[-1]["source"] == "r-cran-janeaustenr:persuasion:chapter2"


def test_a_missing_novel_is_named(tmp_path):
    package = fake_package(tmp_path, {"emma": ["CHAPTER I", "", "Emma Woodhouse"]})
    with pytest.raises(DemoCorpusError, match="no novel 'sensesensibility'.*'emma'"):
        austen.austen_docs(package)
