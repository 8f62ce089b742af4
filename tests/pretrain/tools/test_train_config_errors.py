"""`ayumi train` refuses a bad config in the launching process: one line per problem, exit 2, nothing started.

Through the real entry (`python -m pretrain.tools.cli train ...`, what the `ayumi` script runs). "Before
anything starts" is checked without timing: no launcher command is printed, no run dir appears,
and the launching process never imported torch or DeepSpeed (`-X importtime` lists every import).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO, tiny_overrides, write_tiny_corpus
from common.conf import group_options


def ayumi_train(tmp_path: Path, *args: str, importtime: bool = False) -> subprocess.CompletedProcess:
    flags = ["-X", "importtime"] if importtime else []
    env = {**os.environ, "AYUMI_RUN_ROOT": str(tmp_path / "runs"), "AYUMI_DATA_ROOT": str(tmp_path / "data")}
    return subprocess.run([sys.executable, *flags, "-m", "pretrain.tools.cli", "train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


def imported(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_mistakes_are_refused_before_any_rank_starts(tmp_path):
    proc = ayumi_train(tmp_path, "experiment=cpu_tiny", "model.vocab_size=512", "optim.lr=-0.001", "train.seq_len=-1",
                       "checkpoint.keep_last=-1", "train.eval_interval=-5", "name=", importtime=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert messages(proc.stderr) == [
        "ayumi train: name='' is empty: the run would write straight into run_root; give the run a name, e.g. name=my_run",
        "ayumi train: optim.lr=-0.001 must be > 0",
        "ayumi train: train.seq_len=-1 must be >= 1",
        "ayumi train: train.eval_interval=-5 must be >= 0 (0 = only at the end)",
        "ayumi train: checkpoint.keep_last=-1 must be >= 0 (0 = keep every checkpoint)",
    ]
    assert proc.stdout == ""  # no "+ torchrun ..." line: no launcher was started
    assert not (tmp_path / "runs").exists()
    modules = imported(proc.stderr)
    assert "hydra" in modules and not {"torch", "deepspeed"} & modules
    assert "Traceback" not in proc.stderr


def test_a_typo_is_one_line_with_a_suggestion(tmp_path):
    ayumi = Path(sys.executable).with_name("ayumi")  # the installed script, as users type it
    cmd = [str(ayumi)] if ayumi.exists() else [sys.executable, "-m", "pretrain.tools.cli"]
    proc = subprocess.run([*cmd, "train", "experiment=cpu_tiny", "optim.lrr=1e-3"], cwd=tmp_path,
                          env={**os.environ, "AYUMI_RUN_ROOT": str(tmp_path / "runs")},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["ayumi train: optim.lrr=1e-3: optim has no key 'lrr'; did you mean optim.lr?"]
    assert proc.stdout == "" and not (tmp_path / "runs").exists()


def test_every_typo_of_a_command_line_is_named_at_once(tmp_path):
    """Issue 48, papercut: Hydra stops at the first unknown key, so three typos took three reruns. Now one line per
    typo, in the order typed, each with its "did you mean"; exit 2 and nothing started or written."""
    proc = ayumi_train(tmp_path, "experiment=cpu_tiny", "optim.lrr=1e-3", "train.seq_len=32", "+train.seq_lenn=32",
                       "trian.tokens=100")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert messages(proc.stderr) == [
        "ayumi train: optim.lrr=1e-3: optim has no key 'lrr'; did you mean optim.lr?",
        "ayumi train: +train.seq_lenn=32: train has no key 'seq_lenn'; did you mean train.seq_len?",
        "ayumi train: trian.tokens=100: the config has no key 'trian'; did you mean train?",
    ]
    assert proc.stdout == "" and not (tmp_path / "runs").exists()


def test_a_new_key_in_a_stage_says_it_needs_hydras_plus(tmp_path):
    """Papercut 3 of issue 39: it said `rope_scaling has no key 'type'; known keys: ` (an empty list, no '+')."""
    rope = "curriculum.stages.1.rope_scaling={type:yarn,factor:4}"
    proc = ayumi_train(tmp_path, "experiment=ja_en_4stage", rope)
    assert proc.returncode == 2 and proc.stdout == ""
    assert messages(proc.stderr) == [
        f"ayumi train: {rope}: curriculum.stages.1.rope_scaling has no key 'type': a new key needs Hydra's '+' "
        f"(+{rope})"]


def test_dry_run_prints_the_command_only_for_a_valid_config(tmp_path):
    tiny = ["experiment=cpu_tiny", "model.vocab_size=512"]  # a dry run reads no data: nothing to follow
    bad = ayumi_train(tmp_path, "--dry-run", "--nproc", "2", *tiny, "train.global_batch_size=10")
    assert bad.returncode == 2 and bad.stdout == ""
    assert messages(bad.stderr) == [
        "ayumi train: train.global_batch_size=10 is not a multiple of train.micro_batch_size=4 x 2 data-parallel "
        "ranks = 8; choose a global batch that divides, e.g. 8"]
    good = ayumi_train(tmp_path, "--dry-run", "--nproc", "2", *tiny)
    assert good.returncode == 0 and good.stdout.startswith("+ ") and "pretrain.train experiment=cpu_tiny" in good.stdout
    assert "no experiment=" not in good.stderr  # one was named: nothing to explain


def test_no_experiment_says_which_run_it_is(tmp_path):
    proc = ayumi_train(tmp_path, "--dry-run", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "ayumi train: no experiment= given: running the defaults of conf/config.yaml (model=debug, name=debug); "
        f"pick a run with experiment=NAME ({', '.join(group_options('experiment'))})"]
    assert "pretrain.train" in proc.stdout


def test_the_plan_is_checked_before_any_rank_starts(tmp_path):
    """A run that would read its data 5 times (limit 4), or has no data at all, is refused by the
    launching process: the plan's message once (not once per rank), no launcher, no torch import."""
    corpus = write_tiny_corpus(tmp_path / "corpus")
    over = ayumi_train(tmp_path, *tiny_overrides(corpus, tmp_path / "runs", "curriculum=none", "train.tokens=131072"),
                       importtime=True)
    assert over.returncode == 2, over.stdout + over.stderr
    lines = messages(over.stderr)
    assert lines[0] == "ayumi train: the run plan is impossible:"
    assert sum("[repetition] domain 'ja' would be read 5.11 times" in line for line in lines) == 1
    assert over.stdout == "" and not (tmp_path / "runs").exists()
    assert not {"torch", "deepspeed"} & imported(over.stderr)

    # The plan's own data check (with no number to follow, model.vocab_size=0 names the missing data.root first).
    missing = ayumi_train(tmp_path, *tiny_overrides(tmp_path / "nowhere", tmp_path / "runs", "model.vocab_size=512"))
    assert missing.returncode == 2 and missing.stdout == ""
    assert f"data root {tmp_path / 'nowhere'} does not exist: run `ayumi data prepare` or set data.root" in missing.stderr
    assert "Traceback" not in missing.stderr
    followed = ayumi_train(tmp_path, *tiny_overrides(tmp_path / "nowhere", tmp_path / "runs"))
    assert followed.returncode == 2 and followed.stdout == "" and not (tmp_path / "runs").exists()
    assert messages(followed.stderr)[0].startswith(
        f"ayumi train: model.vocab_size=0 follows the tokenizer, but data.root={tmp_path / 'nowhere'} does not exist")
