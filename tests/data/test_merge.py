"""`ayumi data merge`: many shards into few, through the real CLI; the documents of each split, in order, and
the training stream and losses are unchanged, megatron-core reads the result, and a kill -9 leaves the old root
usable."""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from data.manifest import load_manifest
from data.merge import merge_root
from data.prepare import prepare
from tests.data.helpers import JA_PARAGRAPHS, domain, losses_on_roots, make_config, write_jsonl
from tests.helpers import REPO

SMALL_MB = 0.002  # about 2 KB of tokens per shard: a root of many shards from a few hundred documents
MERGED_MB = "0.05"  # en's training split (about 130 KB) merges into a few shards, the rest into one each


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory, tokenizer_dir, en_texts) -> tuple[Path, dict]:
    """A prepared root of two domains in many small shards (train and val), and its config's domains; merged
    copies of it are made by each test."""
    folder = tmp_path_factory.mktemp("many")
    en = write_jsonl(folder / "in" / "en.jsonl", en_texts)
    ja = write_jsonl(folder / "in" / "ja.jsonl", [p * (i % 5 + 1) for i, p in enumerate(JA_PARAGRAPHS * 6)])
    domains = {"en": domain([en], val_fraction=0.1, shard_max_mb=SMALL_MB),
               "ja": domain([ja], val_fraction=0.2, shard_max_mb=SMALL_MB / 8)}
    prepare(make_config(folder / "root", tokenizer_dir, domains))
    return folder / "root", domains


