"""A planted poisoned source, end to end: a shard of garbage documents (ids the text never uses) in domain `en`,
reached at steps 34, 46 and 56 of a run whose detector calls each a spike (stability.action=skip). The replay must
call spike 1 data-driven (the batch spikes an earlier checkpoint too; other batches do not spike this one), the
report's attribution must name that shard, and data.exclude must remove it: resumed from step 40 with the shard's
documents excluded, the run never again trains on a token of them (the token ids the model was handed, recorded by
tests/pretrain/batch_train.py, and `ayumi batch`), a later resume that drops data.exclude still honours it, and
`ayumi plan` counts what it removes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.spike_replay import GARBAGE, write_poisoned_corpus
from pretrain.step_samples import batch_samples, open_source, step_batch, step_config, step_start
from tests.helpers import REPO, cpu_env, read_jsonl, run_training, tiny_overrides

pytestmark = pytest.mark.slow

ENTRY = str(REPO / "tests" / "pretrain" / "batch_train.py")
RUN = [
    "train.seed=1", "train.micro_batch_size=2", "train.global_batch_size=4", "train.tokens=32768",
    "checkpoint.interval=4", "checkpoint.keep_last=40", "train.eval_interval=0", "stability.action=skip",
    # A one-step jump of 15% is a spike at once: each poisoned batch is called where it lands (seed 1: steps 34,
    # 46 and 56), its update skipped.
    "stability.detector.warmup_steps=8", "stability.detector.min_history=6", "stability.detector.large_loss_rise=0.15",
]


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("poison")
    corpus = write_poisoned_corpus(root / "corpus")
    proc = run_training(tiny_overrides(corpus, root, *RUN, "train.max_steps=60"), nproc=1, launcher="fork",
                        entry=ENTRY)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return {"corpus": corpus, "root": root, "run": root / "cpu_tiny"}


def ayumi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)


def seen_ids(run_dir: Path, step: int) -> set[int]:
    rows = json.loads((run_dir / "seen_tokens_rank0.json").read_text()).get(str(step), [])
    return {token for micro in rows for row in micro for token in row}


def garbage(ids: set[int]) -> bool:
    return any(GARBAGE[0] <= i < GARBAGE[1] for i in ids)


def poisoned_steps(run_dir: Path, steps: range, excluded: bool) -> list[int]:
    """The steps of `steps` whose batch holds a document of en/part_00001, from the stream as the run trained it
    (`excluded`) or as it would have been without data.exclude."""
    out = []
    source = open_source(step_config(run_dir, steps[-1]), run_dir if excluded else None)  # one data config throughout
    for step in steps:
        layout, position = step_start(run_dir, step)
        if any(p.shard == "part_00001" for s in batch_samples(source, position, layout) for p in s.pieces):
            out.append(step)
    return out


def test_the_poison_spikes_where_it_lands(poisoned):
    run = poisoned["run"]
    spikes = [e["step"] for e in read_jsonl(run / "events.jsonl") if e["event"] == "spike"]
    assert spikes == [34, 46, 56]
    # Step 50's batch ends on the first garbage token (a sample's last label): one token, no spike.
    assert poisoned_steps(run, range(1, 61), excluded=False) == [34, 46, 50, 56]
    assert [s for s in range(1, 61) if garbage(seen_ids(run, s))] == [34, 46, 50, 56]
    assert sum(GARBAGE[0] <= i < GARBAGE[1] for micro in json.loads((run / "seen_tokens_rank0.json").read_text())["50"]
               for row in micro for i in row) == 1


def test_a_poisoned_source_is_data_driven(poisoned):
    run = poisoned["run"]
    proc = ayumi("replay", str(run), "--spike", "1", "--nproc", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((run / "stability" / "replay_spike_1.json").read_text())
    assert record["verdict"] == "data-driven" and "verdict: data-driven" in proc.stdout
    a, b, c = record["arms"]
    assert (a["checkpoint_step"], b["checkpoint_step"], c["checkpoint_step"]) == (32, 28, 32)
    assert a["spike_steps"] == [34] and b["outlier_steps"] == [30] and not c["recurred"]
    assert a["feed_sample"] == b["feed_sample"] == 128 and c["feed_sample"] == 136
    # The suspects: the documents of the sample far above its batch's median loss, as a data.exclude file.
    suggested = run / "stability" / "replay_spike_1.exclude.txt"
    assert f"data.exclude={suggested}" in proc.stdout
    assert suggested.read_text().splitlines()[1:] == ["en part_00001 0", "en part_00001 1"]


def test_attribution_names_the_poisoned_shard(poisoned, tmp_path):
    from pretrain.tools.report import build as report

    assert report.main([str(poisoned["run"]), "--out", str(tmp_path / "report"), "--smooth", "0"]) == 0
    summary = (tmp_path / "report" / "summary.md").read_text()
    attribution = summary.split("## Spike attribution", 1)[1].split("## Files", 1)[0]
    flagged = [line.split("|")[1].strip() for line in attribution.splitlines() if "more than chance" in line]
    assert flagged == ["en/part_00001"]
    assert "| en/part_00001 | 3 of 12 | 25.0% |" in attribution
    assert "Spike 1 at step 34: **data-driven**" in summary


def test_the_plan_counts_what_data_exclude_removes(poisoned, tmp_path):
    listed = tmp_path / "exclude.txt"
    listed.write_text("# the planted garbage\n" + "".join(f"en part_00001 {i}\n" for i in range(4)))
    proc = ayumi("plan", *tiny_overrides(poisoned["corpus"], tmp_path, *RUN), f"data.exclude={listed}")
    assert proc.returncode == 0, proc.stderr
    assert f"data.exclude: 4 document(s) (256 tokens) from {listed}" in proc.stdout
    assert "4 of 238 samples of stream en" in proc.stdout
    listed.write_text("en part_00001 4\n")
    proc = ayumi("plan", *tiny_overrides(poisoned["corpus"], tmp_path, *RUN), f"data.exclude={listed}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().endswith("shard en/part_00001 holds documents 0-3, not 4; fix the line")


def test_data_exclude_removes_it_across_resumes(poisoned, tmp_path):
    """Resumed at step 40 (the checkpoints after it removed by hand) with the shard excluded, to step 50; then
    resumed with data.exclude=null to 64: steps 46, 50 and 56 would have held the poison and hold none."""
    run, corpus, root = poisoned["run"], poisoned["corpus"], poisoned["root"]
    for folder in (run / "checkpoints").glob("step_*"):
        if int(folder.name.removeprefix("step_")) > 40:
            shutil.rmtree(folder)
    listed = tmp_path / "exclude.txt"
    listed.write_text("".join(f"en part_00001 {i}\n" for i in range(4)))
    for extra in ([f"data.exclude={listed}", "train.max_steps=50"], ["data.exclude=null", "train.max_steps=64"]):
        proc = run_training(tiny_overrides(corpus, root, *RUN, *extra), nproc=1, launcher="fork", entry=ENTRY)
        assert proc.returncode == 0, proc.stdout[-6000:]
    events = read_jsonl(run / "events.jsonl")
    [excluded] = [e for e in events if e["event"] == "data_excluded"]
    assert (excluded["step"], excluded["from_sample"], len(excluded["documents"])) == (40, 160, 4)
    after = events[events.index(excluded):]
    assert not [e for e in after if e["event"] in ("spike", "skip_update")]
    assert poisoned_steps(run, range(41, 65), excluded=False) == [46, 50, 56]
    assert poisoned_steps(run, range(41, 65), excluded=True) == []
    assert not any(garbage(seen_ids(run, step)) for step in range(41, 65))
    assert all(seen_ids(run, step) for step in range(41, 65))
    # The past stays as it was: step 34 still shows the poison it trained on.
    assert any(p.shard == "part_00001" for s in step_batch(run, 34).samples for p in s.pieces)
    proc = ayumi("batch", str(run), "--step", "46")
    assert proc.returncode == 0 and "part_00001" not in proc.stdout and "part_00000" in proc.stdout
