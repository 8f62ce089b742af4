"""Override mistakes that used to pass silently or as OmegaConf's words (issue 39, item 2), and `ayumi doctor`
making the pre-launch checks of `ayumi train` (item 3).

- `+train.seq_lenn=64`: Hydra's '+' lifts struct mode, so the key was added and the typed config dropped it
  without a word: the run trained at the old value. Now every command refuses it in one line, with "did you mean".
  '+' still adds keys to the mappings that take any key.
- `curriculum.stages.4.seq_len=64` on four stages said "Invalid type assigned: dict is not a subclass of Stage".
- `ayumi doctor experiment=...` checked the disk and memory of a run but not what `ayumi train` refuses before
  launch (the data's vocabulary, the task files).

Through the real CLI (`python -m pretrain.tools.cli`, what the `ayumi` script runs).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, tiny_overrides, write_tiny_corpus
from tests.pretrain.tools.test_prelaunch_checks import assert_refused_alike, refusals


def ayumi(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "AYUMI_RUN_ROOT": str(tmp_path / "runs"), "AYUMI_DATA_ROOT": str(tmp_path / "data")}
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_key_added_with_plus_to_a_fixed_section_is_refused_with_did_you_mean(tmp_path):
    overrides = tiny_overrides(tmp_path / "corpus", tmp_path / "runs", "model.vocab_size=512", "+train.seq_lenn=32")
    assert_refused_alike(refusals(tmp_path, overrides),
                         ["+train.seq_lenn=32: train has no key 'seq_lenn'; did you mean train.seq_len?"], tmp_path)


def test_a_misspelt_added_key_is_named_as_typed_in_the_tokenizer_builder(tmp_path):
    """The line names the override that is wrong, not the group override before it that shares its section."""
    proc = ayumi(tmp_path, "tokenizer", "build", "tokenizer=tiny", "+tokenizer.total_vocabb=3000")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "ayumi tokenizer build: config error: +tokenizer.total_vocabb=3000: tokenizer has no key 'total_vocabb'; "
        "did you mean tokenizer.total_vocab?")


@pytest.mark.parametrize("command, typos, lines", [
    (["plan", "experiment=cpu_tiny"], ["optim=adamww", "model.hiden_size=64"],
     ["ayumi plan: optim=adamww: no such option in conf/optim/; choose one of adamw, wsd",
      "ayumi plan: model.hiden_size=64: model has no key 'hiden_size'; did you mean model.hidden_size?"]),
    (["eval", "no_run"], ["max_example=5", "batch_sise=2"],
     ["ayumi eval: max_example=5: eval.downstream has no key 'max_example'; did you mean max_examples?",
      "ayumi eval: batch_sise=2: eval.downstream has no key 'batch_sise'; did you mean batch_size?"]),
    (["data", "prepare"], ["data.rot=x", "data.nmae=y"],
     ["ayumi data prepare: error: data.rot=x: data has no key 'rot'; did you mean data.root?",
      "ayumi data prepare: error: data.nmae=y: data has no key 'nmae'; did you mean data.name?"]),
    (["tokenizer", "build", "tokenizer=tiny"], ["+tokenizer.total_vocabb=3000", "tokenizer.domanis=1"],
     ["ayumi tokenizer build: config error: +tokenizer.total_vocabb=3000: tokenizer has no key 'total_vocabb'; "
      "did you mean tokenizer.total_vocab?",
      "ayumi tokenizer build: config error: tokenizer.domanis=1: tokenizer has no key 'domanis'; "
      "did you mean tokenizer.domains?"]),
], ids=["plan", "eval", "data-prepare", "tokenizer-build"])
def test_every_command_names_every_typo_at_once(tmp_path, command, typos, lines):
    """Issue 48, papercut: a line per mistake of the command line, not the first only; exit 2, nothing written."""
    proc = ayumi(tmp_path, *command, *typos)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == lines
    assert proc.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == []


def test_plus_still_adds_keys_to_mappings(tmp_path):
    """What '+' is for: a key new to a mapping (the fault drill's lr_multiply, a stage's weights) still composes."""
    proc = ayumi(tmp_path, "train", "experiment=demo", "model.vocab_size=8000",
                 "+stability.inject.lr_multiply={30:50.0}", "+curriculum.stages.1.weights.code=0.5", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = yaml.safe_load(proc.stdout)
    assert printed["stability"]["inject"]["lr_multiply"] == {600: 50.0, 601: 50.0, 602: 50.0, 30: 50.0}  # demo's + 30
    assert printed["curriculum"]["stages"][1]["weights"] == {"ja_raw": 0.45, "en": 0.45, "math": 0.1, "code": 0.5}


def test_a_stage_index_beyond_the_list_says_how_many_stages_there_are(tmp_path):
    proc = ayumi(tmp_path, "plan", "experiment=demo", "curriculum.stages.4.seq_len=64")
    assert proc.returncode == 2, proc.stdout[-2000:]
    assert proc.stderr.strip().splitlines() == [
        "ayumi plan: curriculum.stages.4.seq_len=64: curriculum.stages has 4 entries (0-3), so there is no entry 4; "
        "an override changes an entry, it cannot add one (give the whole list: curriculum.stages=[...])"]


def test_doctor_makes_the_checks_train_makes_before_launch(tmp_path):
    """Data made by a 2000-piece tokenizer, a model of 512 rows: `ayumi train` refuses before launch, and so does
    the doctor's plan section now (a FAIL row with the same line, exit 1), where it said the run was fine."""
    root = write_tiny_corpus(tmp_path / "corpus", vocab_size=2000)
    overrides = tiny_overrides(root, tmp_path / "runs", "model.vocab_size=512", f"checkpoint.dir={tmp_path / 'ck'}")
    train = ayumi(tmp_path, "train", *overrides)
    assert train.returncode == 2
    refusal = train.stderr.strip().splitlines()[-1].removeprefix("ayumi train: ")
    assert refusal.startswith("model.vocab_size=512 is smaller than the vocabulary of the tokenizer that made")

    doctor = ayumi(tmp_path, "doctor", *overrides)
    assert doctor.returncode == 1, doctor.stdout[-3000:]
    row = next(line for line in doctor.stdout.splitlines() if "run files" in line)
    assert row.split()[:3] == ["FAIL", "run", "files"] and row.split("run files", 1)[1].strip() == refusal

    fixed = ayumi(tmp_path, "doctor", *overrides, "model.vocab_size=2048")
    row = next(line for line in fixed.stdout.splitlines() if "run files" in line)
    assert row.split()[:3] == ["ok", "run", "files"], fixed.stdout[-3000:]
    assert row.split("run files", 1)[1].strip() == "vocabulary: model 2,048 (tokenizer 2,000 ids, padded to a multiple of 128)"
