"""`ayumi plan`: stage budgets x prepared data x checkpoint disk, checked before anything runs.

A plan answers, for a run as configured: how many tokens each stage takes from each domain, how
many times each domain is read by each stage's end (against its max_repetition; a run without a
curriculum is one stage, every domain read alike, against curriculum.default_max_repetition), how
many steps the run has and how many tokens each step trains, how many checkpoints it saves and how
much disk they need against what is free, and (given a throughput) how long it takes. `check_plan` returns
the reasons to refuse; the CLI exits 1 on any, and the trainer runs the same checks at start.

Checkpoint size, bytes per parameter as DeepSpeed 0.19 writes them (measured on every stage): 8 of
fp32 Adam moments, plus the weights: stage 0 saves the module (2 in bf16/fp16 with a 4-byte fp32
master copy, 4 in fp32): 14 / 12; stages 1-2 save the module and the fp32 partition even in fp32:
14 / 16; stage 3 saves only the fp32 partition: 12. `auto` precision is planned as bf16, as the
memory plan does (planned_precision). Peak disk is (keep_last + 1) checkpoints, because a new one is
complete before the oldest is deleted, plus the stability machinery's recovery ring (ring_keep
newest + the rollback target + the one being written); the checkpoints already in the directory (a
resumed run) count as part of that peak. `checkpoint_disk` is the one place this is counted: `ayumi
plan`, the launcher's and the trainer's plan and `ayumi doctor` all print its figures, and DISK_RULE
says it in words for the help and the docs.

Nothing here imports `pretrain`: callers pass the parameter count and the run's numbers.
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from curriculum.config import CurriculumConfig, CurriculumError, config_problems, domains_used, enabled, max_repetition
from curriculum.declared import register_curriculum_domains
from curriculum.mixer import open_streams
from curriculum.mixture import MixtureSchedule, stage_stream
from curriculum.repetition import repetition_problems, shuffled_epochs, shuffled_repetition_problems
from data.domains import open_run_data
from data.manifest import ManifestError
from data.packed import PackedSamples
from data.shards import ShardFormatError, TokenizerMismatchError
from tokenizer.info import TokenizerNotFoundError

DATA_ERRORS = (ShardFormatError, ManifestError, TokenizerMismatchError, TokenizerNotFoundError)
"""What reading (or registering) a run's data can raise: each names the file or key and the fix."""

BYTES_PER_PARAM = {  # (ZeRO stage, precision) -> checkpoint bytes per parameter (module doc)
    **{(0, p): 2 + 4 + 8 for p in ("bf16", "fp16")}, (0, "fp32"): 4 + 8,
    **{(stage, p): 2 + 4 + 8 for stage in (1, 2) for p in ("bf16", "fp16")}, (1, "fp32"): 4 + 4 + 8, (2, "fp32"): 4 + 4 + 8,
    **{(3, p): 4 + 8 for p in ("bf16", "fp16", "fp32")},
}

PLANNED_AUTO_PRECISION = "bf16"
"""What every plan (disk and memory) counts deepspeed.precision=auto as: see planned_precision."""

DISK_RULE = ("one checkpoint is the parameters times the bytes per parameter DeepSpeed saves at the run's ZeRO stage "
             "and precision (curriculum/plan.py bytes_per_parameter; precision=auto counted as bf16); at the peak "
             "min(saves, checkpoint.keep_last + 1) of them are on disk (every save with keep_last=0), plus up to "
             "stability.recovery.ring_keep + 2 in the recovery ring, less what checkpoint.dir already holds")
"""checkpoint_disk's rule in words: what `ayumi doctor --help` and docs/multinode.md say (tested verbatim)."""


class PlanRefused(RuntimeError):
    """The plan has problems; the message lists each with its fix."""


@dataclass
class PlanProblem:
    """One reason to refuse a plan."""

    kind: str
    """config | data | budget | repetition | disk | batch, memory (added by pretrain.plan.run_plan)."""
    message: str
    """What is wrong and how to fix it."""


