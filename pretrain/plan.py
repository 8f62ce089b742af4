"""`ayumi plan [--tokens-per-s N] [--free-bytes N] [--cfg job] key=value ...`: the run's whole plan, exit 1 if refused.

The last stop of the data flow, so it may combine everything: the curriculum's budgets, repetition and
checkpoint disk (`curriculum.plan`, which imports nothing of `pretrain`) with the per-GPU memory model
beside the engine (`pretrain.memory`). `run_plan` is the one place that combines them; `ayumi plan`,
`ayumi train` (before any rank starts), the trainer (at start, with the job's real size and GPU) and
`ayumi doctor` all call it, so they refuse the same runs with the same messages.

Where the GPUs come from: the ones visible here (their count and memory, via torch), else
`train.num_gpus` and `train.gpu_memory_gib` (a plan made on a login node for the cluster's GPUs).
Without either, memory is estimated but not checked.

Exit codes: 0 plan ok, 1 plan refused (reasons printed), 2 invalid configuration or arguments.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Mapping

from common.conf import asks_for_help
from curriculum.plan import Plan, PlanProblem, format_plan, plan_from_config
from pretrain.memory import MemoryEstimate, estimate_memory, format_memory, memory_problem, memory_shape

USAGE = """usage: ayumi plan [--tokens-per-s N] [--free-bytes N] [--cfg job] [key=value ...]

Prints the stage x domain table (tokens requested and available, epochs vs max_repetition), steps,
tokens/step, checkpoint count and disk need vs free space, the wall time when --tokens-per-s (the
whole run's training throughput) is given, and the per-GPU memory breakdown (parameters, gradients,
optimizer states, activations, loss, allowances) against the GPUs visible here or train.gpu_memory_gib
with train.num_gpus. Exits 1 when the plan is impossible (data, budgets, repetition, disk, memory).
  e.g. ayumi plan experiment=ja_en_4stage --tokens-per-s 4e5
       ayumi plan experiment=llama_1b_example train.num_gpus=8 train.gpu_memory_gib=80"""

GIB = 2**30


@dataclass
class Hardware:
    """The GPUs a plan is checked against."""

    data_parallel: int
    """Data-parallel ranks (ZeRO divides states by it): GPUs / tensor_parallel."""
    gpu_bytes: int | None
    """Memory of one GPU; None: not known, memory is estimated but not checked."""
    where: str
    """Where the figures come from, for messages."""
    tensor_parallel: int = 1
    """GPUs per tensor-parallel group (parallel.tensor)."""


@dataclass
class RunPlan:
    """The curriculum's plan plus the memory estimate; `problems` refuse the run."""

    plan: Plan
    memory: MemoryEstimate
    hardware: Hardware

    @property
    def problems(self) -> list[PlanProblem]:
        return self.plan.problems


def visible_gpus() -> tuple[int, int | None, str]:
    """(count, bytes of GPU 0, its name) of the GPUs torch sees here; torch is imported only where an
    NVIDIA device exists (pretrain.launch.gpu_count)."""
    from pretrain.launch import gpu_count

    count = gpu_count()
    if not count:
        return 0, None, ""
    import torch

    props = torch.cuda.get_device_properties(0)
    return count, int(props.total_memory), props.name


