"""`ayumi batch RUN_DIR --step N` names the samples the model really trained on: proven against the token ids a
real run handed the model (tests/pretrain/batch_train.py writes them down), across a stage switch to longer
samples, a rollback that skipped batches, and a resume on another number of ranks, in one short run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.shards import ShardReader
from pretrain.step_samples import step_batch
from tests.helpers import REPO, cpu_env, read_jsonl, run_training, tiny_overrides

pytestmark = pytest.mark.slow

ENTRY = str(REPO / "tests" / "pretrain" / "batch_train.py")
RUN = [
    "curriculum=tiny",
    # Steps 1-16: 64-token samples; steps 17-40: 128-token samples (two slots each), another mix.
    "curriculum.stages=[{name:short,tokens:8192,weights:{ja:0.6,en:0.4}},"
    "{name:long,tokens:12288,seq_len:128,weights:{ja:0.3,en:0.7}}]",
    "train.tokens=20480", "model.max_seq_len=128", "checkpoint.interval=0", "train.eval_interval=0",
    # A detector that judges from step 9, a recovery ring every 4 steps: the LR x50 at steps 25-27 is a spike at
    # step 28, rolled back to step 20 with 2 batches (global samples [160, 176)) skipped.
    "stability.detector.warmup_steps=8", "stability.detector.min_history=6",
    "stability.detector.stage_switch_grace_steps=2", "stability.recovery.ring_interval=4",
    "stability.recovery.rollback_steps=4", "stability.recovery.skip_batches=2", "stability.recovery.ring_keep=5",
    "stability.recovery.lr_cooldown_steps=4", "+stability.inject.lr_multiply={24:50.0,25:50.0,26:50.0}",
]


@pytest.fixture(scope="module")
def run_dir(corpus, tmp_path_factory) -> Path:
    """30 steps on 2 ranks (the spike and its rollback inside), then resumed on 1 rank to step 40."""
    runs = tmp_path_factory.mktemp("batch")
    for nproc, extra in ((2, ["train.max_steps=30"]), (1, [])):
        proc = run_training(tiny_overrides(corpus, runs, *RUN, *extra), nproc=nproc, launcher="fork", entry=ENTRY)
        assert proc.returncode == 0, proc.stdout[-6000:]
    return runs / "cpu_tiny"


def seen_tokens(run_dir: Path, step: int) -> dict[tuple[int, int], list[list[int]]]:
    """{(rank, micro batch): rows of token ids} the model was given in `step`, as the ranks wrote them down."""
    out = {}
    for path in sorted(run_dir.glob("seen_tokens_rank*.json")):
        rank = int(path.stem.removeprefix("seen_tokens_rank"))
        for micro, rows in enumerate(json.loads(path.read_text()).get(str(step), [])):
            out[(rank, micro)] = rows
    return out


def ayumi_batch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", "batch", *args], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=120)


def test_the_run_did_what_the_proof_needs(run_dir):
    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [(e["event"], e["step"]) for e in events]
    assert ("stage_switch", 17) in kinds and ("rollback", 28) in kinds and ("recovered", 20) in kinds
    [skipped] = [e for e in events if e["event"] == "batches_skipped"]
    assert (skipped["skip_start"], skipped["skip_stop"]) == (160, 176)
    sessions = [(e["step"], e["dp_size"]) for e in events if e["event"] == "session"]
    assert sessions == [(0, 2), (30, 1)]
    # Steps 31-40 ran on one rank: two micro batches of four rows; before, two ranks of one micro batch.
    assert sorted(seen_tokens(run_dir, 31)) == [(0, 0), (0, 1)]
    assert sorted(seen_tokens(run_dir, 30)) == [(0, 0), (1, 0)]


def test_the_command_names_the_token_ids_each_step_really_trained_on(run_dir):
    for step in (17, 21, 31):  # the switch, past the skip, one rank (test_every_step... checks all 40 in-process)
        proc = ayumi_batch(str(run_dir), "--step", str(step), "--json")
        assert proc.returncode == 0, proc.stderr
        batch = json.loads(proc.stdout)
        rebuilt: dict[tuple[int, int], list[list[int]]] = {}
        for sample in batch["samples"]:
            rebuilt.setdefault((sample["rank"], sample["micro"]), []).append(sample["tokens"])
        assert rebuilt == seen_tokens(run_dir, step), f"step {step}"
        stages = {sample["stage"] for sample in batch["samples"]}
        assert stages == {2} and {len(sample["tokens"]) for sample in batch["samples"]} == {129}, f"step {step}"
    # After the rollback, step 21 trains past the skipped range; before it, step 21 would have begun at 160.
    assert step_batch(run_dir, 21).first_sample == 176
    assert step_batch(run_dir, 20).first_sample == 152


def test_every_step_of_the_present_timeline_matches(run_dir):
    """The in-process reconstruction of all 40 steps (the command's own function) against what the model saw: steps
    16/17 straddle the stage switch, 21-28 were trained twice (the rollback), 31-40 ran on one rank."""
    for step in range(1, 41):
        batch = step_batch(run_dir, step)
        assert {s.stage for s in batch.samples} == ({1} if step <= 16 else {2}), f"step {step}"
        rebuilt: dict[tuple[int, int], list[list[int]]] = {}
        for sample in batch.samples:
            rebuilt.setdefault((sample.rank, sample.micro), []).append(sample.tokens.tolist())
        assert rebuilt == seen_tokens(run_dir, step), f"step {step}"


def test_the_documents_named_hold_the_sample(run_dir, corpus):
    """Each sample's documents and spans, read from the shards' own indexes, are the sample's tokens."""
    for step in (5, 17, 33):
        for sample in step_batch(run_dir, step).samples:
            parts = []
            for piece in sample.pieces:
                document = ShardReader(corpus / sample.domain / "train" / piece.shard).document(piece.document)
                assert len(document) == piece.length
                parts.append(np.asarray(document[piece.start:piece.stop]))
            assert np.concatenate(parts).tolist() == sample.tokens.tolist()


def test_the_table_and_bad_input(run_dir, tmp_path):
    proc = ayumi_batch(str(run_dir), "--step", "17")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("step 17: global samples [128, 136) on 2 data-parallel rank(s)")
    assert lines[1] == "stage weights: ja 0.3, en 0.7"
    assert lines[2].split()[:7] == ["rank", "micro", "row", "sample", "domain", "stream", "stage"]
    assert len(lines) == 3 + 4  # two ranks x one micro batch x two 128-token samples
    for args, says in ((["--step", "41"], "records training up to step 40 only"),
                       (["--step", "0"], "steps count from 1")):
        proc = ayumi_batch(str(run_dir), *args)
        assert proc.returncode == 2 and proc.stdout == ""
        assert len(proc.stderr.splitlines()) == 1 and says in proc.stderr
    proc = ayumi_batch(str(tmp_path / "no_run"), "--step", "1")
    assert proc.returncode == 2 and "no_run does not exist" in proc.stderr and len(proc.stderr.splitlines()) == 1


def test_the_spike_event_records_its_batch_and_the_report_shows_it(run_dir, corpus, tmp_path):
    """The spike (called at step 28, on the stretch the rollback replaced) records every sample of its step with
    its loss, gathered from both ranks, the highest-loss samples with their documents, and the domain mix."""
    from pretrain.step_samples import open_source, step_config
    from pretrain.tools.report import build as report

    [spike] = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "spike"]
    assert spike["step"] == 28 and spike["batch_first_sample"] == 27 * 8
    samples = spike["batch_samples"]
    assert [index for index, _, _ in samples] == [216, 218, 220, 222]  # 128-token samples: two slots each
    # The per-sample losses are the step's: their mean is the all-reduced loss the detector judged.
    assert np.mean([loss for _, _, loss in samples]) == pytest.approx(spike["loss"], rel=1e-3)
    assert {m["weight"] for m in spike["domain_mix"].values()} == {0.3, 0.7}
    shares = {domain: sum(d == domain for _, d, _ in samples) / 4 for domain in ("ja", "en")}
    assert {name: m["share"] for name, m in spike["domain_mix"].items()} == shares
    top = spike["top_samples"]
    assert [t["loss"] for t in top] == sorted((loss for _, _, loss in samples), reverse=True)
    source = open_source(step_config(run_dir, 28))
    for item in top:
        assert (item["rank"], item["micro"], item["row"]) == ((item["index"] - 216) // 4, 0, (item["index"] % 4) // 2)
        tokens = np.concatenate([ShardReader(corpus / item["domain"] / "train" / d["shard"]).document(d["document"])
                                 [d["start"]:d["stop"]] for d in item["documents"]])
        assert tokens.tolist() == source.get(item["index"])[0].tolist()

    out = tmp_path / "report"
    assert report.main([str(run_dir), "--out", str(out), "--smooth", "0"]) == 0
    summary = (out / "summary.md").read_text()
    assert "## Spike batches" in summary and "Spike at step 28 (rolled back)" in summary
    first = top[0]
    row = f"| {first['loss']:.4f} | {first['domain']} | {first['stream']} | {first['index']:,} | {first['rank']} |"
    assert row in summary
