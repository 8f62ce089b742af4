"""Issue 49, findings 5-7: what a run folder holds is data, its recorded paths stay inside it, and no child ayumi
starts imports from the user's working folder. Built as an attacker with write access to a run folder would:
ayumi.json, config.yaml and config_history.jsonl edited (ayumi.json's checksum record covers the checkpoint's other
files, which stay as they were), an index file naming files elsewhere. Every command runs through the real CLI, in
its own process.

- A `${oc.env:...}` planted in config.yaml, in the config a checkpoint records, or in a recorded override is refused
  (exit 2, one line naming the file and the key) and its value appears nowhere: not in the output, not in the run.
- A tokenizer_dir recorded outside the run (or through a link leading out) is neither copied by `ayumi export hf`
  nor read by `ayumi eval`: one line naming ayumi.json and the flag to pass.
- A Hugging Face index naming a safetensors outside its folder (absolute, `..`, a link) is refused.
- A `common/` package in the folder ayumi runs from is never imported: training (ranks started with an empty
  PYTHONSAFEPATH in the user's environment), the universal conversion of a resume on another number of ranks (its
  rank started without the launcher), and export.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pretrain.checkpoint.layout import META, latest_tag
from tests.helpers import REPO, cpu_env, tiny_overrides

pytestmark = pytest.mark.slow

SECRET = "planted-secret-4d1f9"
SECRET_ENV = "AYUMI_PLANTED_SECRET"
PLANTED = "${oc.env:" + SECRET_ENV + "}"
BASE = ["deepspeed=zero1", "deepspeed.precision=fp32", "train.eval_interval=0", "train.max_steps=4",
        "checkpoint.interval=2", "checkpoint.keep_last=2"]


def ayumi(*args: object, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    """`ayumi ARGS` in its own process. `-P` keeps the working folder off this process's own import path: what is
    tested is the children it starts."""
    return subprocess.run([sys.executable, "-P", "-m", "pretrain.tools.cli", *map(str, args)], cwd=cwd,
                          env=env or cpu_env(**{SECRET_ENV: SECRET}), capture_output=True, text=True, timeout=600)


def one_line(stderr: str, prefix: str) -> str:
    [line] = [line for line in stderr.splitlines() if line.startswith(prefix)]
    return line


@pytest.fixture(scope="module")
def hostile(corpus, tmp_path_factory) -> dict:
    """A 2-rank ZeRO-1 run trained, resumed on 1 rank (the universal conversion) and exported, each from a working
    folder holding a `common/` package whose import leaves a marker file."""
    base = tmp_path_factory.mktemp("hostile")
    work, marker = base / "work", base / "imported-from-the-working-folder"
    (work / "common").mkdir(parents=True)
    (work / "common" / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('imported\\n')\n")
    root = base / "runs"
    overrides = tiny_overrides(corpus, root, *BASE)
    trained = ayumi("train", *overrides, cwd=work, env=cpu_env(PYTHONSAFEPATH=""))  # "" means off to Python
    assert trained.returncode == 0, trained.stdout[-4000:] + trained.stderr[-4000:]
    # One rank started by hand, without the launcher's environment: the converter child must keep itself safe.
    env = cpu_env()
    env.pop("PYTHONSAFEPATH", None)
    resumed = subprocess.run([sys.executable, "-P", "-m", "pretrain.train", *overrides, "train.max_steps=6"],
                             cwd=work, env=env, capture_output=True, text=True, timeout=600)
    exported = ayumi("export", "hf", root / "cpu_tiny", base / "hf", cwd=work, env=env)
    return {"base": base, "root": root, "overrides": overrides, "marker": marker, "trained": trained,
            "resumed": resumed, "exported": exported, "hf": base / "hf"}


def test_no_child_imports_a_package_from_the_working_folder(hostile):
    """Finding 7: train (ranks), the universal conversion (a child of the rank) and export, run from a folder with a
    `common/` package: none imports it."""
    resumed = hostile["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert "re-sharded from 2 ranks" in resumed.stdout + resumed.stderr
    assert hostile["exported"].returncode == 0, hostile["exported"].stderr[-3000:]
    assert not hostile["marker"].exists(), hostile["marker"].read_text()


@pytest.fixture
def run_copy(hostile, tmp_path) -> Path:
    """A copy of the module's run (its run dir) that a test may plant into."""
    return Path(shutil.copytree(hostile["root"], tmp_path / "runs")) / "cpu_tiny"


def edit_meta(run_dir: Path, change) -> Path:
    """Apply `change` to the newest checkpoint's ayumi.json, as a writer of the folder can; its path."""
    tag_dir = run_dir / "checkpoints" / latest_tag(run_dir / "checkpoints")
    meta = json.loads((tag_dir / META).read_text())
    change(meta)
    (tag_dir / META).write_text(json.dumps(meta))
    return tag_dir / META


def overrides_for(hostile: dict, run_copy: Path) -> list[str]:
    """The module run's overrides, pointed at the copy."""
    return [f"run_root={run_copy.parent}" if o.startswith("run_root=") else o for o in hostile["overrides"]]