def planned_hardware(cfg: Any, ranks: int | None = None) -> Hardware:
    """The GPUs to check against: those visible here (count and memory), else train.num_gpus and
    train.gpu_memory_gib; `ranks` when the caller knows the job's size. The data-parallel size is the GPUs
    over parallel.tensor (at least one tensor-parallel group is planned for)."""
    count, gpu_bytes, gpu_name = visible_gpus()
    tp = cfg.parallel.tensor
    data_parallel = max(1, (ranks or cfg.train.num_gpus or count or 1) // tp)
    if gpu_bytes:
        return Hardware(data_parallel, gpu_bytes, f"this {gpu_name or 'GPU'}", tp)
    if cfg.train.gpu_memory_gib > 0:
        return Hardware(data_parallel, int(cfg.train.gpu_memory_gib * GIB),
                        f"each GPU (train.gpu_memory_gib={cfg.train.gpu_memory_gib:g})", tp)
    return Hardware(data_parallel, None, "no GPU visible and train.gpu_memory_gib unset", tp)


def run_plan(cfg: Any, num_parameters: int, hardware: Hardware, tokens_per_s: float | None = None,
             free_bytes: int | None = None, domains: Mapping[str, Any] | None = None,
             gqa_kernel: bool = True) -> RunPlan:
    """The curriculum plan of `cfg` plus its memory estimate on `hardware`; a run that cannot fit is a `memory` problem."""
    plan = plan_from_config(cfg, num_parameters, tokens_per_s=tokens_per_s, free_bytes=free_bytes, domains=domains)
    memory = estimate_memory(memory_shape(cfg, hardware.data_parallel, gqa_kernel=gqa_kernel))
    if hardware.gpu_bytes:
        problem = memory_problem(memory, hardware.gpu_bytes, cfg.train.global_batch_size, hardware.where)
        if problem:
            plan.problems.append(PlanProblem("memory", problem))
    return RunPlan(plan, memory, hardware)


def batch_line(run: RunPlan) -> str:
    """How the global batch splits over the GPUs: micro batch x grad accum x data-parallel ranks, each rank a
    tensor-parallel group of parallel.tensor GPUs (which all see the same samples)."""
    shape = run.memory.shape
    dp, tp = shape.data_parallel, shape.tensor_parallel
    groups = f" (tensor-parallel {tp} x data-parallel {dp})" if tp > 1 else ""
    return (f"batch: global {run.plan.run.global_batch} = micro {shape.micro_batch} x grad accum {shape.grad_accum} "
            f"x {dp} data-parallel rank(s), on {dp * tp} GPU(s){groups}")


def format_run_plan(run: RunPlan) -> str:
    memory = batch_line(run) + "\n" + format_memory(run.memory, run.hardware.gpu_bytes, run.hardware.where)
    if not run.hardware.gpu_bytes:
        memory += (f"\n  not checked: {run.hardware.where} (e.g. train.gpu_memory_gib=80 train.num_gpus=8 "
                   "to plan for 8 H100 80GB)")
    return format_plan(run.plan, sections=[memory])


def parse_args(argv: list[str]) -> tuple[list[str], dict[str, float]]:
    """(Hydra overrides incl. --cfg, numeric options); ValueError on a bad option."""
    overrides: list[str] = []
    options: dict[str, float] = {}
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in ("--tokens-per-s", "--free-bytes"):
            value = value if eq else next(args, "")
            try:
                options[name[2:].replace("-", "_")] = float(value)
            except ValueError:
                raise ValueError(f"{name} takes a number, got {value!r}") from None
        else:
            overrides.append(arg)
    return overrides, options


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if asks_for_help(argv):
        from pretrain.config import training_config_help  # light: hydra and dataclasses, no torch

        print(f"{USAGE}\n\n{training_config_help()}")
        return 0
    from pretrain.config import config_from_args, print_config_error
    from pretrain.model.flops import count_parameters

    try:
        rest, options = parse_args(argv)
        cfg = config_from_args(rest)  # the same checks as `ayumi train`: ranges, names, model shapes
    except ValueError as err:  # a bad option, or a ConfigError (a ValueError too)
        print_config_error("ayumi plan", err)
        return 2
    if cfg is None:  # --cfg job printed the resolved config
        return 0
    free = options.get("free_bytes")
    run = run_plan(cfg, count_parameters(cfg.model), planned_hardware(cfg), tokens_per_s=options.get("tokens_per_s"),
                   free_bytes=int(free) if free is not None else None)
    print(format_run_plan(run))
    if run.problems:
        print(f"ayumi plan: refused ({len(run.problems)} problem(s), listed above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
