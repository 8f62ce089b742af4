"""Fault drills on a data root, through the real entries: `ayumi train` (its check before any rank starts)
and 2 ranks under torchrun (what a scheduler's job runs). Each damage is refused at training start
with one line naming the file, no traceback; `ayumi data verify` finds bytes overwritten in place.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, cpu_env, run_training, tiny_overrides, write_tiny_corpus

pytestmark = pytest.mark.slow
SHORT = ["train.max_steps=4", "train.eval_interval=0", "checkpoint.save_final=false"]


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_tiny_corpus(tmp_path / "data")


def ayumi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)


def ayumi_frames(output: str) -> list[str]:
    """Traceback lines inside ayumi's own code (the launcher's own report of failed children is not ours)."""
    return [line for line in output.splitlines()
            if line.strip().startswith(("File \"" + str(REPO / "data"), "File \"" + str(REPO / "pretrain")))]


def ranks(corpus: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_training(tiny_overrides(corpus, tmp_path / "runs", *SHORT, *extra), nproc=2)


def overwrite_token(bin_path: Path, index: int, value: int) -> None:
    raw = bytearray(bin_path.read_bytes())
    raw[2 * index:2 * index + 2] = value.to_bytes(2, "little")  # vocabulary 512: uint16 ids
    bin_path.write_bytes(bytes(raw))


@pytest.mark.parametrize("remove, hint", [(("part_00000.bin", "part_00000.idx"), ""),
                                          (("part_00000.idx",), " (its .bin does: an unfinished or damaged shard)")])
def test_a_listed_shard_deleted_is_refused_before_any_rank_starts(corpus, tmp_path, remove, hint):
    """The data error itself, one line naming the file and the fix (not a plan problem around it)."""
    for name in remove:
        (corpus / "en" / "train" / name).unlink()
    proc = ayumi("train", *tiny_overrides(corpus, tmp_path / "runs", *SHORT))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"ayumi train: shard index {corpus / 'en' / 'train' / 'part_00000.idx'} does not exist{hint}. "
        "Fix: re-run `ayumi data prepare` for this data root"]
    assert proc.stdout == "" and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("reseal", [False, True])
def test_an_edited_domain_record_is_refused_with_one_line(corpus, tmp_path, reseal):
    """domain.json, not the manifest: edited by hand (its checksum no longer matches), or edited and re-sealed
    (then it disagrees with the manifest's copy of it)."""
    from data.manifest import seal

    path = corpus / "en" / "domain.json"
    record = json.loads(path.read_text())
    record["splits"]["train"]["shards"][0]["tokens"] += 1
    path.write_text(json.dumps(seal(record) if reseal else record))
    proc = ayumi("train", *tiny_overrides(corpus, tmp_path / "runs", *SHORT))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    why = (f"differs from the record of 'en' in {corpus / 'manifest.json'}" if reseal
           else "was changed after `ayumi data prepare` wrote it")
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ayumi train: {path} {why}"), proc.stderr
    assert lines[0].endswith("Fix: re-run `ayumi data prepare` for this data root") and proc.stdout == ""
    assert not (tmp_path / "runs").exists()


def test_a_truncated_bin_is_refused_by_every_rank_with_one_line(corpus, tmp_path):
    bin_path = corpus / "ja" / "train" / "part_00000.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-6])
    proc = ranks(corpus, tmp_path)
    assert proc.returncode != 0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("pretrain.train:")]
    assert len(lines) == 1 and str(bin_path) in lines[0] and "truncated or corrupt" in lines[0], proc.stdout[-3000:]
    assert not ayumi_frames(proc.stdout)  # torchrun reports the failed children; the ranks print no traceback