@dataclass
class RunShape:
    """The run's length and batch geometry (train.* in the training config)."""

    train_tokens: int
    """train.tokens: the run length."""
    seq_len: int
    """train.seq_len."""
    global_batch: int
    """train.global_batch_size (samples per optimizer step)."""
    max_steps: int = 0
    """train.max_steps (a smoke-test cap; a warning when it cuts the run short)."""

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def total_steps(self) -> int:
        return math.ceil(self.train_tokens / self.tokens_per_step)

    @property
    def total_samples(self) -> int:
        """Samples the run consumes (the last step may overshoot train.tokens by less than a step)."""
        return self.total_steps * self.global_batch


@dataclass
class CheckpointShape:
    """What the run's checkpoints cost (checkpoint.* and the model size)."""

    num_parameters: int
    """Trainable parameters (pretrain.model.flops.count_parameters)."""
    precision: str = "bf16"
    """deepspeed.precision: auto | bf16 | fp16 | fp32 (auto counts as bf16: planned_precision)."""
    zero_stage: int = 1
    """deepspeed.zero_stage: what DeepSpeed saves depends on it (module doc)."""
    interval: int = 0
    """checkpoint.interval (0 = only at the end and on signals)."""
    keep_last: int = 3
    """checkpoint.keep_last (<= 0 keeps every checkpoint)."""
    save_final: bool = True
    """checkpoint.save_final."""
    dir: str = "."
    """checkpoint.dir."""
    ring_interval: int = 0
    """stability.recovery.ring_interval (0 or stability off: no recovery ring)."""
    ring_keep: int = 0
    """stability.recovery.ring_keep."""
    save_initial: bool = False
    """checkpoint.save_initial (one more save, at step 0)."""

    @property
    def size(self) -> int:
        """Bytes of one of these checkpoints (checkpoint_size)."""
        return checkpoint_size(self.num_parameters, self.precision, self.zero_stage)


@dataclass
class DomainRow:
    """One stage x domain line of the plan."""

    stage: int
    domain: str
    weight: float
    """Normalised weight in the stage."""
    tokens: int
    """Tokens this stage trains on from the domain."""
    available_tokens: int
    """Tokens of the domain's train shards."""
    epochs: float
    """Cumulative times the domain has been read by the end of this stage."""
    max_epochs: float
    """The stage's max_repetition for the domain (without a curriculum: curriculum.default_max_repetition)."""

    @property
    def ok(self) -> bool:
        return self.epochs <= self.max_epochs


@dataclass
class StageRow:
    name: str
    tokens: int
    first_sample: int
    end_sample: int
    steps: float
    """Optimizer steps the stage spans (fractional: a boundary may fall inside a step)."""
    seq_len: int = 0
    """Tokens per sample in the stage (its own seq_len, else train.seq_len)."""


@dataclass
class Plan:
    """Everything `ayumi plan` prints, and the problems that refuse the run."""

    curriculum: str
    run: RunShape
    stages: list[StageRow] = field(default_factory=list)
    domains: list[DomainRow] = field(default_factory=list)
    disk: CheckpointDisk | None = None
    """The checkpoints' disk at the peak (None: no checkpoint shape was given)."""
    wall_time_s: float | None = None
    problems: list[PlanProblem] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


# -- data --------------------------------------------------------------------------------------------
def available_samples(data_root: str | os.PathLike, seq_len: int) -> tuple[dict[str, int], dict[str, int]]:
    """(tokens, samples) per domain of DATA_ROOT's manifest, counted from the shard indices (sizes checked, no checksums)."""
    _, train, _ = open_run_data(data_root, None, seq_len, verify="sizes", validation=False)
    return sizes_of(train)


def sizes_of(samples: Mapping[str, PackedSamples]) -> tuple[dict[str, int], dict[str, int]]:
    """(tokens, samples) of each opened domain or stream, by name."""
    return ({name: s.num_tokens for name, s in samples.items()}, {name: len(s) for name, s in samples.items()})


SHUFFLED = "none (all domains shuffled)"
"""The plan's name for a run without a curriculum (data.packed.ShuffledDomains)."""


# -- checkpoints -------------------------------------------------------------------------------------
def checkpoint_count(total_steps: int, interval: int, save_final: bool, save_initial: bool = False) -> int:
    """Saves in a full run: every `interval` steps before the end, plus the final one (and one at step 0)."""
    periodic = (total_steps - 1) // interval if interval > 0 else 0
    return periodic + (1 if save_final else 0) + (1 if save_initial else 0)


