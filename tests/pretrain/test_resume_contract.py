"""A resume is a contract (issue 48), through `ayumi train` on the tiny corpus: an extension of the run is refused
unless acknowledged and never jumps the LR; a resume that leaves out the run's curriculum keeps it; a refused
resume, or one with nothing to do, is answered before any rank starts and leaves every file as it was.

The run each test resumes is trained first on ranks forked from the rank server (tests/rank_server.py), as
`ayumi train` would start them on this machine (2 ranks, the same overrides): only its resumes are under test."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pretrain.config import OptimConfig
from pretrain.plan.lr_schedule import lr_at
from pretrain.startup.record import HISTORY, config_for_step
from tests.helpers import REPO, cpu_env, read_jsonl, run_training, tiny_overrides

pytestmark = pytest.mark.slow

LAUNCHED = "+ "
"""`ayumi train` prints the launcher's command line (`+ torchrun ...`) just before it starts the ranks."""


def ayumi(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=REPO, env=cpu_env(),
                          capture_output=True, text=True, timeout=300)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def first_run(*overrides: str) -> None:
    """The run a test resumes, trained to its first end on 2 forked ranks."""
    proc = run_training(list(overrides), launcher="fork")
    assert proc.returncode == 0, proc.stdout[-4000:]


def said(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("ayumi train: ")]


def files_of(*folders: Path) -> dict[str, str]:
    """Every file under `folders`, by path, with its content's sha256 (what "left as it was" means)."""
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest()
            for folder in folders for path in sorted(folder.rglob("*")) if path.is_file()}


def lr_by_step(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["opt/lr"] for r in read_jsonl(run_dir / "metrics.jsonl") if "opt/lr" in r}


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_an_extension_needs_an_acknowledgement_and_never_jumps_the_lr(corpus, tmp_path, schedule):
    """32 steps planned, 20 trained, then train.tokens doubled. Refused without resume.accept, before launch and
    with nothing written; accepted, the LR goes on from where it was: cosine keeps its trained past and stretches
    the rest (the step after the resume changes the LR by no more than the steps before it did); WSD, still in its
    stable phase, stays at the peak. Before, the schedule was rebuilt for the new length: the LR jumped."""
    run_dir = tmp_path / "runs" / "cpu_tiny"
    base = tiny_overrides(corpus, tmp_path / "runs", "checkpoint.interval=0", f"optim.schedule={schedule}",
                          "optim.wsd_decay_fraction=0.25")
    first_run(*base, "train.tokens=16384", "train.max_steps=20")
    first_version = (run_dir / HISTORY).read_bytes()
    before = files_of(run_dir, corpus)

    refused = ayumi("train", *base, "train.tokens=32768")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert said(refused) == [
        f"ayumi train: resume of {run_dir} at step 20: train.tokens: 16384 -> 32768 changes the LR or the data stream from step 21 "
        "on. Fix: add resume.accept=[train.tokens] to accept it, or restore the run's value"]
    assert LAUNCHED not in refused.stdout and files_of(run_dir, corpus) == before

    extended = ok(ayumi("train", *base, "train.tokens=32768", "resume.accept=[train.tokens]"))
    assert "accepted (resume.accept), changes the run from this step on: train.tokens: 16384 -> 32768" in extended.stdout
    lr = lr_by_step(run_dir)
    assert sorted(lr) == list(range(1, 65))
    if schedule == "cosine":
        # The step after the resume has the LR the 32-step schedule gave it (a pure function, as the ranks use it):
        # the change from step 20 is that schedule's own change there, and later steps decay more slowly.
        planned = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=10, schedule="cosine")
        assert lr[21] == pytest.approx(lr_at(20, planned, 32), rel=1e-6)
        assert abs(lr[21] - lr[20]) <= abs(lr_at(20, planned, 32) - lr_at(19, planned, 32)) * (1 + 1e-6)
        assert abs(lr[22] - lr[21]) < abs(lr_at(21, planned, 32) - lr_at(20, planned, 32))
        steps = [lr[s] for s in range(11, 65)]
        assert all(a >= b for a, b in zip(steps, steps[1:]))  # decaying all the way, no climb back
        assert lr[64] == pytest.approx(3e-4)  # and ending at min_lr
    else:
        # 64 steps, a quarter of them decaying: the stable phase now lasts to step 48 (it ended at step 24).
        assert [lr[s] for s in range(11, 49)] == pytest.approx([3e-3] * 38) and lr[49] < 3e-3
        assert lr[64] == pytest.approx(3e-4)
    changes = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "config_change"]
    assert [(e["step"], e["changes"]) for e in changes] == [
        (20, [{"key": "train.tokens", "was": 16384, "now": 32768, "kind": "ack"}])]
    # The record is append-only and says which config trained which step.
    assert (run_dir / HISTORY).read_bytes().startswith(first_version)
    assert config_for_step(run_dir, 20).config["train"]["tokens"] == 16384
    assert config_for_step(run_dir, 21).config["train"]["tokens"] == 32768
    ok(ayumi("report", str(run_dir)))
    summary = (run_dir / "report" / "summary.md").read_text()
    assert "## Config history" in summary and "| 21– |" in summary and "train.tokens: 16384 → 32768" in summary


