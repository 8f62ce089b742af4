"""`ayumi data prepare ... --tasks N --task I`: one task of an array job, and N tasks as local processes.

A task reads its share of every domain's files (data/task_plan.py: contiguous runs of files, and pieces of large
jsonl files, balanced by size), cleans, de-duplicates within its share and tokenizes exactly as a one-machine run does (data/prepare.py,
the same workers and stream), and writes every document it kept, in stream order, with its content key, under
`DATA_ROOT/.tasks/<task>/<domain>/`. Cross-task de-duplication and the train/validation split are the
finishing step's (`--finish`, data/finish.py): only it sees the whole stream.

Which task this process is: `--task I` and `--tasks N` win; without them the scheduler's array variables are
read, SLURM's first (SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT), then PBS Pro's (PBS_ARRAY_INDEX; PBS has no
count variable, so `--tasks` is needed), then Grid Engine's (SGE_TASK_ID and SGE_TASK_LAST, 1-based: task
SGE_TASK_ID - 1). AYUMI_TASK_OFFSET is added to the index: the way to run more tasks than one array may hold.

Why no executor library (datatrove, submitit, Ray): the schedulers' own arrays already give what a task needs
(an index, a retry, a log per task), and a task is one `ayumi` command, so the cluster's nodes need nothing
beyond ayumi's own environment and the templates stay plain `sbatch`/`qsub` lines an administrator can read.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from common.files import replace_dir
from data.config import ConfigError, DataPrepareConfig, check_prepare_config
from data.manifest import KEYS_NAME, seal, write_json_atomic
from data.prepare import (
    PARTIAL_DIR, PIPELINE_VERSION, DomainJob, DomainWriter, ShardSequence, _encoder_path, _load_tokenizer, _plan,
    _select, prepare_domains,
)
from data.task_plan import (
    KEPT_SPLIT, UNIT_NAME, DONE_NAME, domain_payload, finished_unit, plan_cut, task_dir, task_name, task_share,
    task_units, unit_bytes, unit_fingerprint, write_marker,
)
from data.shards import file_sha256
from data.workers import ChunkPool

log = logging.getLogger("ayumi.data")

PROGRESS_SECONDS = 30.0
"""How often a task logs its progress line (and once when each domain is done)."""


@dataclasses.dataclass
class TaskArgs:
    """The task flags of `ayumi data prepare`, read before Hydra sees the overrides."""

    tasks: int | None = None
    """--tasks N: how many tasks the corpus is cut into."""
    task: int | None = None
    """--task I: which one this process runs (0-based); else the scheduler's array variable."""
    finish: bool = False
    """--finish: merge the N tasks into the data root (data/finish.py)."""
    local: bool = False
    """--local: run the N tasks as processes on this machine, then finish."""

    @property
    def given(self) -> bool:
        return self.tasks is not None or self.task is not None or self.finish or self.local


def split_task_flags(argv: list[str]) -> tuple[TaskArgs, list[str]]:
    """(the task flags, the remaining overrides); ConfigError for a flag without its number."""
    args, rest, at = TaskArgs(), [], 0
    while at < len(argv):
        word = argv[at]
        name, _, value = word.partition("=")
        if name in ("--tasks", "--task"):
            if not value:
                at += 1
                value = argv[at] if at < len(argv) else ""
            try:
                number = int(value)
            except ValueError:
                raise ConfigError(f"{name} needs a whole number, got {value!r}") from None
            setattr(args, name[2:], number)
        elif word == "--finish":
            args.finish = True
        elif word == "--local":
            args.local = True
        else:
            rest.append(word)
        at += 1
    return args, rest


def scheduler_task(environ: dict) -> tuple[int | None, int | None, str]:
    """(index, count or None, variable read) from an array job's environment; (None, None, "") outside one."""
    if environ.get("SLURM_ARRAY_TASK_ID", "").isdigit():
        count = environ.get("SLURM_ARRAY_TASK_COUNT", "")
        return int(environ["SLURM_ARRAY_TASK_ID"]), int(count) if count.isdigit() else None, "SLURM_ARRAY_TASK_ID"
    if environ.get("PBS_ARRAY_INDEX", "").isdigit():
        return int(environ["PBS_ARRAY_INDEX"]), None, "PBS_ARRAY_INDEX"
    if environ.get("SGE_TASK_ID", "").isdigit():  # "undefined" outside an array job
        last, first = environ.get("SGE_TASK_LAST", ""), environ.get("SGE_TASK_FIRST", "1")
        count = int(last) if last.isdigit() and first == "1" else None
        return int(environ["SGE_TASK_ID"]) - 1, count, "SGE_TASK_ID"
    return None, None, ""