def copy_root(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def ayumi_data(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def split_documents(root: Path) -> dict[tuple[str, str], list[list[int]]]:
    """Every split's documents, in order, as training opens them (the manifest's records, checked)."""
    from data.domains import open_run_data

    _, train, val = open_run_data(root, None, seq_len=8, verify="full")
    out = {}
    for split, domains in (("train", train), ("val", val)):
        for name, samples in domains.items():
            out[name, split] = [doc.tolist() for reader in samples.readers for doc in reader]
    return out


def training_stream(root: Path, samples: int = 64) -> list[list[int]]:
    """The first global samples of a cpu_tiny run on `root`, as the trainer draws them (pretrain/stream.py)."""
    from pretrain.config import compose_config
    from pretrain.stream import open_training_data, sample_source

    cfg = compose_config(["experiment=cpu_tiny", f"data.root={root}", "model.vocab_size=600", "train.seq_len=16"])
    train, _ = open_training_data(cfg)
    source = sample_source(cfg, train)
    return [source.get(index)[0].tolist() for index in range(samples)]


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def shard_counts(root: Path) -> dict[tuple[str, str], int]:
    manifest = load_manifest(root)
    return {(name, split): len(info["shards"]) for name, record in manifest["domains"].items()
            for split, info in record["splits"].items()}


def test_merge_keeps_every_document_in_order_and_megatron_core_reads_it(many_shards, tmp_path, tokenizer_dir, caplog):
    source, domains = many_shards
    root = copy_root(source, tmp_path / "root")
    before, stream, keys = split_documents(root), training_stream(root), {
        path: path.read_bytes() for path in sorted(root.glob("*/*/keys.bin"))}
    counts = shard_counts(root)
    assert min(counts.values()) >= 3, counts

    done = ayumi_data("merge", str(root), "--shard-max-mb", MERGED_MB)
    assert done.returncode == 0, done.stderr
    after = shard_counts(root)
    assert all(after[key] < counts[key] for key in counts) and 1 < after["en", "train"] <= 4, (counts, after)
    assert f"en: train {counts['en', 'train']:,} -> {after['en', 'train']:,} shards" in done.stdout
    assert split_documents(root) == before
    assert training_stream(root) == stream
    assert {path: path.read_bytes() for path in sorted(root.glob("*/*/keys.bin"))} == keys
    assert not (root / ".partial").exists()
    # The same training steps on the root before (the fixture's) and after the merge.
    losses = losses_on_roots({"before": source, "after": root}, tmp_path, steps=3)
    assert len(losses["before"]) == 3 and losses["after"] == losses["before"]
    on_disk = sorted(p.name for p in (root / "en" / "train").iterdir())
    listed = load_manifest(root)["domains"]["en"]["splits"]["train"]["shards"]
    assert on_disk == sorted([f"{s['name']}.{ext}" for s in listed for ext in ("bin", "idx")] + ["keys.bin"])
    assert all(s["name"].startswith("merged_") for s in listed)  # no old name reused: old readers cannot mistake them

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDataset
    theirs = [IndexedDataset(str(root / "ja" / "train" / s["name"]))
              for s in load_manifest(root)["domains"]["ja"]["splits"]["train"]["shards"]]
    assert [dataset[i].tolist() for dataset in theirs for i in range(len(dataset))] == before["ja", "train"]

    assert ayumi_data("verify", str(root)).returncode == 0
    again = ayumi_data("merge", str(root), "--shard-max-mb", MERGED_MB)
    assert again.returncode == 0 and again.stdout.strip().endswith("nothing to merge"), again.stdout
    # Merged again, larger: a stem no shard of the history had (`merged2_`: a name means one shard for good), train
    # only (val is one shard already), the stream still the same.
    assert merge_root(root, ["en"], 1.0) == {"en": {"train": (after["en", "train"], 1)}}
    names = [s["name"] for s in load_manifest(root)["domains"]["en"]["splits"]["train"]["shards"]]
    assert names == ["merged2_00000"] and training_stream(root) == stream
    after = shard_counts(root)
    # `ayumi data prepare` with the same config finds the merged domains finished: nothing is redone.
    caplog.set_level("INFO", logger="ayumi.data")
    prepare(make_config(root, tokenizer_dir, domains))
    assert caplog.text.count("up to date") == 2 and shard_counts(root) == after


@pytest.mark.parametrize("args, message", [
    (["--domain", "fr"], "domain(s) fr are not in {root}/manifest.json (it has: en, ja)"),
    (["--shard-max-mb", "0"], "--shard-max-mb 0.0 must be > 0"),
])
def test_bad_input_is_one_line_and_changes_nothing(many_shards, args, message):
    root, _ = many_shards
    before = tree(root)
    done = ayumi_data("merge", str(root), *args)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"ayumi data merge: error: {message.format(root=root)}"]
    assert tree(root) == before


def test_not_a_data_root_is_one_line(tmp_path):
    done = ayumi_data("merge", str(tmp_path))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith(f"ayumi data merge: error: {tmp_path / 'manifest.json'} does not exist")


KILLER = """
import sys
sys.path.insert(0, {repo!r})
from tests.data.helpers import die_after_writes
from data.cli import main
die_after_writes({documents})
sys.exit(main(["merge", {root!r}, "--shard-max-mb", {mb!r}]))
"""


def test_a_merge_killed_mid_write_leaves_the_old_root_as_it_was(many_shards, tmp_path):
    """SIGKILL in the middle of the second domain's copy: no finally runs. The root is byte for byte what it
    was (bar the .partial folder nothing reads), training opens it, and the next merge completes."""
    source, _ = many_shards
    root = copy_root(source, tmp_path / "root")
    before, stream = tree(root), training_stream(root)
    en_docs = sum(load_manifest(root)["domains"]["en"]["splits"][split]["docs"] for split in ("train", "val"))
    killed = subprocess.run([sys.executable, "-c", KILLER.format(repo=str(REPO), root=str(root),
                                                                documents=en_docs + 10, mb=MERGED_MB)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert list((root / ".partial").rglob("*.idx")), "killed before it wrote anything: the test proves nothing"
    assert {k: v for k, v in tree(root).items() if not k.startswith(".partial")} == before
    assert training_stream(root) == stream

    done = ayumi_data("merge", str(root), "--shard-max-mb", MERGED_MB)
    assert done.returncode == 0, done.stderr
    assert not (root / ".partial").exists() and training_stream(root) == stream


PUBLISH_KILLER = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import data.merge as merge
written = []
def write_then_die(path, payload):
    if path.name == "manifest.json":
        os.kill(os.getpid(), signal.SIGKILL)
    written.append(path)
    original(path, payload)
original, merge.write_json_atomic = merge.write_json_atomic, write_then_die
from data.cli import main
sys.exit(main(["merge", {root!r}, "--shard-max-mb", {mb!r}]))
"""


def test_a_merge_killed_while_publishing_is_refused_by_training_and_completed_by_the_next_merge(many_shards, tmp_path):
    """Between the domain records and the manifest (two renames apart): the records disagree, training says so in
    one line, and `ayumi data merge` again adopts the merged records instead of merging again."""
    from data.domains import open_run_data
    from data.manifest import ManifestError

    source, _ = many_shards
    root = copy_root(source, tmp_path / "root")
    stream = training_stream(root)
    killed = subprocess.run([sys.executable, "-c", PUBLISH_KILLER.format(repo=str(REPO), root=str(root), mb=MERGED_MB)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    with pytest.raises(ManifestError, match=r"en/domain.json differs from the record of 'en'"):
        open_run_data(root, None, seq_len=16)
    done = ayumi_data("merge", str(root), "--shard-max-mb", MERGED_MB)
    assert done.returncode == 0, done.stderr
    assert "completed the merge of en, ja that was interrupted while publishing" in done.stderr
    assert done.stdout.strip().endswith("nothing to merge"), done.stdout
    assert training_stream(root) == stream
    assert all(s["name"].startswith("merged_") for s in json.loads((root / "manifest.json").read_text())
               ["domains"]["ja"]["splits"]["train"]["shards"])
    assert not any(p.name.startswith("part_") for p in (root / "ja" / "train").iterdir())


def test_registered_megatron_data_is_refused_by_name_and_left_alone_otherwise(tmp_path, tokenizer_dir, en_texts,
                                                                            capsys):
    """Its shards live at their prefixes, outside the root: not ayumi's to rewrite."""
    from data.cli import main
    from data.config import DomainConfig
    from data.shards import ShardWriter

    prefixes = []
    for part in range(3):
        prefixes.append(tmp_path / "megatron" / f"web_{part}")
        with ShardWriter(prefixes[-1], 600) as writer:
            writer.add_documents([[5 + part, 6, 2], [7, 2]])
    en = write_jsonl(tmp_path / "in" / "en.jsonl", en_texts[:60])
    root = tmp_path / "root"
    prepare(make_config(root, tokenizer_dir, {"en": domain([en], shard_max_mb=SMALL_MB),
                                              "web": DomainConfig(megatron=" ".join(map(str, prefixes)))}))
    web = load_manifest(root)["domains"]["web"]
    assert main(["merge", str(root), "--domain", "web"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ayumi data merge: error: domain(s) web of {root} are registered Megatron data: their shards stay at their "
        "prefixes, outside the root. Fix: merge the prefixes with Megatron's tools/merge_datasets.py, then declare "
        "the merged prefix in the domain's `megatron:`"]
    assert main(["merge", str(root), "--shard-max-mb", MERGED_MB]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("en: train ")
    assert load_manifest(root)["domains"]["web"] == web


def test_a_merge_the_disk_cannot_hold_is_refused_before_writing_and_a_long_one_says_how_far_it_is(
        many_shards, tmp_path, monkeypatch, caplog):
    import shutil

    import data.merge as merge

    source, _ = many_shards
    root = copy_root(source, tmp_path / "root")
    before = tree(root)
    real = shutil.disk_usage(root)
    monkeypatch.setattr(merge.shutil, "disk_usage", lambda path: real._replace(free=100_000))
    with pytest.raises(merge.MergeError, match=rf"^merging needs 0\.00 GiB free under {root} \(a copy of the shards "
                                               r"it merges, until the old ones are removed\), 0\.00 GiB are\. Fix: "):
        merge_root(root, None, float(MERGED_MB))
    assert tree(root) == before
    monkeypatch.undo()
    monkeypatch.setattr(merge, "PROGRESS_SECONDS", 0.0)
    caplog.set_level("INFO", logger="ayumi.data")
    shards = shard_counts(root)["ja", "train"]
    merge_root(root, ["ja"], float(MERGED_MB))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ja/train: ")]
    assert lines[0] == f"ja/train: 0 of {shards} shards, 0.0 MB copied, 0.0 MB/s", lines
    assert lines[-2].startswith(f"ja/train: {shards - 1} of {shards} shards, 0.0") and len(lines) == shards + 1
