"""A config file of one's own as a group option, `curriculum=./my_cur.yaml` (issue 48, papercut 1).

Before, a path was read as an option name: "curriculum=./my_cur.yaml: no such option in conf/curriculum/", and the
way out (copy the file into conf/, or Hydra's `hydra.searchpath`) was nowhere said. Now the file is composed as the
group's content, by every command that composes the training config: `ayumi plan`, `ayumi train --cfg job` (what
`ayumi train` checks before launch) and the ranks (composed_from_args).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from common.conf import absolute_file_overrides
from pretrain.config import ConfigError, compose_config, composed_from_args
from tests.helpers import REPO, tiny_overrides, write_tiny_corpus

TINY = REPO / "conf" / "curriculum" / "tiny.yaml"


def own_curriculum(folder: Path, name: str = "my_cur.yaml") -> Path:
    """conf/curriculum/tiny.yaml, renamed, in a folder of the user's: the same content under another path."""
    path = folder / name
    path.write_text(TINY.read_text(encoding="utf-8").replace("name: tiny", "name: mine"), encoding="utf-8")
    return path


def curriculum_of(composed) -> dict:
    return OmegaConf.to_container(composed.curriculum, resolve=True)


def test_a_curriculum_file_composes_as_the_group_option_with_the_same_content(tmp_path, monkeypatch):
    own_curriculum(tmp_path)
    monkeypatch.chdir(tmp_path)
    expected = curriculum_of(compose_config(["experiment=cpu_tiny", "curriculum=tiny"]))
    expected["name"] = "mine"
    for given in ("./my_cur.yaml", "my_cur.yaml", str(tmp_path / "my_cur.yaml")):
        assert curriculum_of(compose_config(["experiment=cpu_tiny", f"curriculum={given}"])) == expected, given
    # the ranks compose through composed_from_args: the same curriculum
    composed, _ = composed_from_args(["experiment=cpu_tiny", "curriculum=./my_cur.yaml", "model.vocab_size=512"])
    assert curriculum_of(composed) == expected


def test_a_missing_file_is_one_line_naming_it_and_the_options(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        compose_config(["experiment=cpu_tiny", "curriculum=./my_cur.yaml"])
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"curriculum=./my_cur.yaml: no such file my_cur.yaml (relative to {tmp_path})")
    assert "none_smoke, tiny" in message


def test_a_typo_inside_the_file_names_the_file_as_typed(tmp_path, monkeypatch):
    (tmp_path / "my_cur.yaml").write_text("name: mine\nstagez: []\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        compose_config(["experiment=cpu_tiny", "curriculum=./my_cur.yaml"])
    assert str(raised.value) == ("curriculum=./my_cur.yaml: curriculum has no key 'stagez'; "
                                 "did you mean curriculum.stages?")


def test_an_option_name_that_is_a_file_here_points_to_the_path(tmp_path, monkeypatch):
    own_curriculum(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as raised:
        compose_config(["experiment=cpu_tiny", "curriculum=my_cur"])
    assert str(raised.value).endswith("; or give your file's path: curriculum=./my_cur.yaml")


def ayumi(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`ayumi ARGS` from the user's folder (the real CLI, as the `ayumi` script runs it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pretrain.tools.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_plan_and_train_cfg_job_read_the_file_from_the_users_folder(tmp_path):
    root = write_tiny_corpus(tmp_path / "corpus")
    own_curriculum(tmp_path)
    overrides = tiny_overrides(root, tmp_path / "runs", "curriculum=./my_cur.yaml")
    plan = ayumi(tmp_path, "plan", *overrides)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "plan ok" in plan.stdout and "ja_heavy" in plan.stdout and "en_heavy" in plan.stdout
    job = ayumi(tmp_path, "train", *overrides, "--cfg", "job")
    assert job.returncode == 0, job.stderr[-2000:]
    curriculum = yaml.safe_load(job.stdout)["curriculum"]
    assert curriculum["name"] == "mine" and [s["name"] for s in curriculum["stages"]] == ["ja_heavy", "en_heavy"]


def test_the_recorded_form_of_a_file_override_composes_from_another_folder(tmp_path, monkeypatch):
    """A run's record replays its overrides on resume: recorded absolute, the file is found from any folder."""
    (tmp_path / "elsewhere").mkdir()
    own_curriculum(tmp_path)
    monkeypatch.chdir(tmp_path)
    typed = ["experiment=cpu_tiny", "curriculum=./my_cur.yaml", "optim.lr=0.001"]
    recorded = absolute_file_overrides(typed)
    assert recorded == ["experiment=cpu_tiny", f"curriculum={tmp_path / 'my_cur.yaml'}", "optim.lr=0.001"]
    expected = curriculum_of(compose_config(typed))
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert curriculum_of(compose_config(recorded)) == expected