def resolve_task(args: TaskArgs, environ: dict) -> tuple[int, int]:
    """(index, tasks) of this process: flags first, then the scheduler's variables (module doc)."""
    index, count, source = scheduler_task(environ)
    tasks = args.tasks if args.tasks is not None else count
    if tasks is None:
        raise ConfigError("--tasks N is not given and no array variable says how many tasks there are "
                          "(PBS has none). Fix: pass --tasks N, the same N to every task and to --finish.")
    if tasks < 1:
        raise ConfigError(f"--tasks={tasks} must be >= 1.")
    if args.finish or args.local:
        return -1, tasks
    if args.task is not None:
        index, source = args.task, "--task"
    elif index is None:
        raise ConfigError(f"--tasks {tasks} needs --task I (0-based), an array job's variable (SLURM_ARRAY_TASK_ID, "
                          "PBS_ARRAY_INDEX, SGE_TASK_ID), --local (all tasks here) or --finish.")
    offset = environ.get("AYUMI_TASK_OFFSET", "0")
    if source != "--task":
        if not offset.isdigit():
            raise ConfigError(f"AYUMI_TASK_OFFSET={offset!r} must be a whole number >= 0.")
        index += int(offset)
    if not 0 <= index < tasks:
        raise ConfigError(f"task {index} (from {source}) is not one of 0..{tasks - 1} (--tasks {tasks}). "
                          "Fix: an array of indices 0..N-1 (Grid Engine: 1..N), or AYUMI_TASK_OFFSET for a later array.")
    return index, tasks


class KeepAll:
    """A task's router: every document the task kept goes to its one split, in stream order."""

    def __init__(self, kept: ShardSequence):
        self.kept = kept

    def add_chunk(self, keys: np.ndarray, lengths: np.ndarray, tokens: np.ndarray, keep: np.ndarray) -> None:
        if keep.any():
            self.kept.add_docs(*_select(keep, keys, lengths, tokens))


class TaskDomainWriter(DomainWriter):
    """A task's share of one domain: its kept documents under `.tasks/<task>/<domain>/kept/`, its counts in
    unit.json, published as one folder (the parent class' atomic move) once complete."""

    def __init__(self, job: DomainJob, folder: Path, cfg: DataPrepareConfig, tokenizer, label: str, share: str):
        self.label, self.share = label, share
        self.total_bytes = sum(max(0, unit_bytes(item)) for item in job.inputs)
        self.reported = time.monotonic()
        super().__init__(job, folder, cfg, tokenizer)

    def _announce(self) -> None:
        log.info("%s %s: %s (%.1f MB)", self.label, self.job.name, self.share, self.total_bytes / 1e6)

    def _open_outputs(self, cap: int) -> None:
        self.kept = ShardSequence(self.partial / KEPT_SPLIT, cap, self.tokenizer.vocab_size)
        self.router = KeepAll(self.kept)

    def route(self, meta, result) -> None:
        super().route(meta, result)
        if time.monotonic() - self.reported >= PROGRESS_SECONDS:
            self.report()

    def report(self, done: bool = False) -> None:
        """One progress line: documents, text MB of the share's input MB (on disk: compressed inputs hold more
        text than their size, so the ETA is an estimate), MB/s and the ETA."""
        self.reported = time.monotonic()
        seconds = max(self.reported - self.started, 1e-9)
        rate = self.text_bytes / 1e6 / seconds
        left = max(0.0, self.total_bytes - self.text_bytes) / 1e6
        eta = "done" if done else f"ETA {time.strftime('%H:%M:%S', time.gmtime(left / rate))}" if rate > 0 else "ETA ?"
        log.info("%s %s: %s docs, %.1f of ~%.1f MB, %.2f MB/s, %s", self.label, self.job.name, f"{self.docs:,}",
                 self.text_bytes / 1e6, self.total_bytes / 1e6, rate, eta)

    def finish(self) -> dict:
        job = self.job
        kept = self.kept.close()
        self.report(done=True)
        stats = job.stats
        record = seal({
            "domain": job.name, "task": self.label, "fingerprint": job.fingerprint,
            "files": [item["path"] for item in job.inputs],
            "stats": {"files_read": stats.files_read, "docs_read": stats.docs_read, "skipped": dict(stats.skipped),
                      "examples": {reason: list(where) for reason, where in stats.examples.items()}},
            "text_bytes": self.text_bytes, "docs_kept": kept["docs"], "tokens": kept["tokens"],
            "dropped": dict(sorted(self.drops.counts.items())),
            "drop_examples": {reason: list(where) for reason, where in sorted(self.drops.examples.items())},
            "seconds": round(time.monotonic() - self.started, 3),
            "splits": {KEPT_SPLIT: kept} if kept["docs"] else {},
            # The keys decide de-duplication and the split at the finish: checked there like the shards.
            "keys_sha256": file_sha256(self.partial / KEPT_SPLIT / KEYS_NAME) if kept["docs"] else None,
        })
        write_json_atomic(self.partial / UNIT_NAME, record)
        replace_dir(self.partial, self.out)
        return record

    def abort(self) -> None:
        self.kept.abort()
        shutil.rmtree(self.partial, ignore_errors=True)