def assert_refused_without_secret(proc: subprocess.CompletedProcess, prefix: str, *named: str) -> None:
    """Exit 2, one line starting with `prefix` naming each of `named`, and the secret nowhere in the output."""
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = one_line(proc.stderr, prefix)
    for text in named:
        assert text in line, line
    assert SECRET not in proc.stdout + proc.stderr


@pytest.mark.parametrize("how", ["--cfg", "score"])
def test_eval_refuses_an_interpolation_planted_in_the_runs_config(run_copy, how):
    """Finding 5: `${oc.env:...}` in config.yaml's eval.downstream is refused, never resolved into the output."""
    config = run_copy / "config.yaml"
    loaded = yaml.safe_load(config.read_text())
    loaded.setdefault("eval", {}).setdefault("downstream", {})["prefix"] = PLANTED
    config.write_text(yaml.safe_dump(loaded))
    extra = ["--cfg", "job"] if how == "--cfg" else [f"tasks={run_copy / 'tasks.jsonl'}"]
    proc = ayumi("eval", run_copy, *extra)
    assert_refused_without_secret(proc, "ayumi eval: ", str(config), "eval.downstream.prefix", "interpolation")
    assert not (run_copy / "eval").exists()


def test_a_resume_refuses_an_interpolation_planted_in_the_checkpoints_recorded_config(hostile, run_copy):
    """Finding 5: the config ayumi.json records, compared on resume, is not resolved."""
    def plant(meta):
        meta["config"]["eval"]["downstream"]["prefix"] = PLANTED
    edit_meta(run_copy, plant)
    proc = ayumi("train", *overrides_for(hostile, run_copy), "train.max_steps=8", "--dry-run")
    assert_refused_without_secret(proc, "ayumi train: ", "ayumi.json", "eval.downstream.prefix", "interpolation")


def test_a_resume_refuses_an_interpolation_planted_in_a_recorded_override(hostile, run_copy):
    """Finding 5: a resume replays the run's recorded overrides; a planted `${oc.env:...}` among them is refused,
    not composed (`--cfg job` would print it resolved)."""
    history = run_copy / "config_history.jsonl"
    lines = history.read_text().splitlines()
    last = json.loads(lines[-1])
    last["overrides"].append(f"eval.downstream.prefix={PLANTED}")
    history.write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")
    proc = ayumi("train", *overrides_for(hostile, run_copy), "train.max_steps=8", "--cfg", "job")
    assert_refused_without_secret(proc, "ayumi train: ", str(history), "eval.downstream.prefix", "interpolation")


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder outside the run holding a private file under a tokenizer's name."""
    folder = tmp_path / "private"
    folder.mkdir()
    (folder / "tokenizer.json").write_text('{"private": "not for the export"}')
    return folder


@pytest.mark.parametrize("via", ["path", "link"])
def test_export_and_eval_read_no_tokenizer_recorded_outside_the_run(run_copy, outside, tmp_path, via):
    """Finding 6: ayumi.json's tokenizer_dir naming a folder outside the run (or a link inside it leading out) is
    neither copied into the export nor read by eval; the line names ayumi.json and --tokenizer-dir."""
    recorded = outside
    if via == "link":
        recorded = run_copy / "tok"
        recorded.symlink_to(outside, target_is_directory=True)
    meta = edit_meta(run_copy, lambda m: m.update(tokenizer_dir=str(recorded)))
    out = tmp_path / "hf"
    exported = ayumi("export", "hf", run_copy, out)
    assert exported.returncode == 2, exported.stdout[-2000:] + exported.stderr[-2000:]
    line = one_line(exported.stderr, "ayumi export hf: ")
    assert str(meta) in line and "outside the run" in line and f"--tokenizer-dir {recorded}" in line, line
    assert not out.exists()
    evaluated = ayumi("eval", run_copy, f"tasks={tmp_path / 'tasks.jsonl'}")
    assert evaluated.returncode == 2, evaluated.stdout[-2000:] + evaluated.stderr[-2000:]
    line = one_line(evaluated.stderr, "ayumi eval: ")
    assert str(meta) in line and "outside the run" in line and "--tokenizer-dir" in line, line


@pytest.mark.parametrize("entry", ["absolute", "dotdot", "link"])
def test_an_hf_index_naming_a_file_outside_its_folder_is_refused(hostile, tmp_path, entry):
    """Finding 6: model.safetensors.index.json may name only files inside the model folder."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(hostile["hf"] / "model.safetensors", elsewhere / "weights.safetensors")
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(hostile["hf"] / "config.json", folder / "config.json")
    name = {"absolute": str(elsewhere / "weights.safetensors"), "dotdot": "../elsewhere/weights.safetensors",
            "link": "linked.safetensors"}[entry]
    if entry == "link":
        (folder / name).symlink_to(elsewhere / "weights.safetensors")
    from safetensors import safe_open

    with safe_open(str(elsewhere / "weights.safetensors"), framework="pt") as handle:
        weight_map = {key: name for key in handle.keys()}
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    proc = ayumi("eval", folder, f"tasks={tmp_path / 'tasks.jsonl'}", "--tokenizer-dir", tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = one_line(proc.stderr, "ayumi eval: ")
    assert str(index) in line and "outside" in line and repr(name) in line, line
