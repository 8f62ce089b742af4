"""The demo corpus build (demo.corpus): fallbacks without apt, the user's own files, the cache (a
complete corpus is reused and nothing rebuilt), atomic output, CLI errors, and (slow) the real build."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from demo import austen, debian, manpages, pari, python_code
from demo import corpus as dc
from demo.base import SourceUnavailable
from tests.demo.helpers import JA_PROSE, write_fake_stdlib



@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    root = write_fake_stdlib(tmp_path / "stdlib")
    monkeypatch.setattr(python_code, "stdlib_dir", lambda: root)
    return root


@pytest.fixture
def no_apt(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name in ("apt-get", "dpkg-deb") else real_which(name))


def forbid_rebuilding(monkeypatch) -> None:
    """Make every step that fetches, extracts or writes fail the test if a (cached) build reaches it."""
    def fail(*args, **kwargs):
        raise AssertionError("a cached demo corpus was rebuilt")
    for module, name in [(debian, "fetch_packages"), (manpages, "ensure_groff"), (manpages, "man_page_doc"),
                         (austen, "austen_docs"), (pari, "pari_docs"), (python_code, "code_docs"),
                         (dc, "read_user_jsonl"), (dc, "_write_corpus")]:
        monkeypatch.setattr(module, name, fail)


def file_stamps(folder: Path) -> dict[str, tuple[int, int]]:
    """(mtime_ns, size) of every file below folder, by relative path."""
    return {path.relative_to(folder).as_posix(): (path.stat().st_mtime_ns, path.stat().st_size)
            for path in sorted(folder.rglob("*")) if path.is_file()}


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
    stamp, stamps = (out / dc.MANIFEST_NAME).stat().st_mtime_ns, file_stamps(out)
    with pytest.MonkeyPatch.context() as patch:
        forbid_rebuilding(patch)
        assert dc.build_demo_corpus(out, progress=messages.append) == manifest
    assert messages == [f"demo corpus: {out} (cached; --force rebuilds)"] and file_stamps(out) == stamps

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
        debian.fetch_packages(dc.PACKAGES, tmp_path / "demo_packages", progress=lambda _: None)
    except SourceUnavailable as err:
        pytest.skip(f"Debian packages unavailable: {err}")
    messages: list[str] = []
    manifest = dc.build_demo_corpus(out, progress=messages.append)
    print("\n".join(messages))

    assert manifest["complete"], manifest["missing"]
    figures = {d: (info["docs"], info["chars"]) for d, info in manifest["domains"].items()}
    # docs/demo-corpus.md: 921 ja pages / 4.5 M chars, 269 chapters / 4.0 M, 1,794 math sections / 2.75 M,
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

    # The next call reuses it: nothing fetched, extracted or written (bench/demo_corpus.py times it).
    stamps = file_stamps(out)
    with pytest.MonkeyPatch.context() as patch:
        forbid_rebuilding(patch)
        assert dc.build_demo_corpus(out, progress=lambda _: None) == manifest
    assert file_stamps(out) == stamps
