"""launch/prepare_{slurm,pbs,sge}.sh: the submissions they print with --dry-run, and the printed task commands run
for real as a scheduler would (its array variables set, no --task flag), then the finish."""
from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest

from data.manifest import load_manifest
from data.prepare import prepare
from tests.data.test_tasks import config, domain_folders, overrides, write_corpus
from tests.helpers import REPO

LAUNCH = REPO / "launch"
TEMPLATES = ("prepare_slurm.sh", "prepare_pbs.sh", "prepare_sge.sh")


def dry_run(script: str, *args: str, env: dict | None = None, cwd: Path = REPO) -> list[list[str]]:
    """The words of each printed submission ("+ ..." lines, on stderr: stdout carries job ids)."""
    base = {key: value for key, value in os.environ.items()
            if not key.startswith(("SLURM_", "PBS_", "SGE_", "AYUMI_"))}
    proc = subprocess.run(["bash", str(LAUNCH / script), "--dry-run", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line[2:]) for line in proc.stderr.splitlines() if line.startswith("+ ")]


def inner(words: list[str]) -> list[str]:
    """The ayumi command inside a submission's shell command (after `exec`)."""
    shell = words[words.index("--wrap") + 1] if "--wrap" in words else words[-1]
    split = shlex.split(shell)
    return split[split.index("exec") + 1:]


def test_templates_parse():
    for script in (*TEMPLATES, "prepare_common.sh"):
        subprocess.run(["bash", "-n", str(LAUNCH / script)], check=True)


@pytest.mark.parametrize("script, array, depend", [
    ("prepare_slurm.sh", "--array=0-11", "--dependency=afterok:JOBID"),
    ("prepare_pbs.sh", "0-11", "depend=afterok:JOBID"),
    ("prepare_sge.sh", "1-12", "JOBID"),
])
def test_each_template_prints_an_array_then_a_dependent_finish(tmp_path, script, array, depend):
    task, finish = dry_run(script, "--tasks", "12", "--cpus", "4", "--sched-arg", "-q cpu", "data=ja_en",
                           "data.root=my root", cwd=tmp_path)
    assert task[0] in ("sbatch", "qsub") and array in task and depend in finish and "-q" in finish
    assert Path(inner(task)[0]).name == "ayumi"
    assert inner(task)[1:] == ["data", "prepare", "data=ja_en", "data.root=my root", "workers=4", "--tasks", "12"]
    assert inner(finish)[1:] == inner(task)[1:] + ["--finish"]
    assert shlex.split((task[task.index("--wrap") + 1] if "--wrap" in task else task[-1]))[:2] == ["cd", str(tmp_path)]
    assert not (tmp_path / "prepare-logs").exists(), "a dry run writes nothing"


def test_slurm_splits_large_arrays_and_errors_are_one_line():
    submissions = dry_run("prepare_slurm.sh", "--tasks", "2500", "workers=2")
    arrays = [words for words in submissions if any(word.startswith("--array=") for word in words)]
    assert [next(w for w in words if w.startswith("--array=")) for words in arrays] == \
        ["--array=0-999", "--array=0-999", "--array=0-499"]
    assert [next(w for w in words if w.startswith("--export=")) for words in arrays] == \
        [f"--export=ALL,AYUMI_TASK_OFFSET={offset}" for offset in (0, 1000, 2000)]
    assert "--dependency=afterok:JOBID:JOBID:JOBID" in submissions[-1]
    assert inner(arrays[0])[-3:] == ["workers=2", "--tasks", "2500"], "an explicit workers= is kept, not added"
    bad = subprocess.run(["bash", str(LAUNCH / "prepare_pbs.sh"), "--dry-run", "data=tiny"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "prepare_pbs.sh: --tasks N is required (a whole number >= 1), got ''"


def test_printed_commands_run_as_array_tasks(tmp_path, tokenizer_dir, en_texts):
    """SLURM's command, run twice with the variables its arrays set (AYUMI_MAX_ARRAY=1: two arrays of one task,
    the second with an offset), then its finish: the root one machine makes."""
    corpus = write_corpus(tmp_path / "in", en_texts)
    submissions = dry_run("prepare_slurm.sh", "--tasks", "2", *overrides(tmp_path / "root", tokenizer_dir, corpus),
                          env={"AYUMI_MAX_ARRAY": "1"})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for words in submissions[:2]:
        offset = next(w for w in words if w.startswith("--export=")).split("AYUMI_TASK_OFFSET=")[1]
        shell = words[words.index("--wrap") + 1]
        done = subprocess.run(["bash", "-c", shell], env={**env, "SLURM_ARRAY_TASK_ID": "0", "AYUMI_TASK_OFFSET": offset},
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and f"task {offset} of 2 complete" in done.stdout, done.stderr[-2000:]
    done = subprocess.run(["bash", "-c", submissions[2][submissions[2].index("--wrap") + 1]], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    prepare(config(tmp_path / "plain", tokenizer_dir, corpus))
    assert domain_folders(tmp_path / "root") == domain_folders(tmp_path / "plain")
    assert load_manifest(tmp_path / "root")["totals"] == load_manifest(tmp_path / "plain")["totals"]
