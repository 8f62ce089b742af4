"""`ayumi data prepare ... --tasks N --finish`: N tasks' outputs into one data root, as one machine makes it.

Every task kept its documents in stream order with their content keys (data/tasks.py). The tasks' shares are
contiguous runs of each domain's sorted files (data/task_plan.py), so reading task 0's documents, then task 1's,
... is the one-machine stream. The finishing step reads them so, through the one-machine writer
(data/prepare.py's DomainWriter): a document whose key an earlier task kept is a duplicate (first occurrence
wins), and the split router decides train or validation (`val_fraction` from the key, `val_count` the N
smallest keys in arrival order). Each split's documents, in order, are therefore a one-task run's, and so are
the shards: the writer cuts them the same way. Token bytes are copied, never tokenized again; each task shard's
sha256 is checked against its record as it is read.

Nothing is merged until every task's completion marker is there and current: the refusal names the missing,
stale (inputs or config changed since it ran) and damaged tasks in one line. Counts add up as in a one-machine
record; `.tasks/summary.json` keeps them per task (`ayumi data inspect` shows them). What differs from a
one-task run's record: the example locations of duplicates found across tasks name the task and document.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np

from common.corpus import MAX_EXAMPLES, ReadStats, count_reason
from data.config import DataPrepareConfig
from data.manifest import (
    KEY_BYTES, KEYS_NAME, MANIFEST_NAME, build_manifest, read_sealed, seal, tokenizer_identity, write_json_atomic,
)
from data.prepare import (
    PARTIAL_DIR, PIPELINE_VERSION, DomainJob, DomainWriter, PrepareError, _note_stray_domains, check_overlap,
    register_megatron_domain,
)
from data.shards import ShardReader
from data.task_plan import (
    KEPT_SPLIT, SUMMARY_NAME, TASKS_DIR, UNIT_NAME, domain_payload, task_dir, task_name, task_share,
    unit_fingerprint, unit_problem,
)
from data.tasks import task_cut

log = logging.getLogger("ayumi.data")

CHUNK_DOCS = 1 << 16
"""Documents per step when merging a task's shards: bounded memory, a few array operations per step."""
TABLE_TASKS = 50
"""Task rows shown per domain in the printed table; the rest are in .tasks/summary.json."""


class TasksIncompleteError(PrepareError):
    """Some task has not completed with the current inputs and config; the message names them."""


def finish(cfg: DataPrepareConfig, tasks: int) -> tuple[dict, dict]:
    """Merge the `tasks` tasks' outputs into `cfg.data.root`; returns (manifest, the per-task summary)."""
    info, root, plan, text, units, starts = task_cut(cfg, tasks)
    pending = [name for name in text if plan[name][3] is None]
    check_tasks(cfg, root, tasks, pending, {name: units[name] for name in pending}, starts, info.sha256)
    previous = read_sealed(root / TASKS_DIR / SUMMARY_NAME) or {}
    summary = {}
    records = {}
    quiet = dataclasses.replace(cfg, progress=False)
    try:
        for name, (files, inputs, fingerprint, record) in plan.items():
            if record is not None:
                records[name] = record
                old = previous.get("domains", {}).get(name)
                if old and old.get("fingerprint") == fingerprint:
                    summary[name] = old
                continue
            (root / MANIFEST_NAME).unlink(missing_ok=True)  # from here on, the root is not complete
            if cfg.data.domains[name].megatron:
                records[name] = register_megatron_domain(root, name, cfg.data.domains[name], info, fingerprint)
                continue
            job = DomainJob(name, cfg.data.domains[name], files, inputs, fingerprint)
            records[name], summary[name] = merge_domain(job, root, tasks, quiet, info)
    finally:
        with contextlib.suppress(OSError):
            (root / PARTIAL_DIR).rmdir()  # only when empty: a domain that failed has removed its own folder
    shutil.rmtree(root / PARTIAL_DIR, ignore_errors=True)
    overlap = check_overlap(root, records)
    summary_record = seal({"tasks": tasks, "domains": summary})
    write_json_atomic(root / TASKS_DIR / SUMMARY_NAME, summary_record)
    manifest = build_manifest(cfg.data.name, tokenizer_identity(info), records, overlap)
    write_json_atomic(root / MANIFEST_NAME, manifest)
    _note_stray_domains(root, records)
    return manifest, summary_record