def test_a_resume_that_leaves_out_the_curriculum_keeps_the_run_s_own(corpus, tmp_path):
    """Started with curriculum=tiny, resumed without it: the run's own curriculum goes on (said in one line), its
    stage 2 begins where it should, and the record still holds both stages. Before, the run went on under the
    default (no stages) without a word and config.yaml said `stages: []`."""
    run_dir = tmp_path / "runs" / "cpu_tiny"
    base = tiny_overrides(corpus, tmp_path / "runs", "checkpoint.interval=0")
    first_run(*base, "curriculum=tiny", "train.max_steps=40")

    shown = ok(ayumi("train", *base, "--cfg", "job"))
    assert "name: en_heavy" in shown.stdout  # --cfg job prints what the resume would train with
    resumed = ok(ayumi("train", *base))
    assert (f"ayumi train: resume of {run_dir} at step 40: the run's own curriculum=tiny (left out of this "
            "command line)") in resumed.stdout
    switches = [(e["step"], e["stage"]) for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "stage_switch"]
    assert switches == [(1, 1), (47, 2)]  # conf/curriculum/tiny.yaml: stage 2 begins inside step 47
    assert [s["name"] for s in yaml.safe_load((run_dir / "config.yaml").read_text())["curriculum"]["stages"]] == \
        ["ja_heavy", "en_heavy"]
    assert max(lr_by_step(run_dir)) == 128


def test_a_refused_resume_changes_nothing_and_is_answered_before_launch(corpus, tmp_path):
    """Edits of the past (a begun stage, the model's shape, the LR of trained steps) are refused by `ayumi train` and
    `ayumi plan` alike, one line each, before any rank starts, every file of the run and the data as it was; so is a
    resume with nothing to do (exit 0). Before, each was a rank's refusal after ~20 s, and config.yaml had been
    rewritten with the refused config (the begun stage's new weights: checked on the code before this change)."""
    run_dir = tmp_path / "runs" / "cpu_tiny"
    base = tiny_overrides(corpus, tmp_path / "runs", "curriculum=tiny", "checkpoint.interval=0")
    first_run(*base, "train.max_steps=40")
    before = files_of(run_dir, corpus)
    edits = {  # the override: (the key the refusal names, its values and why)
        "curriculum.stages.0.weights.ja=0.5": ("curriculum.stages.0 ('ja_heavy')", "was {\"weights\": {\"ja\": 0.8, "
                                               "\"en\": 0.2}}, now {\"weights\": {\"ja\": 0.5, \"en\": 0.2}}: a "
                                               "stage the run has begun"),
        "model.hidden_size=128": ("model.hidden_size", "was 64, now 128: the trained steps would no longer be what "
                                  "the config says"),
        "optim.lr=0.001": ("optim.lr", "was 0.003, now 0.001: the LR of trained step 1 would change from 0.0003 to "
                           "0.0001"),
    }
    for edit, (key, why) in edits.items():
        for command in ("train", "plan"):
            proc = ayumi(command, *base, edit)
            assert proc.returncode == 2, (edit, proc.stdout + proc.stderr)
            lines = [line for line in proc.stderr.splitlines() if line.startswith(f"ayumi {command}: ")]
            assert lines == [f"ayumi {command}: resume of {run_dir} at step 40: {key} {why}. Fix: restore {key} as "
                             f"the run has it, or start a new run from this checkpoint (another name= with "
                             f"checkpoint.load_from={run_dir / 'checkpoints'})"], (edit, proc.stderr)
            assert LAUNCHED not in proc.stdout and files_of(run_dir, corpus) == before, edit

    ok(ayumi("train", *base))  # to the end: 128 steps
    finished = files_of(run_dir, corpus)
    again = ok(ayumi("train", *base))
    assert "ayumi train: run cpu_tiny is already complete (128 of 128 steps); nothing to do" in again.stdout
    assert LAUNCHED not in again.stdout and files_of(run_dir, corpus) == finished
