"""Corpus → shards end to end, with a real SentencePiece tokenizer on real text.

Round trip, determinism across worker counts, split stability, overlap detection, resume after a
kill, bad inputs, empty domains, and the tokenizer-sha contract with training.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from data.clean import Cleaner
from data.config import CleanConfig
from data.manifest import KEYS_NAME, MANIFEST_NAME, check_manifest_tokenizer, load_manifest
from data.domains import open_run_data
from data.prepare import EmptyDomainError, OverlapError, prepare, split_threshold
from data.shards import ShardReader, TokenizerMismatchError, find_shards
from tests.data.helpers import JA_PARAGRAPHS, domain, make_config, write_jsonl
from tokenizer import load_tokenizer_info
from common.corpus import CorpusError

REPO = Path(__file__).resolve().parents[2]


def read_split(root: Path, name: str, split: str) -> list[np.ndarray]:
    directory = root / name / split
    if not directory.is_dir():
        return []
    return [doc.copy() for prefix in find_shards(directory) for doc in ShardReader(prefix)]


def split_keys(root: Path, name: str, split: str) -> list[bytes]:
    path = root / name / split / KEYS_NAME
    data = path.read_bytes() if path.is_file() else b""
    return [data[i:i + 16] for i in range(0, len(data), 16)]


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def expected_splits(texts: list[str], clean: CleanConfig, val_fraction: float) -> dict[str, list[str]]:
    """What the shards must hold, computed independently: clean, de-dup by key, split by key."""
    cleaner, seen = Cleaner(clean), set()
    out = {"train": [], "val": []}
    for text in texts:
        cleaned, reason = cleaner(text)
        if reason:
            continue
        key = cleaner.key(cleaned)
        if key in seen and clean.dedup != "off":
            continue
        seen.add(key)
        split = "val" if int.from_bytes(key[:8], "big") < split_threshold(val_fraction) else "train"
        out[split].append(cleaned)
    return out


@pytest.fixture
def en_corpus(tmp_path, en_texts) -> Path:
    """Two jsonl files of real English with messy whitespace and some duplicates (also across files)."""
    messy = [text.replace("\n", "  \r\n") + "   \n\n\n\n" for text in en_texts]
    write_jsonl(tmp_path / "in" / "en" / "a.jsonl", messy[:120] + messy[:5])
    write_jsonl(tmp_path / "in" / "en" / "b.jsonl", messy[120:] + messy[10:13])
    return tmp_path / "in" / "en"


def test_round_trip_decodes_to_cleaned_text(tmp_path, tokenizer_dir, en_corpus, en_texts):
    clean = CleanConfig(min_chars=100)
    cfg = make_config(tmp_path / "root", tokenizer_dir, {
        "en": domain([en_corpus / "*.jsonl"], val_fraction=0.1, shard_max_mb=0.02, clean=clean)})
    manifest = prepare(cfg)
    raw = [json.loads(line)["text"] for name in ("a", "b") for line in open(en_corpus / f"{name}.jsonl", encoding="utf-8")]
    expected = expected_splits(raw, clean, 0.1)
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    for split in ("train", "val"):
        docs = read_split(tmp_path / "root", "en", split)
        assert all(doc[-1] == 2 for doc in docs), "every document ends with EOS"
        assert [sp.decode(doc[:-1].tolist()) for doc in docs] == expected[split]
    record = manifest["domains"]["en"]
    assert record["docs_kept"] == len(expected["train"]) + len(expected["val"])
    assert record["dropped"]["duplicate"] >= 8 and "too_short" in record["dropped"]
    assert record["docs_read"] == len(raw) and record["files_read"] == 2
    assert len(record["splits"]["train"]["shards"]) > 1, "the size cap makes several shards"
    for shard in record["splits"]["train"]["shards"]:
        assert shard["bytes"] <= 0.02 * 2**20 or shard["docs"] == 1
    assert 0 < record["splits"]["val"]["docs"] < record["splits"]["train"]["docs"]


def test_same_bytes_for_any_worker_count(tmp_path, tokenizer_dir, en_corpus):
    ja = write_jsonl(tmp_path / "in" / "ja.jsonl", JA_PARAGRAPHS * 2 + ["ｶﾀｶﾅの文章です。" * 5])
    trees = {}
    for workers, start_method in ((0, "auto"), (2, "auto"), (2, "forkserver"), (1, "spawn")):
        root = tmp_path / f"root{workers}{start_method}"
        cfg = make_config(root, tokenizer_dir, {
            "en": domain([en_corpus / "*.jsonl"], val_fraction=0.2, shard_max_mb=0.03),
            "ja": domain([ja], val_count=2, clean=CleanConfig(normalize="NFKC", script="ja", min_script_share=0.5)),
        }, workers=workers, chunk_mb=0.01, start_method=start_method)  # small chunks: many in flight, out of order
        prepare(cfg)
        trees[workers, start_method] = tree_bytes(root)
    reference = trees[0, "auto"]
    assert all(tree == reference for tree in trees.values())
    assert any(name.endswith(".bin") for name in reference) and MANIFEST_NAME in reference


def test_domains_before_a_read_error_are_still_published(tmp_path, tokenizer_dir, en_corpus):
    # One stream of chunks spans the domains: a strict-mode error while reading the second one
    # must not take the first one, still in flight in the workers, down with it.
    bad = tmp_path / "in" / "ja.jsonl"
    write_jsonl(bad, JA_PARAGRAPHS)
    with open(bad, "a", encoding="utf-8") as handle:
        handle.write("{not json\n")
    cfg = make_config(tmp_path / "root", tokenizer_dir, {
        "en": domain([en_corpus / "*.jsonl"], val_fraction=0.1), "ja": domain([bad], val_fraction=0.1),
    }, workers=2, chunk_mb=0.01, strict=True)
    with pytest.raises(CorpusError, match=rf"{re.escape(str(bad))}:9: malformed JSON"):
        prepare(cfg)
    root = tmp_path / "root"
    assert (root / "en" / "domain.json").is_file() and read_split(root, "en", "train")
    assert not (root / "ja").exists() and not (root / ".partial").exists()
    assert not (root / MANIFEST_NAME).exists()


def test_split_is_stable_when_files_are_added(tmp_path, tokenizer_dir, en_texts):
    first = write_jsonl(tmp_path / "in" / "a.jsonl", en_texts[:100])
    cfg = make_config(tmp_path / "r1", tokenizer_dir, {"en": domain([first], val_fraction=0.2)})
    prepare(cfg)
    write_jsonl(tmp_path / "in" / "b.jsonl", en_texts[100:])
    cfg = make_config(tmp_path / "r2", tokenizer_dir, {"en": domain([tmp_path / "in" / "*.jsonl"], val_fraction=0.2)})
    prepare(cfg)
    before = {split: set(split_keys(tmp_path / "r1", "en", split)) for split in ("train", "val")}
    after = {split: set(split_keys(tmp_path / "r2", "en", split)) for split in ("train", "val")}
    assert before["val"] and before["val"] <= after["val"] and before["train"] <= after["train"]
    assert len(after["val"]) > len(before["val"])


def test_val_count_takes_the_smallest_keys(tmp_path, tokenizer_dir, en_corpus):
    cfg = make_config(tmp_path / "root", tokenizer_dir, {"en": domain([en_corpus / "*.jsonl"], val_count=7)})
    prepare(cfg)
    val, train = split_keys(tmp_path / "root", "en", "val"), split_keys(tmp_path / "root", "en", "train")
    assert len(val) == 7 and len(read_split(tmp_path / "root", "en", "val")) == 7
    assert max(val) < min(train) and not set(val) & set(train)


def test_overlap_across_domains_fails_the_run(tmp_path, tokenizer_dir, en_texts):
    shared = write_jsonl(tmp_path / "in" / "shared.jsonl", en_texts[:150])
    extra = write_jsonl(tmp_path / "in" / "extra.jsonl", en_texts[150:])
    # Same documents in two domains with different val fractions: some are val in one, train in the other.
    cfg = make_config(tmp_path / "root", tokenizer_dir, {
        "raw": domain([shared, extra], val_fraction=0.3),
        "curated": domain([shared], val_fraction=0.05),
    })
    with pytest.raises(OverlapError, match=r"validation documents also sit in training data.*val of 'raw'.*train of 'curated'"):
        prepare(cfg)
    assert not (tmp_path / "root" / MANIFEST_NAME).exists(), "a failed check leaves no manifest"
    # The same val_fraction puts a shared document in the same split everywhere: the check passes.
    cfg.data.domains["curated"].val_fraction = 0.3
    manifest = prepare(cfg)
    assert manifest["overlap_check"]["passed"] and manifest["overlap_check"]["val_docs"] > 0


def test_rerun_skips_finished_work_and_is_byte_identical(tmp_path, tokenizer_dir, en_corpus, caplog):
    cfg = make_config(tmp_path / "root", tokenizer_dir, {"en": domain([en_corpus / "*.jsonl"], val_fraction=0.1)})
    prepare(cfg)
    before = tree_bytes(tmp_path / "root")
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "root" / "en").rglob("*.bin")}
    caplog.set_level("INFO", logger="ayumi.data")
    prepare(cfg)
    assert "up to date" in caplog.text
    assert tree_bytes(tmp_path / "root") == before
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes, "finished shards are not rewritten"
    # A changed input redoes the domain.
    with open(en_corpus / "b.jsonl", "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "A brand new document about tokenizers and shards, long enough to keep."}) + "\n")
    caplog.clear()
    manifest = prepare(cfg)
    assert "up to date" not in caplog.text
    assert manifest["domains"]["en"]["docs_read"] == load_manifest(tmp_path / "root")["domains"]["en"]["docs_read"]


KILLER = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
import data.prepare as prepare_module
from tests.data.helpers import die_after_writes, domain, make_config
from data.config import CleanConfig

die_after_writes({kill_after})
cfg = make_config(Path({root!r}), Path({tok!r}), {{
    "en": domain([{en!r}], val_fraction=0.1, shard_max_mb=0.01),
    "ja": domain([{ja!r}], val_fraction=0.1, shard_max_mb=0.0001),
}}, workers={workers})
prepare_module.prepare(cfg)
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_after_a_killed_run(tmp_path, tokenizer_dir, en_corpus, workers):
    ja = write_jsonl(tmp_path / "in" / "ja.jsonl", [p * (i + 1) for i, p in enumerate(JA_PARAGRAPHS)])
    root = tmp_path / "root"
    en_kept = prepare(make_config(tmp_path / "count", tokenizer_dir, {"en": domain([en_corpus / "*.jsonl"])}))["totals"]["docs_kept"]
    # Dying at the 4th ja document leaves en finished and ja half written.
    script = KILLER.format(repo=str(REPO), root=str(root), tok=str(tokenizer_dir), en=str(en_corpus / "*.jsonl"),
                           ja=str(ja), kill_after=en_kept + 4, workers=workers)
    # Output goes to a file, not a pipe: orphaned workers (they exit within a second of noticing the
    # dead parent) must not keep the test waiting on a pipe they inherited.
    log = tmp_path / "killed.log"
    with open(log, "w") as handle:
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                              timeout=300)
    assert done.returncode == -9, log.read_text()
    assert not (root / MANIFEST_NAME).exists()
    assert (root / "en" / "domain.json").is_file(), "the finished domain was published"
    assert not (root / "ja").exists(), "the interrupted domain is not published"
    assert list((root / ".partial" / "ja").rglob("*.idx")), "the kill left partial shards behind (in .partial only)"
    cfg = make_config(root, tokenizer_dir, {"en": domain([en_corpus / "*.jsonl"], val_fraction=0.1, shard_max_mb=0.01),
                                            "ja": domain([ja], val_fraction=0.1, shard_max_mb=0.0001)})
    prepare(cfg)
    assert not (root / ".partial").exists()
    clean_root = tmp_path / "clean"
    cfg.data.root = str(clean_root)
    prepare(cfg)
    assert tree_bytes(root) == tree_bytes(clean_root)


def test_interrupt_mid_domain_leaves_nothing_that_looks_complete(tmp_path, tokenizer_dir, en_corpus, monkeypatch):
    import data.prepare as prepare_module

    cfg = make_config(tmp_path / "root", tokenizer_dir, {"en": domain([en_corpus / "*.jsonl"], shard_max_mb=0.01)})
    prepare(cfg)
    assert (tmp_path / "root" / MANIFEST_NAME).exists()
    cfg.data.domains["en"].clean.min_chars = 50  # config change: the domain must be redone
    docs = {"n": 0}
    original = prepare_module.ShardSequence._write

    def interrupt(self, writer, keys, lengths, tokens):
        docs["n"] += len(lengths)
        if docs["n"] >= 60:
            raise KeyboardInterrupt
        return original(self, writer, keys, lengths, tokens)

    monkeypatch.setattr(prepare_module.ShardSequence, "_write", interrupt)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    root = tmp_path / "root"
    assert not (root / MANIFEST_NAME).exists(), "the old manifest no longer describes the root"
    assert not list(root.rglob("*.tmp")) and not (root / ".partial" / "en").exists()


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_inputs_are_skipped_counted_and_located(tmp_path, tokenizer_dir, en_texts, workers):
    write_jsonl(tmp_path / "in" / "good.jsonl", en_texts[:30])
    bad = tmp_path / "in" / "bad.jsonl"
    bad.write_bytes(
        json.dumps({"text": en_texts[40]}).encode() + b"\n"
        + b'{"text": "unterminated\n'
        + b'{"text": "bad utf-8 \xff\xfe here"}\n'
        + json.dumps({"body": "no text field"}).encode() + b"\n"
        + json.dumps({"text": 42}).encode() + b"\n"
    )
    (tmp_path / "in" / "empty.jsonl").write_bytes(b"")
    (tmp_path / "in" / "broken.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:12])
    cfg = make_config(tmp_path / "root", tokenizer_dir, {"en": domain([tmp_path / "in" / "*"])}, workers=workers)
    record = prepare(cfg)["domains"]["en"]
    skipped, examples = record["skipped"], record["drop_examples"]
    assert record["files_read"] == 3 and record["docs_read"] == 31  # the broken file is not "read"
    assert skipped["malformed_json"] == 1 and examples["malformed_json"] == [f"{bad}:2"]
    assert skipped["invalid_utf8"] == 1 and examples["invalid_utf8"] == [f"{bad}:3"]
    assert skipped["missing_field"] == 1 and examples["missing_field"] == [f"{bad}:4"]
    assert skipped["not_a_string"] == 1
    assert skipped["empty_file"] == 1 and examples["empty_file"] == [str(tmp_path / "in" / "empty.jsonl")]
    assert skipped["unreadable_file"] == 1 and "broken.jsonl.gz" in examples["unreadable_file"][0]
    assert record["docs_kept"] == 31 and record["dropped"] == {}, "reader skips are not dropped documents"
    # strict: the first bad record is an error naming the file and line.
    cfg.strict = True
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2: malformed JSON"):
        prepare(cfg)


def test_counts_add_up_in_the_record_and_the_log_line(tmp_path, tokenizer_dir, en_texts, caplog):
    # Reader skips (jsonl and plain-text readers, records and a whole file), filter drops and
    # duplicates together: kept + dropped == docs read, and the skips are reported apart.
    (tmp_path / "in").mkdir()
    bad = tmp_path / "in" / "a.jsonl"
    bad.write_bytes(
        b"".join(json.dumps({"text": text}).encode() + b"\n" for text in en_texts[:20])
        + b'{"text": "unterminated\n' + b"[1, 2]\n" + json.dumps({"text": ""}).encode() + b"\n"
        + json.dumps({"text": "short"}).encode() + b"\n"
        + b"".join(json.dumps({"text": text}).encode() + b"\n" for text in en_texts[:3])  # duplicates
    )
    (tmp_path / "in" / "b.txt").write_bytes(b"another short line\n\xff\xfe not utf-8\n"
                                            + en_texts[25].replace("\n", " ").encode() + b"\n")
    (tmp_path / "in" / "c.jsonl").write_bytes(b"")
    cfg = make_config(tmp_path / "root", tokenizer_dir, {
        "en": domain([tmp_path / "in" / "*"], clean=CleanConfig(min_chars=30))}, workers=2)
    caplog.set_level("INFO", logger="ayumi.data")
    record = prepare(cfg)["domains"]["en"]
    assert record["dropped"] == {"duplicate": 3, "too_short": 2}
    assert record["skipped"] == {"empty_file": 1, "empty_text": 1, "invalid_utf8": 1, "malformed_json": 1,
                                 "missing_field": 1}
    assert record["docs_read"] == 20 + 1 + 3 + 2 == 26, "documents that reached the filters, skips not among them"
    assert record["docs_kept"] == 21
    assert record["docs_kept"] + sum(record["dropped"].values()) == record["docs_read"]
    line = next(message for message in caplog.messages if message.startswith("en: kept"))
    kept, read, dropped = map(int, re.match(r"en: kept (\d+) of (\d+) docs \(dropped (\d+): ", line).groups())
    assert (kept, read, dropped) == (21, 26, 5) and kept + dropped == read
    assert "duplicate=3, too_short=2)" in line
    assert "readers skipped 5: empty_file=1, empty_text=1, invalid_utf8=1, malformed_json=1, missing_field=1" in line


def _decoded_docs(root: Path, name: str, tokenizer_dir: Path) -> list[str]:
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "tokenizer.model"))
    return [sp.decode(doc[:-1].tolist()) for split in ("train", "val") for doc in read_split(root, name, split)]


@pytest.mark.parametrize("mode, kept", [
    ("exact", ["py4", "py2", "wide", "narrow"]),  # only the byte-identical copy goes
    ("normalized", ["py4", "wide"]),  # also indentation and width
    ("off", ["py4", "py2", "py4", "wide", "narrow"]),
])
def test_dedup_mode_decides_what_is_a_duplicate(tmp_path, tokenizer_dir, mode, kept):
    texts = {
        "py4": "def area(width, height):\n    if width < 0:\n        return 0\n    return width * height",
        "py2": "def area(width, height):\n  if width < 0:\n    return 0\n  return width * height",
        "wide": "Ｍｏｄｅｌ ＡＢＣ１２３ costs ｄｏｌｌａｒｓ",
        "narrow": "Model ABC123 costs dollars",
    }
    order = ["py4", "py2", "py4", "wide", "narrow"]
    path = write_jsonl(tmp_path / "in" / "code.jsonl", [texts[name] for name in order])
    clean = CleanConfig(normalize="NFC", dedup=mode)
    root = tmp_path / "root"
    record = prepare(make_config(root, tokenizer_dir, {"code": domain([path], clean=clean)}))["domains"]["code"]
    assert _decoded_docs(root, "code", tokenizer_dir) == [texts[name] for name in kept]
    assert record["docs_kept"] == len(kept) and record["dropped"].get("duplicate", 0) == len(order) - len(kept)
    if mode != "normalized":  # the key on disk is the exact key: blake2b of the cleaned bytes, nothing folded
        exact = [hashlib.blake2b(texts[name].encode(), digest_size=16).digest() for name in kept]
        assert split_keys(root, "code", "train") == exact


def test_input_pattern_matching_nothing_names_the_domain(tmp_path, tokenizer_dir):
    cfg = make_config(tmp_path / "root", tokenizer_dir, {"en": domain([tmp_path / "nowhere" / "*.jsonl"])})
    with pytest.raises(CorpusError, match=r"data\.domains\.en\.inputs"):
        prepare(cfg)


def test_domain_emptied_by_filters_is_an_error(tmp_path, tokenizer_dir, en_texts):
    path = write_jsonl(tmp_path / "in" / "en.jsonl", en_texts[:20] + ["short"])
    cfg = make_config(tmp_path / "root", tokenizer_dir, {
        "ja": domain([path], clean=CleanConfig(min_chars=10, script="ja", min_script_share=0.5))})
    with pytest.raises(EmptyDomainError, match=r"domain 'ja' is empty.*low_script_share=20 \(data\.domains\.ja\.clean\.min_script_share\).*too_short=1"):
        prepare(cfg)
    assert not (tmp_path / "root" / "ja").exists() and not (tmp_path / "root" / MANIFEST_NAME).exists()


def test_all_formats_feed_one_domain(tmp_path, tokenizer_dir, en_texts):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    inputs = tmp_path / "in"
    inputs.mkdir()
    with gzip.open(inputs / "a.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps({"content": t}) + "\n" for t in en_texts[:10])
    (inputs / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"content": t}) + "\n" for t in en_texts[10:20]).encode()))
    pq.write_table(pa.table({"content": en_texts[20:30]}), inputs / "c.parquet", row_group_size=4)
    datasets.Dataset.from_dict({"content": en_texts[30:40]}).save_to_disk(str(inputs / "d_hf"))
    record = prepare(make_config(tmp_path / "root", tokenizer_dir, {
        "en": domain([inputs / "*"], text_field="content")}))["domains"]["en"]
    assert record["files_read"] == 4 and record["docs_read"] == 40
    text_dir = tmp_path / "txt"
    text_dir.mkdir()
    paragraphs = [re.sub(r"\n\s*\n", "\n", text) for text in en_texts[:12]]  # no blank line inside a paragraph
    (text_dir / "book.txt").write_text("\n\n".join(paragraphs), encoding="utf-8")
    record = prepare(make_config(tmp_path / "root2", tokenizer_dir, {
        "en": domain([text_dir / "book.txt"], text_unit="paragraph")}))["domains"]["en"]
    assert record["docs_read"] == 12


def test_trainer_contract_refuses_another_tokenizer(tmp_path, tokenizer_dir, other_tokenizer_dir, en_corpus):
    cfg = make_config(tmp_path / "root", tokenizer_dir, {"en": domain([en_corpus / "*.jsonl"], val_fraction=0.1)})
    manifest = prepare(cfg)
    ours, other = load_tokenizer_info(tokenizer_dir), load_tokenizer_info(other_tokenizer_dir)
    assert ours.sha256 != other.sha256
    record = json.loads((tmp_path / "root" / "en" / "domain.json").read_text())
    assert record["tokenizer"]["sha256"] == ours.sha256 and record["tokenizer"]["vocab_size"] == ours.vocab_size
    check_manifest_tokenizer(manifest, ours.sha256, ours.model_path)  # the right tokenizer passes
    with pytest.raises(TokenizerMismatchError) as excinfo:
        check_manifest_tokenizer(manifest, other.sha256, other.model_path, root=str(tmp_path / "root"))
    assert ours.sha256 in str(excinfo.value) and other.sha256 in str(excinfo.value)
    # Re-preparing with the other tokenizer redoes the shards, recorded with its sha.
    cfg.tokenizer_dir = str(other_tokenizer_dir)
    assert prepare(cfg)["tokenizer"]["sha256"] == other.sha256
    record = json.loads((tmp_path / "root" / "en" / "domain.json").read_text())
    assert record["tokenizer"]["sha256"] == other.sha256


def test_shards_feed_the_trainer_loader(tmp_path, tokenizer_dir, en_corpus):
    prepare(make_config(tmp_path / "root", tokenizer_dir, {"en": domain([en_corpus / "*.jsonl"], val_fraction=0.1)}))
    _, train, val = open_run_data(tmp_path / "root", None, seq_len=32, vocab_size=600, verify="full")
    assert list(train) == ["en"] and list(val) == ["en"]
    assert len(train["en"]) > 10 and train["en"].sample(3).shape == (33,)


def test_many_small_files_share_work_items_and_keep_their_locations(tmp_path, tokenizer_dir, en_texts):
    from data.prepare import DomainJob, FileEnd, work_stream

    files = []
    for number in range(12):
        texts = en_texts[3 * number:3 * number + 3]
        if number == 7:
            texts = [texts[0], "tiny", texts[1]]  # dropped as too short: line 2 of file 7
        if number == 10:
            texts = [texts[0], texts[1], en_texts[4]]  # a copy of file 1's second document: line 3 of file 10
        files.append(write_jsonl(tmp_path / "in" / f"part_{number:02d}.jsonl", texts))
    dom = domain([tmp_path / "in" / "*.jsonl"], clean=CleanConfig(min_chars=20))
    items = list(work_stream([DomainJob("en", dom, files, [], "fp")], strict=False, chunk_bytes=1 << 20))
    work = [meta for meta, call in items if call is not None]
    ends = [meta[1].path for meta, call in items if isinstance(meta[1], FileEnd)]
    assert len(work) == 1, "small files are grouped into one work item, not one per file"
    assert ends == files and items[-1] == (("en", None), None)

    record = prepare(make_config(tmp_path / "root", tokenizer_dir, {"en": dom}, workers=2))["domains"]["en"]
    assert record["files_read"] == 12 and record["docs_read"] == 36
    assert record["drop_examples"] == {"too_short": [f"{files[7]}:2"], "duplicate": [f"{files[10]}:3"]}
