"""The run's whole plan: the curriculum's budgets, repetition and checkpoint disk, plus per-GPU memory.

The last stop of the data flow, so it may combine everything: the curriculum's plan (`curriculum.plan`, which
imports nothing of `pretrain`) with the memory model (`pretrain/plan/memory.py`). `run_plan` is the one place
that combines them; `ayumi plan`, `ayumi train` (before any rank starts), the trainer (at start, with the
job's real size and GPU) and `ayumi doctor` all call it, so they refuse the same runs with the same messages.
The GPUs come from `pretrain/plan/hardware.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from curriculum.plan import Plan, PlanProblem, format_plan, plan_from_config
from curriculum.plan import human_count as format_count
from pretrain.model.config import RopeScaling
from pretrain.plan.hardware import Hardware
from pretrain.plan.memory import (MemoryEstimate, MemoryShape, estimate_memory, format_memory, memory_problem,
                                  memory_shape)
from pretrain.stages import stage_rope
from pretrain.model.vocabulary import tokenizer_vocabulary, vocabulary_line


@dataclass
class StageRope:
    """The RoPE a part of the run trains with: the model's, or what a curriculum stage sets (pretrain/stages.py)."""

    label: str
    """"stage 2 'long_32k'", or "" for a run without stages."""
    theta: float
    scaling: RopeScaling
    set_by: str = ""
    """The field that set theta when a stage did (e.g. curriculum.stages.1.rope_theta); "" for the model's."""


@dataclass
class RunPlan:
    """The curriculum's plan plus the memory estimate; `problems` refuse the run."""

    plan: Plan
    memory: MemoryEstimate
    hardware: Hardware
    num_parameters: int = 0
    stage_memory: list[tuple[str, MemoryEstimate]] = field(default_factory=list)
    """(label, estimate) of each curriculum stage with its own seq_len (pretrain/stages.py): the same tokens per
    micro batch in fewer, longer samples; the run must fit in the largest."""
    rope: list[StageRope] = field(default_factory=list)
    """The RoPE of each stage (one entry without stages), as the trainer sets it when a stage begins."""
    attention: str = ""
    """model.attention: sdpa, eager or document."""
    max_seq_len: int = 0
    """model.max_seq_len: the positions the RoPE tables are built for."""
    vocabulary: str = ""
    """The model's vocabulary beside its tokenizer's (pretrain/model/vocabulary.py's vocabulary_line); "" = not shown."""

    @property
    def problems(self) -> list[PlanProblem]:
        return self.plan.problems


def run_plan(cfg: Any, num_parameters: int, hardware: Hardware, tokens_per_s: float | None = None,
             free_bytes: int | None = None, domains: Mapping[str, Any] | None = None,
             gqa_kernel: bool = True) -> RunPlan:
    """The curriculum plan of `cfg` plus its memory estimate on `hardware`; a run that cannot fit is a `memory` problem."""
    plan = plan_from_config(cfg, num_parameters, tokens_per_s=tokens_per_s, free_bytes=free_bytes, domains=domains)
    if problem := batch_problem(cfg, hardware):
        plan.problems.append(PlanProblem("batch", problem))
    memory = estimate_memory(memory_shape(cfg, hardware.data_parallel, gqa_kernel=gqa_kernel))
    stages = memory_by_stage(cfg, memory.shape)
    if hardware.gpu_bytes:
        for label, estimate in [("", memory), *stages]:
            problem = memory_problem(estimate, hardware.gpu_bytes, cfg.train.global_batch_size, hardware.where)
            if problem:
                plan.problems.append(PlanProblem("memory", f"{label}: {problem}" if label else problem))
                break
    return RunPlan(plan, memory, hardware, num_parameters, stages, rope_by_stage(cfg), cfg.model.attention,
                   cfg.model.max_seq_len, vocabulary_of(cfg))


def vocabulary_of(cfg: Any) -> str:
    """The plan's vocabulary line: model.vocab_size (already the tokenizer's when it was 0) and the tokenizer's ids,
    so a padded or hand-set vocabulary shows what it holds."""
    tokenizer = tokenizer_vocabulary(cfg.data.root, cfg.data.tokenizer_dir)
    return vocabulary_line(cfg.model.vocab_size, cfg.model.vocab_multiple, tokenizer)


def rope_by_stage(cfg: Any) -> list[StageRope]:
    """The RoPE in force in each curriculum stage (the model's alone without stages), for the plan to show."""
    curriculum = getattr(cfg, "curriculum", None)
    stages = list(curriculum.stages) if curriculum is not None else []
    if not stages:
        return [StageRope("", cfg.model.rope_theta, cfg.model.rope_scaling)]
    out = []
    for index, stage in enumerate(stages):
        try:
            theta, scaling = stage_rope(cfg.model, stages, index)
        except TypeError:  # a misnamed rope_scaling field: refused by check_config, nothing to show
            return []
        setter = max((i for i in range(index + 1) if stages[i].rope_theta), default=None)
        set_by = f"curriculum.stages.{setter}.rope_theta" if setter is not None else ""
        out.append(StageRope(f"stage {index + 1} {stage.name!r}", theta, scaling, set_by))
    return out


