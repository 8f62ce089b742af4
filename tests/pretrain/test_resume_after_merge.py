"""A run resumes across `ayumi data merge`: its checkpoints identify the data by the shards it was first written in
(data/lineage.py), so a merge is no change of data, and a change of content after it still is; its data.exclude
documents, named by the old shards, are found in the merged ones; a document no shard held is refused in one line.
The merge itself (documents, keys, stream, kills): tests/data/test_merge.py."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from data.exclude import Entry, ExcludeError, check_documents, read_exclude_file
from data.manifest import DOMAIN_RECORD_NAME, MANIFEST_NAME, ManifestError, build_manifest, load_manifest, seal
from data.manifest import write_json_atomic
from data.merge import merge_root
from data.token_root import TokenRoot
from pretrain.excluded import apply_entries, source_shards
from pretrain.startup.resume import data_identity
from tests.helpers import EN_TEXT, EOS, JA_TEXT, VOCAB, byte_tokens, run_training, tiny_overrides, train_losses

SHARDS, DOCS = 8, 5
"""Each domain's training split: 8 shards of 5 documents (1,300-1,900 tokens a shard)."""
MERGED_MB = 0.005
"""Merged: 3 shards a domain, so an old shard's documents may straddle two new ones."""
EXCLUDED = (("en", "part_00003", 2), ("en", "part_00004", 4), ("ja", "part_00006", 0))
"""Documents named by shards the merge replaces."""


def write_many_shards(root: Path, changed: bool = False) -> Path:
    """A byte-level root (tests/helpers.py's texts) of two domains in SHARDS small shards each, every document
    distinct; `changed`: one byte of one document other (the same sizes: a re-prepared corpus)."""
    with TokenRoot(root, vocab_size=VOCAB, eos_id=EOS, name="many") as out:
        for name, text in (("ja", JA_TEXT), ("en", EN_TEXT)):
            for shard in range(SHARDS):
                with out.shard(name, "train") as writer:
                    for doc in range(DOCS):
                        tag = "x" if changed and (name, shard, doc) == ("en", 5, 1) else "#"
                        writer.add_document(byte_tokens(f"{tag}{shard}.{doc} {text[(7 * shard + doc) % 40:]}"))
            with out.shard(name, "val") as writer:
                writer.add_document(byte_tokens(text))
    return root


def merge(root: Path) -> None:
    """`ayumi data merge ROOT --shard-max-mb 0.005`, in process (tests/data/test_merge.py runs the command)."""
    merge_root(root, None, MERGED_MB)
    shards = load_manifest(root)["domains"]["en"]["splits"]["train"]["shards"]
    assert 1 < len(shards) < SHARDS, shards


@pytest.fixture(scope="module")
def many(tmp_path_factory) -> Path:
    return write_many_shards(tmp_path_factory.mktemp("many") / "root")


def excluding_source(root: Path, entries: list[Entry], seq_len: int = 16):
    """The cpu_tiny run's sample source on `root` (pretrain/stream.py), with `entries` applied."""
    from pretrain.config import compose_config
    from pretrain.stream import open_training_data, sample_source

    cfg = compose_config(["experiment=cpu_tiny", f"data.root={root}", "model.vocab_size=512",
                          f"train.seq_len={seq_len}"])
    source = sample_source(cfg, open_training_data(cfg, validation=False)[0])
    if entries:
        apply_entries(source, entries)
    return source


def samples_of(source, count: int = 400) -> list[list[int]]:
    return [source.get(index)[0].tolist() for index in range(count)]


def holds_excluded(source, index: int) -> bool:
    from data.provenance import sample_pieces

    domain, _, sample, samples = source.origin(index)
    return any((domain, piece.shard, piece.document) in EXCLUDED for piece in sample_pieces(samples, sample))


def test_an_exclusion_named_before_the_merge_excludes_the_same_samples_after_it(many, tmp_path):
    root = shutil.copytree(many, tmp_path / "root")
    entries = [Entry(40, EXCLUDED)]
    plain, before = samples_of(excluding_source(root, [])), samples_of(excluding_source(root, entries))
    assert sum(a != b for a, b in zip(plain, before)) > 10  # the documents are read: excluding them changes samples
    identity = data_identity(str(root))
    merge(root)
    assert samples_of(excluding_source(root, entries)) == before
    listed = tmp_path / "exclude.txt"
    listed.write_text("".join(f"{d} {s} {i}\n" for d, s, i in EXCLUDED))
    check_documents(read_exclude_file(listed), source_shards(excluding_source(root, [])), str(listed))
    assert data_identity(str(root)) == identity
    # Merged again, into one shard: the history chains back to the shards the run named.
    merge_root(root, None, 1.0)
    assert [s["name"] for s in load_manifest(root)["domains"]["en"]["splits"]["train"]["shards"]] == ["merged2_00000"]
    assert samples_of(excluding_source(root, entries)) == before and data_identity(str(root)) == identity


