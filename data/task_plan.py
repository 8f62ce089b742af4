"""How `ayumi data prepare --tasks N` cuts a corpus into N tasks, and what a task leaves behind.

The cut: per domain, its sorted input files are dealt out as N contiguous runs of units, balanced by size
(a unit goes to the task whose share of the domain's bytes holds the unit's middle byte). A unit is a whole
file, or a piece of an uncompressed jsonl file larger than one task's share (the domain's bytes / N): such a
file is cut into pieces of about a share each, at line starts (`task_units`), so one large file keeps N tasks
busy. Contiguous runs are what make the result independent of the cut: task 0's units, then task 1's, ... is
the one-machine stream order, so the finishing step (data/finish.py) merges the tasks in index order and
decides de-duplication and the validation split exactly as one machine does. A piece numbers its lines from
its first byte (a drop location reads `file@BYTE:LINE`): counting the lines before it would read the file up to
there in every task. Compressed and non-jsonl files are never cut; fewer of them than tasks leaves tasks idle.

The cut is recorded in `.tasks/plan.json` and reused while a domain's file list is unchanged, so editing one
input (a new size) moves no boundary and redoes only the task that reads it. A new or removed file, or another
N, makes a new cut for that domain: every task then redoes it.

Layout under DATA_ROOT::

    .tasks/plan.json                         the cut: per domain, each task's first file index
    .tasks/00003-of-00005/<domain>/unit.json what the task did for the domain (counts, its files, shards with sha256)
    .tasks/00003-of-00005/<domain>/kept/     the task's kept documents in stream order (Megatron shards + keys.bin)
    .tasks/00003-of-00005/.partial/<domain>/ a domain being written by the task; never read
    .tasks/00003-of-00005/done.json          the completion marker, written last: each unit's fingerprint and checksum
    .tasks/summary.json                      per-task counts of the last finish (`ayumi data inspect` shows them)

A unit's fingerprint covers the pipeline version, the domain's config, the tokenizer, `strict`, the task's
place in the cut and its files' sizes and modification times: a rerun skips a unit whose fingerprint is
unchanged and redoes any other.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from data.config import DataPrepareConfig
from data.manifest import read_json, read_sealed, seal, shards_intact, write_json_atomic

TASKS_DIR = ".tasks"
PLAN_NAME = "plan.json"
UNIT_NAME = "unit.json"
DONE_NAME = "done.json"
SUMMARY_NAME = "summary.json"
KEPT_SPLIT = "kept"
"""A task's one split: every document it kept, in stream order (the finishing step splits them)."""


def task_name(index: int, tasks: int) -> str:
    """The folder of task `index` of `tasks`: 00003-of-00005 (another N never reads it)."""
    return f"{index:05d}-of-{tasks:05d}"


def task_dir(root: Path, index: int, tasks: int) -> Path:
    return Path(root) / TASKS_DIR / task_name(index, tasks)


