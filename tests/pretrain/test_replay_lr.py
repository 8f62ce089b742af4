"""`ayumi replay` on a spike whose answer is known: an LR x50 for three steps (stability.inject) is the state's doing,
so the replay must call it state-driven: the same batches at the schedule's LR do not spike an earlier checkpoint,
while the pre-spike checkpoint at the spike's LR spikes on other batches too. Arm (a) must retrain the spike exactly.
The window holds a stage switch: arm (a) must retrain it, and arm (c) reads other batches of the stage the spike
was in. Also: `ayumi batch --spike`, the one-line refusals (a ring that lost the checkpoints, a spike the run does not have)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, cpu_env, read_jsonl, run_training, tiny_overrides

pytestmark = pytest.mark.slow

RUN = [
    "train.tokens=20480", "train.max_steps=30", "checkpoint.interval=0", "train.eval_interval=0",
    # fp32 everywhere: precision auto picks bf16 on CPUs with native bf16 and fp32 on others, and the steps below differ.
    "deepspeed.precision=fp32",
    # A stage switch inside the spike's window (steps 21-29): stage 2 begins with step 23 (sample 176), another mix.
    "curriculum=tiny", "curriculum.stages=[{name:ja_heavy,tokens:11264,weights:{ja:0.7,en:0.3}},"
    "{name:en_heavy,tokens:9216,weights:{ja:0.3,en:0.7}}]",
    # The detector judges from step 9; a ring checkpoint every 4 steps, all kept: the LR x50 at steps 25-27 is a
    # spike at step 29, rolled back to step 20 (2 batches skipped); the earlier checkpoint arm (b) needs is step 16.
    "stability.detector.warmup_steps=8", "stability.detector.min_history=6", "stability.recovery.ring_interval=4",
    "stability.recovery.rollback_steps=4", "stability.recovery.skip_batches=2", "stability.recovery.ring_keep=10",
    "stability.recovery.lr_cooldown_steps=4", "+stability.inject.lr_multiply={24:50.0,25:50.0,26:50.0}",
]


@pytest.fixture(scope="module")
def run_dir(corpus, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("replay_lr")
    proc = run_training(tiny_overrides(corpus, runs, *RUN), nproc=1, launcher="fork")
    assert proc.returncode == 0, proc.stdout[-6000:]
    return runs / "cpu_tiny"


def ayumi(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def replayed(run_dir) -> dict:
    proc = ayumi("replay", str(run_dir), "--spike", "1", "--nproc", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"out": proc.stdout, "record": json.loads((run_dir / "stability" / "replay_spike_1.json").read_text())}


def first_timeline_losses(run_dir: Path, steps: range) -> list[float]:
    """The losses metrics.jsonl recorded for `steps` the first time they were trained (before the rollback)."""
    seen: dict[int, float] = {}
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        if "train/loss" in record and record["step"] in steps:
            seen.setdefault(record["step"], record["train/loss"])
    return [seen[step] for step in steps]


def test_an_injected_lr_spike_is_state_driven(run_dir, replayed):
    record = replayed["record"]
    assert (record["step"], record["window"], record["verdict"]) == (29, 9, "state-driven")
    a, b, c = record["arms"]
    assert (a["checkpoint_step"], b["checkpoint_step"], c["checkpoint_step"]) == (20, 16, 20)
    assert a["feed_sample"] == b["feed_sample"] == 160 and c["feed_sample"] == 232  # the batches after the window
    # The window crosses the stage switch (stage 2 began with step 23 the first time); arm (c) reads stage 2.
    switches = [e["step"] for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "stage_switch"]
    assert switches[:2] == [1, 23]
    assert (a["recurred"], b["recurred"], c["recurred"]) == (True, False, True)
    assert a["spike_steps"] == [29]
    # "The same LR": arm (a) and (c) train at the LRs the steps had (x50 at 25-27), arm (b) at the schedule's.
    assert a["lr"]["24"] == pytest.approx(50 * b["lr"]["20"]) and a["lr"]["20"] == pytest.approx(b["lr"]["16"])
    # Arm (a) is the spike retrained: the same checkpoint, batches and LRs give the losses the run logged.
    assert [loss for _, loss in a["losses"]] == pytest.approx(first_timeline_losses(run_dir, range(21, 30)), abs=1e-4)
    assert "verdict: state-driven" in replayed["out"] and "3 arms of 9 step(s)" in replayed["out"]
    # The run itself is untouched: its checkpoints are as they were, the scratch runs gone.
    assert sorted(p.name for p in (run_dir / "stability").iterdir()) == ["replay_spike_1.json"]


def test_the_report_shows_the_verdict(run_dir, replayed, tmp_path):
    from pretrain.tools.report import build as report

    assert report.main([str(run_dir), "--out", str(tmp_path / "report"), "--smooth", "0"]) == 0
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "Spike 1 at step 29: **state-driven**" in summary
    assert "| (b) | 16 | 160 | no |" in summary


def test_a_dry_run_states_the_cost_and_runs_nothing(run_dir, replayed):
    before = sorted(p.name for p in (run_dir / "stability").iterdir())
    proc = ayumi("replay", str(run_dir), "--spike", "1", "--nproc", "1", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("replay of spike 1 (step 29): 3 arms of 9 step(s) each on 1 process(es), about ")
    assert [line.split(")")[0].strip() for line in lines[1:]] == ["(a", "(b", "(c"]
    assert sorted(p.name for p in (run_dir / "stability").iterdir()) == before


def test_refusals_are_one_line(run_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=lambda folder, names: [n for n in names if n in ("step_0000016",
                                                                                            "step_0000012",
                                                                                            "step_0000008")])
    for args, says in (([str(copy), "--spike", "1"], "a checkpoint older than step 20 from step 8 on"),
                       ([str(run_dir), "--spike", "2"], "the run records 1 spike(s): 1 (step 29)"),
                       ([str(tmp_path / "none"), "--spike", "1"], "does not exist")):
        proc = ayumi("replay", *args, "--nproc", "1")
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
        assert len(proc.stderr.splitlines()) == 1 and says in proc.stderr, proc.stderr


def test_ayumi_batch_shows_the_spike_s_own_batch_with_its_losses(run_dir):
    spike = next(e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "spike")
    called = json.loads(ayumi("batch", str(run_dir), "--spike", "1", "--json").stdout)
    assert (called["spike"], called["step"], called["first_sample"]) == (1, 29, spike["batch_first_sample"])
    recorded = {index: (domain, loss) for index, domain, loss in spike["batch_samples"]}
    assert {s["index"]: (s["domain"], s["loss"]) for s in called["samples"]} == recorded  # all 8, as trained then
    # --step 29 is the batch the step holds now: after the rollback skipped 2 batches, other samples.
    now = json.loads(ayumi("batch", str(run_dir), "--step", "29", "--json").stdout)
    assert now["first_sample"] == spike["batch_first_sample"] + 2 * 8 and "loss" not in now["samples"][0]
    table = ayumi("batch", str(run_dir), "--spike", "1").stdout.splitlines()
    assert table[0].startswith("spike 1 called on step 29: global samples [224, 232)") and "loss" in table[-9]