def test_a_document_no_shard_held_is_refused_in_one_line(many, tmp_path):
    root = shutil.copytree(many, tmp_path / "root")
    merge(root)
    source = excluding_source(root, [])
    listed = tmp_path / "exclude.txt"
    listed.write_text("en part_00003 2\nen part_00099 1\n")
    with pytest.raises(ExcludeError) as refused:  # a data.exclude file
        check_documents(read_exclude_file(listed), source_shards(source), str(listed))
    assert str(refused.value).startswith(f"{listed}: domain 'en' has no shard 'part_00099' (it has merged_00000, ")
    assert "now or before a merge; fix the line" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ExcludeError) as refused:  # the run's ledger (its checkpoint, excluded_documents.json)
        apply_entries(source, [Entry(0, (("en", "part_00003", 2),)), Entry(8, (("ja", "part_00099", 1),))])
    assert str(refused.value).startswith("the run's excluded documents (excluded_documents.json): domain 'ja' has no "
                                         "shard 'part_00099'")
    assert "Fix: restore that data root" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ExcludeError, match=r"shard en/part_00003 holds documents 0-4, not 5"):
        apply_entries(source, [Entry(0, (("en", "part_00003", 5),))])


def test_a_merge_history_that_disagrees_with_its_split_is_refused(many, tmp_path):
    from data.domains import open_run_data

    root = shutil.copytree(many, tmp_path / "root")
    merge(root)
    manifest = load_manifest(root)
    record = {key: value for key, value in manifest["domains"]["ja"].items() if key != "record_sha256"}
    record["merged"][0]["shards"]["train"]["docs"][2] += 1  # sealed again: only the counts can tell
    record = seal(record)
    write_json_atomic(root / "ja" / DOMAIN_RECORD_NAME, record)
    write_json_atomic(root / MANIFEST_NAME, build_manifest(manifest["name"], manifest["tokenizer"],
                                                           {**manifest["domains"], "ja": record},
                                                           manifest["overlap_check"]))
    with pytest.raises(ManifestError) as refused:
        open_run_data(root, None, seq_len=16)
    assert str(refused.value).splitlines() == [
        f"{root / 'ja' / DOMAIN_RECORD_NAME}: merge 1 lists {SHARDS * DOCS + 1} documents, "
        f"{record['splits']['train']['tokens']} tokens in the train shards it replaced; the split holds "
        f"{SHARDS * DOCS} documents, {record['splits']['train']['tokens']} tokens: the record was damaged. Fix: re-run "
        "`ayumi data prepare` for this data root"]


def test_a_run_resumes_across_a_merge_and_its_exclusion_follows(many, tmp_path):
    """3 steps on the root of many shards with data.exclude naming some of them, checkpointed; the root merged; the
    resume takes steps 4-6 with the losses of the same 6 steps on the unmerged root. Then the root re-made with one
    document changed, and merged: the next resume is refused in one line."""
    assert sum(holds_excluded(excluding_source(many, [], seq_len=64), i) for i in range(24, 48)) >= 3  # steps 4-6
    listed = tmp_path / "exclude.txt"
    listed.write_text("".join(f"{d} {s} {i}\n" for d, s, i in EXCLUDED))
    common = [f"data.exclude={listed}", "train.eval_interval=0", "checkpoint.interval=0"]

    def train(root: Path, runs: Path, *extra: str) -> subprocess.CompletedProcess:
        return run_training(tiny_overrides(root, runs, *common, *extra), nproc=2, launcher="fork")

    whole = train(many, tmp_path / "whole", "train.max_steps=6")
    assert whole.returncode == 0, whole.stdout[-4000:]
    root = shutil.copytree(many, tmp_path / "root")
    first = train(root, tmp_path / "split", "train.max_steps=3")
    assert first.returncode == 0, first.stdout[-4000:]
    merge(root)
    resumed = train(root, tmp_path / "split", "train.max_steps=6")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert "resumed from" in resumed.stdout
    expected, got = train_losses(tmp_path / "whole" / "cpu_tiny"), train_losses(tmp_path / "split" / "cpu_tiny")
    assert sorted(got) == list(range(1, 7)) and got == expected
    ledger = json.loads((tmp_path / "split" / "cpu_tiny" / "excluded_documents.json").read_text())
    assert ledger == {"entries": [{"from_sample": 0, "documents": [list(d) for d in EXCLUDED]}]}

    shutil.rmtree(root)
    merge(write_many_shards(root, changed=True))
    refused = train(root, tmp_path / "split", "train.max_steps=9")
    assert refused.returncode == 2, refused.stdout[-4000:]
    said = [line for line in refused.stdout.splitlines() if "changed since the run trained on it" in line]
    assert len(said) == 1 and "at step 6: data.root's domain 'en' was the shards trained on, now other shards" in \
        said[0] and "'ja'" not in said[0], refused.stdout[-4000:]
