"""The trainer runs `ayumi plan`'s checks before step 1: a run without a curriculum that would read its
data more than curriculum.default_max_repetition times is refused with the plan's message and exit
status 2 (a configuration error, no traceback), and starts once the limit is raised on purpose.

Both runs are the real entry, `python -m pretrain.train` on 1 rank, on the tiny test corpus.
"""
from __future__ import annotations

from tests.helpers import read_jsonl, run_training, tiny_overrides

# cpu_tiny's run (256 steps of 8 samples) reads the tiny corpus (ja 167 + en 234 samples) 5.11 times.
OVER_4 = ["curriculum=none", "train.tokens=131072"]


def test_trainer_refuses_an_over_repeated_run_without_a_curriculum_before_step_1(corpus, tmp_path):
    proc = run_training(tiny_overrides(corpus, tmp_path, *OVER_4), nproc=1, launcher="python", timeout=120)
    assert proc.returncode == 2, proc.stdout[-4000:]
    assert ("pretrain.train: the run plan is impossible:\n"
            "pretrain.train:   [repetition] domain 'en' would be read 5.11 times") in proc.stdout
    assert ("[repetition] domain 'ja' would be read 5.11 times by the end of the run, more than its limit of 4 "
            "(curriculum.default_max_repetition): 853 samples wanted, 167 available. Fix one: prepare more ja data "
            "(`ayumi data prepare`); train fewer tokens (train.tokens=102400 fits: 200 steps); "
            "or raise the limit on purpose (curriculum.default_max_repetition=6)") in proc.stdout
    assert "Traceback" not in proc.stdout
    assert "step   1/" not in proc.stdout and not (tmp_path / "cpu_tiny").exists()  # nothing trained, nothing written


def test_trainer_starts_once_the_limit_is_raised_on_purpose(corpus, tmp_path):
    overrides = tiny_overrides(corpus, tmp_path, *OVER_4, "curriculum.default_max_repetition=6", "train.max_steps=2",
                               "checkpoint.save_final=false", "train.eval_interval=0")
    proc = run_training(overrides, nproc=1, launcher="python", timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    steps = [r["step"] for r in read_jsonl(tmp_path / "cpu_tiny" / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2]