class TaskCut(NamedTuple):
    """What every task and the finishing step work out alike from the config and the inputs."""

    info: Any
    """The tokenizer (data/prepare.py's _load_tokenizer)."""
    root: Path
    """The data root."""
    plan: dict
    """Each domain's (files, inputs, fingerprint, finished record or None): data/prepare.py's _plan."""
    text: list[str]
    """The domains made from text (not registered Megatron data): the ones tasks share."""
    pieces: dict[str, list[dict]]
    """Each text domain's units, whole files or pieces of one (data/task_plan.py's task_units)."""
    starts: dict[str, list[int]]
    """Each text domain's first unit per task, and the end (data/task_plan.py's plan_cut)."""


def task_cut(cfg: DataPrepareConfig, tasks: int) -> TaskCut:
    """The checked config's tokenizer, root, plan and the cut of every text domain into `tasks` shares."""
    check_prepare_config(cfg)
    info = _load_tokenizer(cfg)
    root = Path(cfg.data.root)
    root.mkdir(parents=True, exist_ok=True)
    plan = _plan(cfg, root, info)
    text = [name for name, domain in cfg.data.domains.items() if not domain.megatron]
    pieces = {name: task_units(plan[name][1], tasks, cfg.data.domains[name].format) for name in text}
    return TaskCut(info, root, plan, text, pieces, plan_cut(root, tasks, pieces))


def run_task(cfg: DataPrepareConfig, index: int, tasks: int) -> dict[str, dict]:
    """Run task `index` of `tasks`: each text domain's share (skipping shares already done and unchanged, and
    domains whose finished output is up to date), then the completion marker. Returns the units by domain."""
    info, root, plan, text, pieces, starts = task_cut(cfg, tasks)
    folder = task_dir(root, index, tasks)
    label = f"task {index}/{tasks}"
    units, jobs = {}, []
    for name in text:
        record = plan[name][3]
        if record is not None:
            log.info("%s %s: the finished domain is up to date, skipped", label, name)
            continue
        mine = pieces[name][task_share(starts[name], index)]
        fingerprint = unit_fingerprint(domain_payload(cfg, name, info.sha256, PIPELINE_VERSION), index, tasks, mine)
        unit = None if cfg.force else finished_unit(folder / name, fingerprint)
        if unit is not None:
            log.info("%s %s: done before with the same inputs and config, skipped", label, name)
            units[name] = unit
        else:
            spans = [(item["start"], item["stop"]) if "start" in item else None for item in mine]
            jobs.append(DomainJob(name, cfg.data.domains[name], [Path(item["path"]) for item in mine], mine,
                                  fingerprint, spans=spans))
    shares = {name: f"{_units_word(pieces[name])} {starts[name][index]}..{starts[name][index + 1] - 1} of "
              f"{len(pieces[name])}" if starts[name][index + 1] > starts[name][index] else
              f"none of the {len(pieces[name])} {_units_word(pieces[name])}" for name in text}
    if jobs:
        (folder / DONE_NAME).unlink(missing_ok=True)  # from here on, this task is not complete
        folder.mkdir(parents=True, exist_ok=True)
        quiet = dataclasses.replace(cfg, progress=False)  # progress lines, not a bar: task logs are files

        def writer(job, where, config, tokenizer):
            return TaskDomainWriter(job, where, config, tokenizer, label, shares[job.name])

        pool = ChunkPool(cfg.workers, _encoder_path(info), cfg.encode_threads, info.eod_id, cfg.start_method)
        try:
            units.update(prepare_domains(jobs, pool, folder, quiet, info, writer))
        finally:
            pool.close()
            try:
                (folder / PARTIAL_DIR).rmdir()  # only when empty
            except OSError:
                pass
    folder.mkdir(parents=True, exist_ok=True)
    write_marker(folder, index, tasks, units)
    log.info("%s: complete (%s)", label, task_name(index, tasks))
    return units


def _units_word(units: list[dict]) -> str:
    return "pieces" if any("start" in item for item in units) else "files"


def run_local(overrides: list[str], tasks: int) -> list[int]:
    """Run tasks 0..N-1 as N processes on this machine at once (`ayumi data prepare ... --tasks N --task I`
    each), wait for all; returns the indices that failed. The caller finishes when none did."""
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONSAFEPATH": "1",
           "PYTHONPATH": repo + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    for name in [key for key in env if key.startswith(("SLURM_ARRAY", "PBS_ARRAY", "SGE_TASK"))] + ["AYUMI_TASK_OFFSET"]:
        env.pop(name, None)  # the children's indices are their --task flags alone
    children = [subprocess.Popen([sys.executable, "-m", "data.cli", "prepare", *overrides, f"--tasks={tasks}",
                                  f"--task={index}"], env=env) for index in range(tasks)]
    try:
        codes = [child.wait() for child in children]
    except BaseException:
        for child in children:
            child.wait()  # Ctrl-C reached them too: each cleans up after itself
        raise
    return [index for index, code in enumerate(codes) if code != 0]