def planned_precision(precision: str) -> str:
    """The precision a plan counts: deepspeed.precision as given, `auto` as bf16.

    auto trains bf16 on a GPU with bf16 (every one since Ampere; pretrain/engine/precision.py), and a plan is
    made for the GPUs the run is meant for, often away from them (a login node), so the disk and the memory
    plan both count bf16. Where auto resolves otherwise (fp16 on an older GPU, fp32 on a CPU without a fast bf16
    matmul) the trainer checks each save against the size of the precision it really trains in; pin
    deepspeed.precision to plan for that precision.
    """
    return PLANNED_AUTO_PRECISION if precision == "auto" else precision


def bytes_per_parameter(precision: str, zero_stage: int = 1) -> int:
    """Checkpoint bytes per parameter at this ZeRO stage and precision (module doc; auto: planned_precision)."""
    return BYTES_PER_PARAM[(zero_stage, planned_precision(precision))]


def checkpoint_size(num_parameters: int, precision: str, zero_stage: int = 1) -> int:
    """Bytes of one checkpoint (module doc)."""
    return num_parameters * bytes_per_parameter(precision, zero_stage)


def ring_checkpoints_at_peak(total_steps: int, ckpt: CheckpointShape) -> int:
    """Recovery-ring checkpoints on disk at once at most: the ring_keep newest, the rollback target
    kept beside them, and the new one written before older ones go (pretrain.stability.policy)."""
    if ckpt.ring_interval <= 0:
        return 0
    return min(ckpt.ring_keep + 2, total_steps // ckpt.ring_interval)


def checkpoints_at_peak(total_steps: int, ckpt: CheckpointShape) -> tuple[int, int]:
    """(regular, recovery-ring) checkpoints on disk at the peak of a full run."""
    saves = checkpoint_count(total_steps, ckpt.interval, ckpt.save_final, ckpt.save_initial)
    regular = saves if ckpt.keep_last <= 0 else min(saves, ckpt.keep_last + 1)
    return regular, ring_checkpoints_at_peak(total_steps, ckpt)


@dataclass
class CheckpointDisk:
    """The disk a run's checkpoints take at their peak (checkpoint_disk): the figures `ayumi plan` and `ayumi
    doctor` print and refuse on."""

    saves: int
    """Checkpoints saved over a full run (checkpoint_count)."""
    regular: int
    """Of them, on disk at once at the peak (keep_last + 1, or every save with keep_last <= 0)."""
    ring: int
    """Recovery-ring checkpoints on disk at the peak."""
    each: int
    """Bytes of one checkpoint (checkpoint_size)."""
    existing: int
    """Bytes already under checkpoint.dir (a resumed run's checkpoints are part of the peak)."""
    free: int
    """Free bytes on the disk that holds checkpoint.dir."""
    where: Path
    """checkpoint.dir or its nearest existing ancestor: where the free disk is measured."""
    dir: str
    """checkpoint.dir as configured."""
    keep_last: int = 3
    """checkpoint.keep_last, for messages."""

    @property
    def on_disk(self) -> int:
        return self.regular + self.ring

    @property
    def needed(self) -> int:
        """Bytes still to find at the peak."""
        return max(0, self.on_disk * self.each - self.existing)


def checkpoint_disk(total_steps: int, ckpt: CheckpointShape, free_bytes: int | None = None) -> CheckpointDisk:
    """The checkpoints' disk at the peak of a full run (DISK_RULE); `free_bytes` replaces the measured free disk."""
    regular, ring = checkpoints_at_peak(total_steps, ckpt)
    where = existing_parent(ckpt.dir)
    free = free_bytes if free_bytes is not None else shutil.disk_usage(where).free
    saves = checkpoint_count(total_steps, ckpt.interval, ckpt.save_final, ckpt.save_initial)
    return CheckpointDisk(saves, regular, ring, ckpt.size, directory_bytes(ckpt.dir), free, where, str(ckpt.dir),
                          ckpt.keep_last)


def disk_summary(disk: CheckpointDisk) -> str:
    """One line of the figures: saves, size, what is still needed at the peak, what is free."""
    ring = f" (+ up to {disk.ring} in the recovery ring)" if disk.ring else ""
    existing = f" ({human_bytes(disk.existing)} already there)" if disk.existing else ""
    return (f"{disk.saves} saves{ring} x {human_bytes(disk.each)} each; {human_bytes(disk.needed)} more needed at "
            f"peak, {human_bytes(disk.free)} free at {disk.dir}{existing}")


def disk_problem(disk: CheckpointDisk) -> str | None:
    """Why the checkpoints do not fit, with the fixes; None when they do."""
    if disk.needed <= disk.free:
        return None
    ring = f" and {disk.ring} recovery-ring checkpoints" if disk.ring else ""
    return (f"checkpoints need {human_bytes(disk.needed)} more on {disk.where} ({disk.on_disk} x "
            f"{human_bytes(disk.each)} at peak with checkpoint.keep_last={disk.keep_last}{ring}) but only "
            f"{human_bytes(disk.free)} is free; free space, lower checkpoint.keep_last"
            + (" or stability.recovery.ring_keep" if disk.ring else "") + ", or point checkpoint.dir at a larger disk")


def existing_parent(path: str | os.PathLike) -> Path:
    """The path itself or its nearest existing ancestor (where the checkpoints' disk is measured)."""
    path = Path(path).expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def directory_bytes(path: str | os.PathLike) -> int:
    path = Path(path)
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


# -- the plan ----------------------------------------------------------------------------------------
def make_plan(curriculum: CurriculumConfig | None, run: RunShape, domain_tokens: Mapping[str, int] | None,
              domain_samples: Mapping[str, int] | None, checkpoint: CheckpointShape | None = None,
              tokens_per_s: float | None = None, free_bytes: int | None = None) -> Plan:
    """Compute the plan and its problems.

    `domain_samples` None means the data is not there to count (then no per-domain rows); a
    `free_bytes` given replaces the measured free disk (tests).
    """
    explicit = enabled(curriculum)
    # Without stages the config still carries the limit, default_max_repetition (None: the field's default, 4).
    cfg = curriculum if curriculum is not None else CurriculumConfig()
    plan = Plan(curriculum=cfg.name if explicit else SHUFFLED, run=run)
    known = None if domain_samples is None else list(domain_samples)
    problems = config_problems(cfg, run.train_tokens if explicit else None, known_domains=known)
    plan.problems += [PlanProblem("budget" if "train.tokens" in p else "config", p) for p in problems]
    if run.max_steps and run.max_steps < run.total_steps:
        plan.warnings.append(f"train.max_steps={run.max_steps} stops the run at step {run.max_steps} of {run.total_steps}, "
                             f"before the planned {run.train_tokens:,} tokens (use it only for smoke tests)")
    shuffled = {name: n for name, n in (domain_samples or {}).items() if n > 0}
    if domain_samples is not None and not explicit and not shuffled:
        plan.problems.append(PlanProblem("data", "no domain holds a complete training sample: run `ayumi data prepare`"))
    if explicit and not plan.problems:
        _fill_stage_rows(plan, cfg, run, domain_tokens, domain_samples)
    elif shuffled and not plan.problems:
        _fill_shuffled_rows(plan, cfg.default_max_repetition, run, domain_tokens, shuffled)
    if checkpoint is not None:
        _fill_checkpoints(plan, run, checkpoint, free_bytes)
    if tokens_per_s:
        plan.wall_time_s = run.total_samples * run.seq_len / tokens_per_s
    return plan


def _fill_stage_rows(plan: Plan, cfg: CurriculumConfig, run: RunShape, domain_tokens: Mapping[str, int] | None,
                     domain_samples: Mapping[str, int] | None) -> None:
    """Stage rows always; stage x domain rows and the repetition check when the data could be counted."""
    names = domains_used(cfg)
    try:
        schedule = MixtureSchedule(cfg, run.seq_len, names, run.global_batch)
    except CurriculumError as err:
        plan.problems.append(PlanProblem("config", str(err)))
        return
    for index, stage in enumerate(cfg.stages):
        first = schedule.starts[index]
        end = schedule.ends[index] if index + 1 < len(cfg.stages) else max(run.total_samples, first)
        plan.stages.append(StageRow(stage.name, stage.tokens, first, end, (end - first) / run.global_batch,
                                    schedule.stage_seq_lens[index]))
    if domain_samples is None:
        return
    # Counted per stream: a domain at a stage's own seq_len or document filter is a stream of its own.
    empty = [name for name in schedule.stream_names if domain_samples.get(name, 0) == 0]
    if empty:
        plan.problems.append(PlanProblem("data", f"{', '.join(empty)} hold(s) no complete sample (of seq_len + 1 "
                                                 "tokens, from the documents admitted): prepare data for them or "
                                                 "drop them"))
        return
    picks = schedule.stage_picks(run.total_samples)
    cumulative = picks.cumsum(axis=0)
    for index, stage in enumerate(cfg.stages):
        total_weight = sum(w for w in stage.weights.values() if w > 0)
        for name in names:
            weight = stage.weights.get(name, 0.0)
            if weight <= 0:
                continue
            stream = stage_stream(stage, name, run.seq_len)
            d = schedule.streams.index(stream)
            plan.domains.append(DomainRow(
                stage=index, domain=stream.name, weight=weight / total_weight,
                tokens=int(picks[index, d]) * stream.seq_len,
                available_tokens=int((domain_tokens or {}).get(stream.name, 0)),
                epochs=int(cumulative[index, d]) / domain_samples[stream.name],
                max_epochs=max_repetition(cfg, stage, name),
            ))
    plan.problems += [PlanProblem("repetition", p)
                      for p in repetition_problems(cfg, schedule, domain_samples, run.total_samples, run.global_batch)]


def _fill_shuffled_rows(plan: Plan, limit: float, run: RunShape, domain_tokens: Mapping[str, int] | None,
                        domain_samples: Mapping[str, int]) -> None:
    """The run without a curriculum: one stage, every domain read alike, each against `limit` epochs."""
    plan.stages.append(StageRow("all", run.train_tokens, 0, run.total_samples, float(run.total_steps)))
    total = sum(domain_samples.values())
    epochs = shuffled_epochs(run.total_samples, domain_samples)
    for name, count in domain_samples.items():
        plan.domains.append(DomainRow(
            stage=0, domain=name, weight=count / total, tokens=round(epochs * count) * run.seq_len,
            available_tokens=int((domain_tokens or {}).get(name, 0)), epochs=epochs, max_epochs=limit,
        ))
    plan.problems += [PlanProblem("repetition", p) for p in shuffled_repetition_problems(
        limit, domain_samples, run.total_samples, run.global_batch, run.seq_len)]


def _fill_checkpoints(plan: Plan, run: RunShape, ckpt: CheckpointShape, free_bytes: int | None) -> None:
    plan.disk = checkpoint_disk(run.total_steps, ckpt, free_bytes)
    if problem := disk_problem(plan.disk):
        plan.problems.append(PlanProblem("disk", problem))


def check_plan(*args, **kwargs) -> list[PlanProblem]:
    """The problems of `make_plan(*args, **kwargs)` (empty: the run can start)."""
    return make_plan(*args, **kwargs).problems


def raise_if_refused(plan: Plan) -> None:
    """Raise PlanRefused listing every problem (the trainer's start-up check)."""
    if plan.problems:
        raise PlanRefused("the run plan is impossible:\n  " + "\n  ".join(f"[{p.kind}] {p.message}" for p in plan.problems))


def checkpoint_shape(cfg: Any, num_parameters: int) -> CheckpointShape:
    """What a composed training config's checkpoints cost (read by attribute; no pretrain import)."""
    ckpt, stability = cfg.checkpoint, getattr(cfg, "stability", None)
    ring = stability is not None and stability.enabled and stability.recovery.ring_interval > 0
    return CheckpointShape(num_parameters, cfg.deepspeed.precision, cfg.deepspeed.zero_stage, ckpt.interval,
                           ckpt.keep_last, ckpt.save_final, ckpt.dir,
                           stability.recovery.ring_interval if ring else 0, stability.recovery.ring_keep if ring else 0,
                           getattr(ckpt, "save_initial", False))


def plan_from_config(cfg: Any, num_parameters: int, tokens_per_s: float | None = None,
                     free_bytes: int | None = None, domains: Mapping[str, PackedSamples] | None = None) -> Plan:
    """The plan of a composed training config (an `AyumiConfig`, read by attribute; no pretrain import).

    Reads `curriculum` (absent or without stages: no curriculum), `train`, `checkpoint`, `data.root`,
    `deepspeed.precision` and `.zero_stage`, and `stability.recovery` (the ring). The trainer passes the train
    `domains` it has already opened (with the curriculum's streams, `curriculum.mixer.open_streams`); without them
    the curriculum's own domains are registered (curriculum/declared.py) and the shards under data.root counted.
    A missing data root is a `data` problem, not an exception.
    """
    curriculum = getattr(cfg, "curriculum", None)
    train = cfg.train
    run = RunShape(train.tokens, train.seq_len, train.global_batch_size, getattr(train, "max_steps", 0))
    shape = checkpoint_shape(cfg, num_parameters)
    if domains is not None:
        tokens, counts = sizes_of(domains)
    else:
        try:
            register_curriculum_domains(cfg)
            tokens, counts = available_samples(cfg.data.root, train.seq_len)
            if enabled(curriculum):  # the streams of stages with their own seq_len or document filter too
                stream_tokens, stream_counts = sizes_of(open_streams(curriculum, cfg.data.root, train.seq_len))
                tokens, counts = {**tokens, **stream_tokens}, {**counts, **stream_counts}
        except CurriculumError:  # a misdeclared domain of the curriculum: make_plan lists it with the config problems
            return make_plan(curriculum, run, None, None, shape, tokens_per_s, free_bytes)
        except DATA_ERRORS as err:
            plan = make_plan(curriculum, run, None, None, shape, tokens_per_s, free_bytes)
            plan.problems.insert(0, PlanProblem("data", f"{err} (per-domain availability and repetition are unchecked)"))
            return plan
    if not enabled(curriculum) and getattr(cfg.data, "domains", None):
        counts = {name: n for name, n in counts.items() if name in cfg.data.domains}
    return make_plan(curriculum, run, tokens, counts, shape, tokens_per_s, free_bytes)


# -- printing ----------------------------------------------------------------------------------------
def human_count(n: float) -> str:
    """1234567 -> '1.23M' (tokens, tokens/s, samples); also the console's and the report's format."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def human_duration(seconds: float) -> str:
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    return f"{days}d {hours}h {rest // 60}m" if days else f"{hours}h {rest // 60}m {rest % 60}s"


def _limit(epochs: float) -> str:
    return "-" if math.isinf(epochs) else f"{epochs:g}x"


def format_plan(plan: Plan, sections: list[str] = ()) -> str:
    """The human-readable plan: header, stage x domain table, totals, checkpoints, the callers' `sections`
    (pretrain.plan.run_plan's memory breakdown), problems."""
    run = plan.run
    lines = [f"plan: curriculum {plan.curriculum!r}: {human_count(run.train_tokens)} tokens, seq_len {run.seq_len}, "
             f"global batch {run.global_batch} = {human_count(run.tokens_per_step)} tokens/step, "
             f"{run.total_steps:,} steps ({human_count(run.total_samples * run.seq_len)} tokens trained)", ""]
    if plan.stages:
        header = f"{'stage':<22} {'domain':<16} {'weight':>7} {'requested':>10} {'available':>10} {'epochs':>7} {'max':>6}  status"
        lines += [header, "-" * len(header)]
        for index, stage in enumerate(plan.stages):
            length = f", seq_len {stage.seq_len}" if stage.seq_len and stage.seq_len != run.seq_len else ""
            lines.append(f"{index + 1} {stage.name:<20} {'':<16} {'':>7} {human_count(stage.tokens):>10} "
                         f"{'':>10} {'':>7} {'':>6}  {stage.steps:,.1f} steps, samples [{stage.first_sample:,}, "
                         f"{stage.end_sample:,}){length}")
            for row in (r for r in plan.domains if r.stage == index):
                lines.append(f"{'':<22} {row.domain:<16} {row.weight:>7.3f} {human_count(row.tokens):>10} "
                             f"{human_count(row.available_tokens):>10} {row.epochs:>6.2f}x {_limit(row.max_epochs):>6}  "
                             f"{'ok' if row.ok else 'OVER'}")
        lines.append("")
    if plan.disk is not None and plan.disk.each:
        lines.append(f"checkpoints: {disk_summary(plan.disk)}")
    if plan.wall_time_s is not None:
        lines.append(f"estimated wall time: {human_duration(plan.wall_time_s)} at the given throughput")
    lines += list(sections)
    lines += [f"warning: {w}" for w in plan.warnings]
    if plan.problems:
        lines += ["", "REFUSED:"] + [f"  [{p.kind}] {p.message}" for p in plan.problems]
    else:
        lines.append("plan ok")
    return "\n".join(lines)
