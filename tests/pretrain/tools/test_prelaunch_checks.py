"""Every check that can run before launch runs before launch (issue 39, item 3 and papercut 1): `ayumi plan`,
`ayumi train ... --cfg job` and `ayumi train` refuse the same mistakes with the same line and exit status 2,
`ayumi train` before torchrun starts any rank.

Through the real CLI (`python -m pretrain.tools.cli`, what the `ayumi` script runs). "Before any rank starts" is
checked as in test_train_config_errors.py: no launcher command printed, no run dir, and the launching process
never imported torch or DeepSpeed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, tiny_overrides, write_tiny_corpus
from tests.pretrain.tools.test_train_config_errors import imported, messages


def ayumi(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`ayumi ARGS` in the repository, runs under tmp_path; the launching process's imports listed on stderr."""
    env = {**os.environ, "AYUMI_RUN_ROOT": str(tmp_path / "runs"), "AYUMI_DATA_ROOT": str(tmp_path / "data")}
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "pretrain.tools.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def refusals(tmp_path: Path, overrides: list[str]) -> dict[str, subprocess.CompletedProcess]:
    """The same overrides through `ayumi plan`, `ayumi train ... --cfg job` and `ayumi train`."""
    return {"plan": ayumi(tmp_path, "plan", *overrides), "cfg job": ayumi(tmp_path, "train", *overrides, "--cfg", "job"),
            "train": ayumi(tmp_path, "train", *overrides)}


def assert_refused_alike(runs: dict[str, subprocess.CompletedProcess], lines: list[str], tmp_path: Path) -> None:
    """Each command exits 2 with exactly `lines` (its own prefix); train starts no launcher and imports no torch."""
    for name, proc in runs.items():
        prog = "ayumi plan" if name == "plan" else "ayumi train"
        assert proc.returncode == 2, (name, proc.stdout[-2000:], messages(proc.stderr))
        assert messages(proc.stderr) == [f"{prog}: {line}" for line in lines], name
        assert "Traceback" not in proc.stderr
    train = runs["train"]
    assert train.stdout == ""  # no "+ torchrun ..." line: no rank was started
    assert not {"torch", "deepspeed"} & imported(train.stderr)
    assert not (tmp_path / "runs").exists()


def test_a_tokenizer_larger_than_the_model_is_refused_before_launch(tmp_path):
    """Papercut 1: data made by a 2000-piece tokenizer and model.vocab_size=512 set by hand: `plan` said ok and the
    ranks refused after torchrun started (the line at 3 and 43 of 43). Now all three refuse at once, one line,
    suggesting what model.vocab_size=0 would give."""
    root = write_tiny_corpus(tmp_path / "corpus", vocab_size=2000)
    runs = refusals(tmp_path, tiny_overrides(root, tmp_path / "runs", "model.vocab_size=512"))
    assert_refused_alike(runs, [
        f"model.vocab_size=512 is smaller than the vocabulary of the tokenizer that made {root} (2000 ids, "
        f"{root / 'manifest.json'}). Fix: model.vocab_size=0 (follows the tokenizer) or >= 2048"], tmp_path)
    fixed = ayumi(tmp_path, "plan", *tiny_overrides(root, tmp_path / "runs"), "model.vocab_size=2048")
    assert fixed.returncode == 0 and "plan ok" in fixed.stdout, messages(fixed.stderr)