def check_tasks(cfg: DataPrepareConfig, root: Path, tasks: int, names: list[str], inputs: dict[str, list[dict]],
                starts: dict[str, list[int]], tokenizer_sha256: str) -> None:
    """Raise TasksIncompleteError, naming every task that is missing, stale or damaged for these domains."""
    problems: dict[str, dict[int, list[str]]] = {}
    for name in names:
        payload = domain_payload(cfg, name, tokenizer_sha256, PIPELINE_VERSION)
        for index in range(tasks):
            fingerprint = unit_fingerprint(payload, index, tasks, inputs[name][task_share(starts[name], index)])
            problem = unit_problem(root, index, tasks, name, fingerprint)
            if problem:
                problems.setdefault(problem, {}).setdefault(index, []).append(name)
    if not problems:
        return
    why = {"missing": "not complete (never run, still running, failed or killed)",
           "stale": "inputs or config changed since it ran", "damaged": "its output was changed or is incomplete"}
    parts = []
    for kind in ("missing", "stale", "damaged"):
        found = problems.get(kind, {})
        if found:
            listed = ", ".join(str(index) if kind == "missing" else f"{index} ({', '.join(domains)})"
                               for index, domains in list(found.items())[:20])
            more = f" and {len(found) - 20} more" if len(found) > 20 else ""
            parts.append(f"{kind} {listed}{more}: {why[kind]}")
    count = len({index for found in problems.values() for index in found})
    raise TasksIncompleteError(
        f"cannot finish: {count} of {tasks} tasks are not ready under {root / TASKS_DIR}: {'; '.join(parts)}. "
        f"Fix: run those tasks again (the same command with --tasks {tasks} --task I, or the whole array: "
        "completed tasks are skipped), then --finish.")


def merge_domain(job: DomainJob, root: Path, tasks: int, cfg: DataPrepareConfig, tokenizer) -> tuple[dict, dict]:
    """Route the tasks' kept documents, in task order, through the one-machine writer; returns (the domain's
    record, its per-task summary)."""
    writer = DomainWriter(job, root, cfg, tokenizer)
    rows = []
    try:
        for index in range(tasks):
            folder = task_dir(root, index, tasks) / job.name
            unit = read_sealed(folder / UNIT_NAME)
            job.stats.merge(ReadStats(**unit["stats"]))  # reader skips, their first locations in task order
            for reason, count in unit["dropped"].items():
                count_reason(writer.drops.counts, writer.drops.examples, reason,
                             unit["drop_examples"].get(reason, []), count)
            copies, tokens = 0, 0
            for first, keys, lengths, chunk in unit_documents(folder, unit, index, tasks):
                keep = writer.deduper.first_seen(keys)
                duplicates = np.flatnonzero(~keep)
                if duplicates.size:
                    where = [f"task {index} ({task_name(index, tasks)}) document #{first + row}: a copy of an "
                             "earlier task's" for row in duplicates[:MAX_EXAMPLES]]
                    count_reason(writer.drops.counts, writer.drops.examples, "duplicate", where, int(duplicates.size))
                writer.router.add_chunk(keys, lengths, chunk, keep)
                copies += int(duplicates.size)
                tokens += int(lengths[keep].sum())
            writer.docs += unit["stats"]["docs_read"]
            writer.text_bytes += unit["text_bytes"]
            dropped = dict(unit["dropped"])
            if copies:
                dropped["duplicate"] = dropped.get("duplicate", 0) + copies
            rows.append({"task": index, "docs_read": unit["stats"]["docs_read"], "docs_kept": unit["docs_kept"] - copies,
                         "dropped": dict(sorted(dropped.items())), "skipped": unit["stats"]["skipped"],
                         "tokens": tokens, "text_bytes": unit["text_bytes"], "seconds": unit["seconds"],
                         "cross_task_duplicates": copies})
        record = writer.finish()
    except BaseException:
        writer.abort()
        raise
    return record, {"fingerprint": job.fingerprint, "tasks": rows}