def test_overwritten_token_bytes_are_caught_at_start_and_by_verify(corpus, tmp_path):
    bin_path = corpus / "en" / "train" / "part_00000.bin"
    overwrite_token(bin_path, 100, 511)  # a valid id: only the checksum can tell
    proc = ranks(corpus, tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("pretrain.train:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stdout[-3000:]
    assert str(bin_path) in lines[0] and "is not the recorded" in lines[0]
    verify = ayumi("data", "verify", str(corpus))
    assert verify.returncode == 1 and str(bin_path) in verify.stderr and "1 problem(s)" in verify.stderr
    assert ayumi("data", "verify", str(write_tiny_corpus(tmp_path / "clean"))).returncode == 0


def test_an_out_of_vocabulary_id_stops_the_rank_that_reads_it(corpus, tmp_path):
    """With checksums off (data.verify=sizes, as on big data), the sample check catches it before the model."""
    bin_path = corpus / "en" / "train" / "part_00000.bin"
    for index in range(0, 2000, 50):
        overwrite_token(bin_path, index, 4000)
    proc = ranks(corpus, tmp_path, "data.verify=sizes")
    assert proc.returncode != 0
    assert f"{bin_path}: token " in proc.stdout and "outside the vocabulary [0, 512)" in proc.stdout, proc.stdout[-3000:]
    assert "IndexError" not in proc.stdout and not ayumi_frames(proc.stdout)
    verify = ayumi("data", "verify", str(corpus))
    assert verify.returncode == 1 and ("holds id 4000" in verify.stderr or "is not the recorded" in verify.stderr)


@pytest.mark.parametrize("vocab", [300, 4096])
def test_a_sidecar_vocabulary_edited_is_refused(corpus, tmp_path, vocab):
    manifest_path = corpus / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tokenizer"]["vocab_size"] = vocab
    manifest_path.write_text(json.dumps(manifest))
    proc = ayumi("train", *tiny_overrides(corpus, tmp_path / "runs", *SHORT))
    assert proc.returncode == 2 and str(manifest_path) in proc.stderr and "was changed after" in proc.stderr
    # The trainer's own check (a job started by a scheduler, not through `ayumi train`) says the same once.
    proc = ranks(corpus, tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("pretrain.train:")]
    assert len(lines) == 1 and str(manifest_path) in lines[0], proc.stdout[-3000:]


def test_resume_notices_that_the_data_changed(corpus, tmp_path):
    """No curriculum: the checkpoint records each domain's samples and shard checksums."""
    overrides = ["curriculum=none", "curriculum.default_max_repetition=100", "train.eval_interval=0"]
    first = run_training(tiny_overrides(corpus, tmp_path / "runs", *overrides, "train.max_steps=4"), nproc=2, launcher="fork")
    assert first.returncode == 0, first.stdout[-3000:]
    write_tiny_corpus(corpus, repeats=41)  # one more document per domain: a different stream
    again = run_training(tiny_overrides(corpus, tmp_path / "runs", *overrides, "train.max_steps=6"), nproc=2)
    assert again.returncode != 0
    # Said before the ranks build anything, from the shard records the checkpoint's ayumi.json holds (issue 48); the
    # mixer's own check (each domain's samples) stays behind it for a checkpoint without that record.
    for domain in ("ja", "en"):
        assert f"data.root's domain '{domain}' was the shards trained on, now other shards" in again.stdout, \
            again.stdout[-3000:]
    meta_path = next((tmp_path / "runs" / "cpu_tiny" / "checkpoints").glob("step_*/ayumi.json"))
    meta = json.loads(meta_path.read_text())
    del meta["data"]  # a checkpoint saved before the record: the ranks' own check refuses
    meta_path.write_text(json.dumps(meta))
    older = run_training(tiny_overrides(corpus, tmp_path / "runs", *overrides, "train.max_steps=6"), nproc=2)
    assert older.returncode != 0
    assert "cannot resume: the training data changed" in older.stdout and "ja: 167 -> " in older.stdout, \
        older.stdout[-3000:]
    assert os.path.isdir(tmp_path / "runs" / "cpu_tiny")