def format_rope(rope: StageRope) -> str:
    """`RoPE in stage 2 'long_32k': theta 8,000,000 (curriculum.stages.1.rope_theta), scaling llama3 x8 of 8192
    positions (low/high frequency factors 1/4)`."""
    theta = f"{int(rope.theta):,}" if rope.theta == int(rope.theta) else f"{rope.theta:g}"
    where = f" in {rope.label}" if rope.label else ""
    setter = f" ({rope.set_by})" if rope.set_by else ""
    return f"RoPE{where}: theta {theta}{setter}, scaling {format_scaling(rope.scaling)}"


def format_scaling(scaling: RopeScaling) -> str:
    """`none`, or the type, its factor, the length it stretches and the fields its type reads."""
    if scaling.type == "none":
        return "none"
    original = f"{scaling.original_max_seq_len} positions" if scaling.original_max_seq_len else "model.max_seq_len"
    text = f"{scaling.type} x{scaling.factor:g} of {original}"
    if scaling.type == "llama3":
        text += f" (low/high frequency factors {scaling.low_freq_factor:g}/{scaling.high_freq_factor:g})"
    elif scaling.type == "yarn":
        text += f" (beta fast/slow {scaling.beta_fast:g}/{scaling.beta_slow:g})"
    return text


def memory_by_stage(cfg: Any, shape: MemoryShape) -> list[tuple[str, MemoryEstimate]]:
    """The estimate of each curriculum stage whose seq_len is not train.seq_len: micro_batch x train.seq_len /
    seq_len samples of seq_len tokens (the loader's rule), everything else as the run's."""
    curriculum = getattr(cfg, "curriculum", None)
    out = []
    for index, stage in enumerate(curriculum.stages if curriculum is not None else []):
        length = int(stage.seq_len)
        if length and length != shape.seq_len:
            micro = max(1, shape.micro_batch * shape.seq_len // length)
            label = f"stage {index + 1} {stage.name!r} (seq_len {length}, micro batch {micro})"
            out.append((label, estimate_memory(replace(shape, seq_len=length, micro_batch=micro))))
    return out


def batch_problem(cfg: Any, hardware: Hardware) -> str | None:
    """Why the global batch cannot be split over the planned data-parallel ranks (None when it can): the same
    rule the ranks apply at start (pretrain.config.data_parallel_grad_accum), here against the GPUs planned."""
    from pretrain.config import ConfigError, data_parallel_grad_accum

    try:
        data_parallel_grad_accum(cfg.train, hardware.data_parallel)
    except ConfigError as err:
        return f"{err} (planned: {hardware.data_parallel} data-parallel rank(s), {hardware.where})"
    return None


def batch_line(run: RunPlan) -> str:
    """How the global batch splits over the GPUs: micro batch x grad accum x data-parallel ranks, each rank a
    tensor-parallel group of parallel.tensor GPUs (which all see the same samples)."""
    shape = run.memory.shape
    dp, tp, sp = shape.data_parallel, shape.tensor_parallel, shape.sequence_parallel
    groups = f" (tensor-parallel {tp} x data-parallel {dp})" if tp > 1 else ""
    if sp > 1:
        groups = f" (sequence-parallel {sp} x data-parallel {dp}: {shape.seq_len // sp} tokens of each sequence a rank)"
    return (f"batch: global {run.plan.run.global_batch} = micro {shape.micro_batch} x grad accum {shape.grad_accum} "
            f"x {dp} data-parallel rank(s), on {dp * tp * sp} {run.hardware.device}(s){groups}")


def format_run_plan(run: RunPlan) -> str:
    model = f"model: {run.num_parameters:,} parameters ({format_count(run.num_parameters)})"
    if run.attention:  # what each stage trains with besides its data (papercut 4 of issue 39: the plan showed neither)
        model += f", attention {run.attention}, max_seq_len {run.max_seq_len:,}"
    fp8 = run.memory.shape.model
    if fp8.fp8 != "off":  # the blocks' Linear layers in FP8 (pretrain/model/fp8.py); its casts are a memory term
        model += f", FP8 {fp8.fp8}" + (" (emulated: tests only)" if fp8.fp8_emulate else "")
    model += f"\n{run.vocabulary}" if run.vocabulary else ""
    model += "".join("\n" + format_rope(rope) for rope in run.rope)
    memory = model + "\n" + batch_line(run) + "\n" + format_memory(run.memory, run.hardware.gpu_bytes, run.hardware.where)
    for label, estimate in run.stage_memory:
        memory += (f"\n  {label}: peak allocated {estimate.peak_allocated / 2**30:.1f} GiB, required "
                   f"{estimate.required / 2**30:.1f} GiB")
    if not run.hardware.gpu_bytes and run.hardware.device == "GPU":
        memory += (f"\n  not checked: {run.hardware.where} (e.g. train.gpu_memory_gib=80 train.num_gpus=8 "
                   "to plan for 8 H100 80GB)")
    return format_plan(run.plan, sections=[memory])

