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
from data.prepare import PrepareError, prepare
from data.task_plan import DONE_NAME, TASKS_DIR, balanced_starts, task_dir
from data.tasks import TaskArgs, resolve_task, run_task, split_task_flags
from data.config import ConfigError
from tests.data.helpers import JA_PARAGRAPHS, losses_on_roots, write_jsonl
from tests.data.test_prepare import read_split, tree_bytes
from tests.helpers import REPO

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
    losses = losses_on_roots({"one": one, "five": five}, tmp_path, steps=4)
    assert len(losses["one"]) == 4 and losses["five"] == losses["one"]


KILLER = """
import sys
sys.path.insert(0, {repo!r})
from tests.data.helpers import die_after_writes
from data.tasks import run_task
from data.cli import compose
from data.config import prepare_config

die_after_writes({kill_after})
run_task(prepare_config(compose({overrides!r})), {index}, {tasks})
"""


def test_a_task_killed_mid_write_leaves_nothing_finish_accepts(tmp_path, tokenizer_dir, corpus):
    root = tmp_path / "root"
    cfg = config(root, tokenizer_dir, corpus)
    for index in (0, 2, 3, 4):
        run_task(cfg, index, TASKS)
    script = KILLER.format(repo=str(REPO), kill_after=30, overrides=overrides(root, tokenizer_dir, corpus), index=1, tasks=TASKS)
    killed = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    folder = task_dir(root, 1, TASKS)
    assert list((folder / ".partial").rglob("*.bin*")), "the kill came while the task was writing"
    assert not (folder / DONE_NAME).exists()
    with pytest.raises(TasksIncompleteError) as refused:
        finish(cfg, TASKS)
    assert "1 of 5 tasks are not ready" in str(refused.value) and "missing 1:" in str(refused.value)
    assert not (root / MANIFEST_NAME).exists() and not (root / "en").exists(), "nothing was merged"
    run_task(cfg, 1, TASKS)  # the rerun redoes what the kill cut off
    assert not (folder / ".partial").exists()
    finish(cfg, TASKS)
    plain = tmp_path / "plain"
    prepare(config(plain, tokenizer_dir, corpus))
    assert domain_folders(root) == domain_folders(plain)


def unit_times(root: Path, name: str) -> dict[int, int]:
    return {index: (task_dir(root, index, TASKS) / name / "unit.json").stat().st_mtime_ns for index in range(TASKS)}


def test_an_edited_input_redoes_only_the_task_that_reads_it(tmp_path, tokenizer_dir, corpus, caplog):
    root = tmp_path / "root"
    cfg = config(root, tokenizer_dir, corpus)
    run_all_tasks(cfg)
    finish(cfg, TASKS)
    before = {name: unit_times(root, name) for name in ("en", "web", "ja")}
    edited = corpus["en"] / "part_3.jsonl"
    with open(edited, "a", encoding="utf-8") as handle:
        handle.write(json.dumps({"text": "A new document appended to one input file, long enough to be kept."}) + "\n")
    reader = [index for index in range(TASKS)
              if str(edited) in json.loads((task_dir(root, index, TASKS) / "en" / "unit.json").read_text())["files"]]
    assert len(reader) == 1
    with pytest.raises(TasksIncompleteError) as refused:
        finish(cfg, TASKS)
    assert f"stale {reader[0]} (en): inputs or config changed since it ran" in str(refused.value)
    caplog.set_level("INFO", logger="ayumi.data")
    run_all_tasks(cfg)  # the whole array again: only the edited share is redone
    after = {name: unit_times(root, name) for name in ("en", "web", "ja")}
    assert after["web"] == before["web"] and after["ja"] == before["ja"]
    assert [index for index in range(TASKS) if after["en"][index] != before["en"][index]] == reader
    assert caplog.text.count("finished domain is up to date, skipped") == 2 * TASKS, "web and ja were not even read"
    manifest, _ = finish(cfg, TASKS)
    plain = tmp_path / "plain"
    assert without_examples(prepare(config(plain, tokenizer_dir, corpus))["domains"]["en"]) == \
        without_examples(manifest["domains"]["en"])
    assert domain_folders(root) == domain_folders(plain)
    # A finished root is up to date: a task rerun reads nothing and finish rewrites the same manifest.
    manifest_bytes = (root / MANIFEST_NAME).read_bytes()
    run_task(cfg, 0, TASKS)
    finish(cfg, TASKS)
    assert (root / MANIFEST_NAME).read_bytes() == manifest_bytes


