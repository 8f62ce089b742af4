"""`ayumi data prepare --tasks N`: array tasks, the finishing step, resume and failure task by task.

The contract: N tasks then `--finish` give each split the documents, in order, of a one-task run of the same
config (here even the same shard bytes), so training on either gives the same losses step by step.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.cli import compose
from data.config import prepare_config
from data.finish import TasksIncompleteError, finish
from data.manifest import MANIFEST_NAME, load_manifest
from data.prepare import prepare
from data.task_plan import DONE_NAME, TASKS_DIR, balanced_starts, task_dir
from data.tasks import TaskArgs, resolve_task, run_task, split_task_flags
from data.config import ConfigError
from tests.data.helpers import JA_PARAGRAPHS, write_jsonl
from tests.data.test_prepare import read_split, tree_bytes
from tests.helpers import REPO, run_training, tiny_overrides, train_losses

TASKS = 5


def write_corpus(folder: Path, en_texts: list[str]) -> dict[str, Path]:
    """Three domains with duplicates inside files, across files and across domains, in jsonl and text files."""
    en = en_texts[:150]
    for number in range(6):
        texts = en[25 * number:25 * number + 25]
        if number == 2:
            texts = texts + en[3:8]  # copies of file 0's documents: a later task finds them
        if number == 5:
            texts = texts[:10] + texts[:4] + texts[10:]  # copies inside one file
        write_jsonl(folder / "en" / f"part_{number}.jsonl", texts)
    write_jsonl(folder / "web" / "a.jsonl", en_texts[150:190] + en[:6])  # shared with en: the same split there
    write_jsonl(folder / "web" / "b.jsonl", en_texts[190:230] + en_texts[150:153])
    (folder / "web" / "c.txt").write_text("\n".join(text.replace("\n", " ") for text in en_texts[230:260]) + "\n",
                                          encoding="utf-8")
    ja = [paragraph * (repeat + 1) for repeat in range(6) for paragraph in JA_PARAGRAPHS]
    write_jsonl(folder / "ja" / "a.jsonl", ja[:30])
    write_jsonl(folder / "ja" / "b.jsonl", ja[25:] + ja[:3])
    return {name: folder / name for name in ("en", "web", "ja")}


def overrides(root: Path, tokenizer: Path, corpus: dict[str, Path]) -> list[str]:
    """The CLI overrides of the three-domain config (val_fraction on the shared domains, val_count on ja)."""
    return [f"tokenizer_dir={tokenizer}", f"data.root={root}", "data.name=tasks", "workers=0", "progress=false",
            f"data.domains.en.inputs=['{corpus['en']}/*.jsonl']", "data.domains.en.val_fraction=0.2",
            "data.domains.en.shard_max_mb=0.01", "data.domains.en.clean.min_script_share=0",
            "+data_domain@data.domains.web=schema", f"data.domains.web.inputs=['{corpus['web']}/*']",
            "data.domains.web.val_fraction=0.2", "data.domains.web.shard_max_mb=0.02",
            f"data.domains.ja.inputs=['{corpus['ja']}/*.jsonl']", "data.domains.ja.val_count=3",
            "data.domains.ja.text_unit=line"]


def config(root: Path, tokenizer: Path, corpus: dict[str, Path]):
    return prepare_config(compose(overrides(root, tokenizer, corpus)))


def run_all_tasks(cfg, tasks: int = TASKS) -> None:
    for index in range(tasks):
        run_task(cfg, index, tasks)


def domain_folders(root: Path) -> dict[str, bytes]:
    """Every file of the data root but the tasks' own folder and the records (compared apart)."""
    return {name: data for name, data in tree_bytes(root).items()
            if not name.startswith(TASKS_DIR) and not name.endswith(".json")}


def without_examples(record: dict) -> dict:
    return {key: value for key, value in record.items() if key not in ("drop_examples", "record_sha256")}


@pytest.fixture
def corpus(tmp_path, en_texts) -> dict[str, Path]:
    return write_corpus(tmp_path / "in", en_texts)


def test_five_parallel_tasks_train_exactly_like_one_machine(tmp_path, tokenizer_dir, corpus):
    one, five = tmp_path / "one", tmp_path / "five"
    manifest = prepare(config(one, tokenizer_dir, corpus))
    assert manifest["domains"]["en"]["dropped"]["duplicate"] >= 9, "the corpus has duplicates across files"
    done = subprocess.run([sys.executable, "-m", "data.cli", "prepare", *overrides(five, tokenizer_dir, corpus),
                           f"--tasks={TASKS}", "--local"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"finished {TASKS} tasks into {five}" in done.stdout
    for index in range(TASKS):  # every task printed its progress line with the numbers a watcher needs
        assert f"task {index}/{TASKS} en: " in done.stderr and "MB/s" in done.stderr
    merged = load_manifest(five)
    for name in ("en", "web", "ja"):
        for split in ("train", "val"):
            expected = [doc.tolist() for doc in read_split(one, name, split)]
            assert [doc.tolist() for doc in read_split(five, name, split)] == expected, (name, split)
        assert without_examples(merged["domains"][name]) == without_examples(manifest["domains"][name])
    assert domain_folders(five) == domain_folders(one), "the shards are even cut the same way"
    assert sum(row["cross_task_duplicates"] for row in json.loads(
        (five / TASKS_DIR / "summary.json").read_text())["domains"]["en"]["tasks"]) >= 5
    # The same training steps on both roots.
    losses = {}
    for name, root in (("one", one), ("five", five)):
        proc = run_training(tiny_overrides(root, tmp_path / f"run_{name}", "train.max_steps=4", "checkpoint.interval=0",
                                           "train.eval_interval=0"), nproc=2, launcher="fork")
        assert proc.returncode == 0, proc.stdout[-4000:]
        losses[name] = train_losses(tmp_path / f"run_{name}" / "cpu_tiny")
    assert len(losses["one"]) == 4 and losses["five"] == losses["one"]