def test_the_plan_prints_the_models_vocabulary_and_the_tokenizers(tmp_path):
    """cpu_tiny follows the tokenizer: 2,000 ids become 2,048 rows, which the plan, `--cfg job` and the plan's
    parameter count all show; a number set by hand is printed beside the tokenizer's."""
    root = write_tiny_corpus(tmp_path / "corpus", vocab_size=2000)
    follows = ayumi(tmp_path, "plan", *tiny_overrides(root, tmp_path / "runs"))
    assert follows.returncode == 0, messages(follows.stderr)
    assert "vocabulary: model 2,048 (tokenizer 2,000 ids, padded to a multiple of 128)" in follows.stdout.splitlines()
    from pretrain.config import config_from_args
    from pretrain.model.flops import count_parameters

    expected = count_parameters(config_from_args(tiny_overrides(root, tmp_path / "runs", "model.vocab_size=2048")).model)
    assert f"model: {expected:,} parameters" in follows.stdout
    printed = ayumi(tmp_path, "train", *tiny_overrides(root, tmp_path / "runs"), "--cfg", "job")
    assert printed.returncode == 0 and yaml.safe_load(printed.stdout)["model"]["vocab_size"] == 2048
    by_hand = ayumi(tmp_path, "plan", *tiny_overrides(root, tmp_path / "runs", "model.vocab_size=4000"))
    assert by_hand.returncode == 0, messages(by_hand.stderr)
    assert "vocabulary: model 4,000, tokenizer 2,000 ids" in by_hand.stdout.splitlines()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    from tests.data.helpers import JA_PARAGRAPHS, english_texts, write_tokenizer

    folder = tmp_path_factory.mktemp("tok") / "tok"
    return write_tokenizer(folder, english_texts()[:100] + JA_PARAGRAPHS)  # 600 pieces


def test_bad_task_files_are_refused_before_launch_one_line_each(tmp_path, tokenizer):
    """Papercut 1: a bad task file in eval.downstream was caught only in the ranks. Now one line per bad file (the
    downstream package's own messages), before launch; the good file says nothing."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    good, empty, no_gold = tasks / "good.jsonl", tasks / "empty_choices.jsonl", tasks / "no_gold.jsonl"
    good.write_text(json.dumps({"context": "It is a truth", "choices": ["universally", "never"], "gold": 0}) + "\n")
    empty.write_text(json.dumps({"context": "It is a truth", "choices": [], "gold": 0}) + "\n")
    no_gold.write_text(json.dumps({"context": "It is a truth", "choices": ["a", "b"]}) + "\n")
    overrides = tiny_overrides(tmp_path / "no_data_yet", tmp_path / "runs", f"data.tokenizer_dir={tokenizer}",
                               "model.vocab_size=640",
                               f"eval.downstream.tasks=[{{path:{good}}},{{path:{empty}}},{{path:{no_gold}}}]")
    runs = refusals(tmp_path, overrides)
    from downstream.config import TaskConfig
    from downstream.tasks import TaskError, load_task

    expected = []
    for path in (empty, no_gold):  # the downstream package's own line for each file
        with pytest.raises(TaskError) as err:
            load_task(TaskConfig(path=str(path)))
        expected.append(str(err.value))
    assert expected[0].startswith(f"{empty}:1: choices: empty or not a list")
    assert_refused_alike(runs, expected, tmp_path)
    lenient = ayumi(tmp_path, "train", *overrides, "eval.downstream.strict=false", "--cfg", "job")
    assert lenient.returncode == 0, messages(lenient.stderr)  # the ranks leave them out and say so


def test_stage_lengths_and_rope_are_refused_by_cfg_job_as_by_plan(tmp_path):
    """Papercut 4: `--cfg job` accepted curriculum.stages.1.seq_len=30000 that only `plan` refused; a stage's RoPE
    type no model knows is refused alike. `--cfg job` still prints the config it refuses (that is what was asked)."""
    overrides = ["experiment=ja_en_4stage", "curriculum.stages.1.seq_len=30000",
                 "+curriculum.stages.2.rope_scaling={type:yarm,factor:4}"]
    runs = refusals(tmp_path, overrides)
    assert_refused_alike(runs, [
        "curriculum.stages.1.seq_len=30000 is not a multiple of train.seq_len=2048: set train.seq_len to the run's "
        "shortest length (every stage's seq_len a multiple of it)",
        "curriculum.stages.1.seq_len=30000 exceeds model.max_seq_len=2048; raise model.max_seq_len "
        "(model.max_seq_len=30000) and give the stage a RoPE for that length (curriculum.stages.1.rope_theta or "
        "rope_scaling)",
        "curriculum.stages.2.rope_scaling.type='yarm': choose one of none, linear, dynamic, yarn, llama3"], tmp_path)
    assert "seq_len: 30000" in runs["cfg job"].stdout