def balanced_starts(sizes: list[int], tasks: int) -> list[int]:
    """The first file index of each task's contiguous run (tasks + 1 values, the last = len(sizes)).

    File j goes to task floor(tasks * (bytes before j + half of j) / all bytes): contiguous, in order, and as
    even as whole files allow. Empty files count one byte, so a domain of empty files is still dealt out.
    """
    weights = [max(1, size) for size in sizes]
    total = sum(weights)
    owner, before = [], 0
    for weight in weights:
        owner.append(min(tasks - 1, (tasks * (2 * before + weight)) // (2 * total)) if total else 0)
        before += weight
    return [sum(1 for task in owner if task < index) for index in range(tasks)] + [len(sizes)]


def task_units(inputs: list[dict], tasks: int, fmt: str = "auto") -> list[dict]:
    """A domain's inputs (file_fingerprints) as the units of the cut: each uncompressed jsonl file larger than one
    task's share becomes pieces of about a share each, `start` and `stop` added (byte offsets at line starts, a
    pure function of the file's bytes); every other file stays whole. `fmt`: the domain's `format`."""
    total = sum(max(0, item["size"]) for item in inputs)
    share = total / tasks if tasks else 0
    units = []
    for item in inputs:
        if tasks > 1 and item["size"] > share > 0 and _splittable(Path(item["path"]), fmt):
            cuts = _line_starts(Path(item["path"]), item["size"], -(-item["size"] * tasks // total))  # size / share
            units += [{**item, "start": start, "stop": stop} for start, stop in zip(cuts, cuts[1:])]
        else:
            units.append(item)
    return units


def _splittable(path: Path, fmt: str) -> bool:
    from common.corpus import CorpusError, detect_format

    if path.name.lower().endswith((".gz", ".zst", ".zstd")) or not path.is_file():
        return False
    try:
        return (detect_format(path) if fmt == "auto" else fmt) == "jsonl"
    except CorpusError:
        return False


def _line_starts(path: Path, size: int, pieces: int) -> list[int]:
    """0, the first line start at or after each k * size / pieces (k = 1..pieces-1, repeats dropped), size."""
    cuts = [0]
    with open(path, "rb") as handle:
        for k in range(1, pieces):
            handle.seek(max(cuts[-1], k * size // pieces - 1))  # from the byte before: a cut already at a line start
            handle.readline()
            at = handle.tell()
            if cuts[-1] < at < size:
                cuts.append(at)
    return cuts + [size]


def unit_name(item: dict) -> str:
    """A unit's name in plan.json: the file's path, with `@start` for a piece."""
    return f"{item['path']}@{item['start']}" if "start" in item else item["path"]


def unit_bytes(item: dict) -> int:
    return item["stop"] - item["start"] if "start" in item else item["size"]


def plan_cut(root: Path, tasks: int, inputs_by_domain: dict[str, list[dict]]) -> dict[str, list[int]]:
    """Each domain's task starts (balanced_starts), reused from plan.json while the domain's units and N are
    unchanged; plan.json is (re)written when anything differs. `inputs_by_domain`: task_units."""
    path = Path(root) / TASKS_DIR / PLAN_NAME
    try:
        recorded = read_json(path) if path.is_file() else {}
    except ValueError:
        recorded = {}  # unreadable: cut again
    old = recorded.get("domains", {}) if recorded.get("tasks") == tasks else {}
    cut: dict[str, dict] = {}
    for name, inputs in inputs_by_domain.items():
        paths = [unit_name(item) for item in inputs]
        previous = old.get(name)
        if previous and previous.get("files") == paths:
            cut[name] = previous
        else:
            cut[name] = {"files": paths, "starts": balanced_starts([unit_bytes(item) for item in inputs], tasks)}
    plan = {"tasks": tasks, "domains": cut}
    if plan != recorded:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, plan)  # tasks starting together compute the same plan: the last rename wins
    return {name: entry["starts"] for name, entry in cut.items()}


def task_share(starts: list[int], index: int) -> slice:
    """The slice of a domain's units (task_units) that task `index` reads."""
    return slice(starts[index], starts[index + 1])


def unit_fingerprint(domain_payload: dict, index: int, tasks: int, inputs: list[dict]) -> str:
    """sha256 over what decides a task's output for one domain: the domain's fingerprint payload (pipeline
    version, config, tokenizer, strict: data/prepare.py), the task's place and its files' sizes and mtimes."""
    payload = {**domain_payload, "task": index, "tasks": tasks, "files": inputs}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


def domain_payload(cfg: DataPrepareConfig, name: str, tokenizer_sha256: str, pipeline_version: int) -> dict:
    """Everything but the files that decides a domain's output (the unit fingerprint adds the task's files)."""
    return {"pipeline_version": pipeline_version, "domain": dataclasses.asdict(cfg.data.domains[name]),
            "tokenizer_sha256": tokenizer_sha256, "strict": cfg.strict}


def finished_unit(unit_dir: Path, fingerprint: str) -> dict | None:
    """The record of a task's finished domain with this fingerprint whose shards are all there, else None."""
    record = read_sealed(unit_dir / UNIT_NAME)
    if record is None or record.get("fingerprint") != fingerprint or not shards_intact(unit_dir, record):
        return None
    return record


def write_marker(folder: Path, index: int, tasks: int, units: dict[str, dict]) -> None:
    """The completion marker: each unit's fingerprint and record checksum, written atomically, last."""
    marker = {"task": index, "tasks": tasks,
              "units": {name: {"fingerprint": unit["fingerprint"], "record_sha256": unit["record_sha256"]}
                        for name, unit in units.items()}}
    write_json_atomic(folder / DONE_NAME, seal(marker))


def unit_problem(root: Path, index: int, tasks: int, name: str, fingerprint: str) -> str | None:
    """Why task `index`'s unit for domain `name` cannot be merged ("missing", "stale", "damaged"), or None."""
    folder = task_dir(root, index, tasks)
    marker = read_sealed(folder / DONE_NAME)
    if marker is None or marker.get("task") != index or marker.get("tasks") != tasks:
        return "missing"
    entry = marker.get("units", {}).get(name)
    if entry is None or entry.get("fingerprint") != fingerprint:
        return "stale"
    unit = finished_unit(folder / name, fingerprint)
    if unit is None or unit.get("record_sha256") != entry.get("record_sha256"):
        return "damaged"
    return None