def unit_documents(folder: Path, unit: dict, index: int, tasks: int) -> Iterator[tuple]:
    """A task's kept documents in order, CHUNK_DOCS at a time: (index of the first, keys, lengths, tokens).
    Each shard's bytes are hashed as they are read and must match the task's record."""
    split = unit["splits"].get(KEPT_SPLIT)
    if not split:
        return
    first, keys_digest = 0, hashlib.sha256()
    with open(folder / KEPT_SPLIT / KEYS_NAME, "rb") as keys_file:
        for shard in split["shards"]:
            reader = ShardReader(folder / KEPT_SPLIT / shard["name"])
            offsets, digest = reader.doc_offsets, hashlib.sha256()
            for start in range(0, reader.num_docs, CHUNK_DOCS):
                stop = min(start + CHUNK_DOCS, reader.num_docs)
                tokens = reader.tokens[offsets[start]:offsets[stop]]
                digest.update(tokens.tobytes())
                raw_keys = keys_file.read((stop - start) * KEY_BYTES)
                keys_digest.update(raw_keys)
                keys = np.frombuffer(raw_keys, dtype=np.uint8).reshape(-1, KEY_BYTES)
                yield first, keys, np.diff(offsets[start:stop + 1]), tokens
                first += stop - start
            if digest.hexdigest() != shard["sha256"]:
                raise _damaged(reader.bin_path, folder, index, tasks)
    if keys_digest.hexdigest() != unit.get("keys_sha256"):
        raise _damaged(folder / KEPT_SPLIT / KEYS_NAME, folder, index, tasks)


def _damaged(path: Path, folder: Path, index: int, tasks: int) -> PrepareError:
    return PrepareError(f"{path}: its sha256 is not the one task {index} recorded (changed or damaged after the task "
                        f"wrote it). Fix: remove {folder} and run task {index} again (--tasks {tasks} --task {index}).")


def task_table(summary: dict, limit: int = TABLE_TASKS) -> list[str]:
    """Per domain, one line per task (read, kept, tokens, dropped by reason), then the domain's total."""
    lines = []
    for name, entry in summary.get("domains", {}).items():
        rows = entry["tasks"]
        copies = sum(row["cross_task_duplicates"] for row in rows)
        lines.append(f"{name}: {len(rows)} tasks, {copies:,} duplicates found across tasks")
        lines.append(f"  {'task':>6}{'read':>12}{'kept':>12}{'tokens':>14}{'MB':>9}{'s':>8}  dropped")
        total = {"task": "all", "docs_read": 0, "docs_kept": 0, "tokens": 0, "text_bytes": 0, "seconds": 0.0, "dropped": {}}
        for row in rows:
            for key in ("docs_read", "docs_kept", "tokens", "text_bytes", "seconds"):
                total[key] += row[key]
            for reason, count in {**row["dropped"], **row["skipped"]}.items():
                total["dropped"][reason] = total["dropped"].get(reason, 0) + count
        shown = rows[:limit] + [total]
        for row in shown:
            reasons = {**row["dropped"], **row.get("skipped", {})}
            dropped = ", ".join(f"{reason}={count:,}" for reason, count in sorted(reasons.items())) or "-"
            lines.append(f"  {row['task']:>6}{row['docs_read']:>12,}{row['docs_kept']:>12,}{row['tokens']:>14,}"
                         f"{row['text_bytes'] / 1e6:>9.1f}{row['seconds']:>8.1f}  {dropped}")
        if len(rows) > limit:
            lines.insert(len(lines) - 1, f"  ... {len(rows) - limit} more tasks in {TASKS_DIR}/{SUMMARY_NAME}")
    return lines