def test_task_flags_and_array_variables():
    args, rest = split_task_flags(["data=tiny", "--tasks", "8", "--task=3", "x=1"])
    assert (args.tasks, args.task, args.finish, args.local, rest) == (8, 3, False, False, ["data=tiny", "x=1"])
    assert resolve_task(args, {"SLURM_ARRAY_TASK_ID": "5"}) == (3, 8), "a flag wins over a variable"
    assert resolve_task(TaskArgs(), {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "10"}) == (4, 10)
    assert resolve_task(TaskArgs(tasks=2000), {"SLURM_ARRAY_TASK_ID": "4", "AYUMI_TASK_OFFSET": "1000"}) == (1004, 2000)
    assert resolve_task(TaskArgs(tasks=6), {"PBS_ARRAY_INDEX": "5"}) == (5, 6)
    assert resolve_task(TaskArgs(), {"SGE_TASK_ID": "1", "SGE_TASK_FIRST": "1", "SGE_TASK_LAST": "4"}) == (0, 4)
    assert resolve_task(TaskArgs(tasks=3, finish=True), {}) == (-1, 3)
    for args, environ, says in (
            (TaskArgs(), {"PBS_ARRAY_INDEX": "2"}, "--tasks N is not given"),
            (TaskArgs(tasks=4), {"SGE_TASK_ID": "undefined"}, "needs --task I"),
            (TaskArgs(tasks=4, task=4), {}, "task 4 (from --task) is not one of 0..3"),
            (TaskArgs(tasks=4), {"SGE_TASK_ID": "0"}, "task -1 (from SGE_TASK_ID)")):
        with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            resolve_task(args, environ)
    with pytest.raises(ConfigError, match="--tasks needs a whole number"):
        split_task_flags(["--tasks", "many"])


def test_the_cut_is_contiguous_and_balanced_by_size():
    assert balanced_starts([10] * 10, 5) == [0, 2, 4, 6, 8, 10]
    assert balanced_starts([100, 1, 1, 1, 1], 2) == [0, 1, 5], "a large file is a task's alone"
    assert balanced_starts([5, 5], 4) in ([0, 0, 1, 1, 2], [0, 1, 1, 2, 2]), "more tasks than files: some idle"


def test_damaged_task_output_is_named_and_nothing_is_published(tmp_path, tokenizer_dir, corpus):
    root = tmp_path / "root"
    cfg = config(root, tokenizer_dir, corpus)
    run_all_tasks(cfg)
    kept = task_dir(root, 2, TASKS) / "en" / "kept"
    for damaged in (kept / "part_00000.bin", kept / "keys.bin"):  # token ids; the keys that dedup and split
        original = damaged.read_bytes()
        damaged.write_bytes(bytes([original[0] ^ 1]) + original[1:])  # the same size: only a checksum sees it
        with pytest.raises(PrepareError, match=f"{damaged}: its sha256 is not the one task 2 recorded"):
            finish(cfg, TASKS)
        assert not (root / MANIFEST_NAME).exists() and not (root / "en").exists() and not (root / ".partial").exists()
        damaged.write_bytes(original)
    shard = kept / "part_00000.bin"
    shard.unlink()
    with pytest.raises(TasksIncompleteError, match=r"damaged 2 \(en\): its output was changed or is incomplete"):
        finish(cfg, TASKS)


def test_inspect_shows_the_per_task_table_while_it_describes_the_root(tmp_path, tokenizer_dir, corpus):
    from data.inspect import inspect_root

    root = tmp_path / "root"
    cfg = config(root, tokenizer_dir, corpus)
    run_all_tasks(cfg)
    manifest, summary = finish(cfg, TASKS)
    shown = inspect_root(root, samples=0)
    rows = [line.split() for line in shown.splitlines() if line.startswith("  ")]
    en = summary["domains"]["en"]["tasks"]
    for row in en:
        assert [str(row["task"]), f"{row['docs_read']:,}", f"{row['docs_kept']:,}", f"{row['tokens']:,}"] in \
            [words[:4] for words in rows]
    total = next(words for words in rows if words[0] == "all" and words[2] == f"{manifest['domains']['en']['docs_kept']:,}")
    assert total[1] == f"{manifest['domains']['en']['docs_read']:,}" and \
        total[3] == f"{manifest['domains']['en']['tokens']:,}", "the tasks add up to the domain"
    assert f"duplicate={manifest['domains']['en']['dropped']['duplicate']:,}" in total
    # A plain prepare that redoes en: the table no longer describes it, and is not shown for it.
    cfg.data.domains["en"].clean.min_chars = 200
    prepare(cfg)
    shown = inspect_root(root, samples=0)
    assert "en: 5 tasks" not in shown and "web: 5 tasks" in shown
