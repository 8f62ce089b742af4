"""`--tasks N` over a domain of one large jsonl file: the file is cut into pieces at line starts (data/task_plan.py),
every task reads one, and the finish gives the one-task root (issue 50: large files split at byte ranges)."""
from __future__ import annotations

import json
from pathlib import Path

from data.cli import compose
from data.config import prepare_config
from data.finish import finish
from data.prepare import prepare
from data.task_plan import task_dir, task_units
from data.sources import file_fingerprints
from data.tasks import run_task
from tests.data.helpers import write_jsonl
from tests.data.test_tasks import domain_folders, without_examples

TASKS = 3


def config(root: Path, tokenizer: Path, big: Path):
    return prepare_config(compose([
        f"tokenizer_dir={tokenizer}", f"data.root={root}", "data.name=pieces", "workers=0", "progress=false",
        f"data.domains.en.inputs=['{big}']", "data.domains.en.val_fraction=0.2", "data.domains.en.shard_max_mb=0.01",
        "data.domains.en.clean.min_script_share=0", "~data.domains.ja"]))


def test_one_large_file_over_three_tasks_gives_the_one_task_root(tmp_path, tokenizer_dir, en_texts):
    texts = en_texts[:120]
    # Copies far apart (they land in other pieces: the finish drops them as one machine does) and a bad record.
    documents = texts[:60] + texts[5:12] + texts[60:] + texts[100:104]
    write_jsonl(tmp_path / "big.jsonl", documents)
    big = tmp_path / "big.jsonl"
    with open(big, "a", encoding="utf-8") as handle:
        handle.write("{not json\n" + json.dumps({"text": "The last document, after a bad line."}) + "\n")
    units = task_units(file_fingerprints([big]), TASKS)
    data = big.read_bytes()
    assert len(units) == TASKS and units[0]["start"] == 0 and units[-1]["stop"] == len(data)
    assert all(data[unit["start"] - 1:unit["start"]] == b"\n" for unit in units[1:]), "pieces start at line starts"

    cfg = config(tmp_path / "root", tokenizer_dir, big)
    for index in range(TASKS):
        run_task(cfg, index, TASKS)
    assert [len(json.loads((task_dir(cfg.data.root, index, TASKS) / "en" / "unit.json").read_text())["files"])
            for index in range(TASKS)] == [1, 1, 1], "every task read one piece"
    last = json.loads((task_dir(cfg.data.root, TASKS - 1, TASKS) / "en" / "unit.json").read_text())
    bad_line = last["stats"]["examples"]["malformed_json"][0]
    assert bad_line.startswith(f"{big}@{units[-1]['start']}:"), "a piece's lines are numbered from its first byte"
    manifest, _ = finish(cfg, TASKS)
    plain = prepare(config(tmp_path / "plain", tokenizer_dir, big))
    assert without_examples(manifest["domains"]["en"]) == without_examples(plain["domains"]["en"])
    copies = len(documents) - len(set(documents))  # the 11 planted, and those en_texts holds itself
    assert manifest["domains"]["en"]["dropped"]["duplicate"] == copies >= 11
    assert manifest["domains"]["en"]["files_read"] == 1 and manifest["domains"]["en"]["skipped"]
    assert domain_folders(Path(cfg.data.root)) == domain_folders(tmp_path / "plain")
