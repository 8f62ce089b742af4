"""What a curriculum stage changes in training beyond its data mixture: its sample length and its RoPE.

The short-to-long schedule of long-context training (pretrain at 4k-8k tokens, then a final stage at
32k-128k with a larger RoPE base) as curriculum stages, switched in-process:

- **Length.** A stage's `seq_len` is a multiple f of train.seq_len (the run's shortest). The global sample
  index keeps counting train.seq_len-token slots (curriculum/schedule.py), and the loader fills each
  micro-batch slot range with micro_batch / f samples of f times the length (pretrain/loader.py). Tokens
  per micro batch, grad accumulation and tokens per step stay what they were, and so do skips, rollbacks
  and resumes: they are positions in the same index. DeepSpeed never sees the change (its micro batch is
  a count of rows ayumi hands it, and its grad accumulation is unchanged); a compiled model recompiles
  once for the new shape.
- **RoPE.** A stage's `rope_theta` / `rope_scaling` hold from that stage on (until a later stage sets
  them again). The trainer retunes the model's RoPE tables when a step begins in another stage than the
  last (a rollback into an earlier stage retunes back) and records the RoPE in force in the model config
  of every checkpoint, so an export or an `ayumi eval` of a long-stage checkpoint computes what training did.

Validation keeps train.seq_len: the same samples before and after the switch, so the curve stays
comparable (a long stage that costs short-context quality shows there).
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any, Sequence

from curriculum.config import Stage
from curriculum.schedule import length_problem
from pretrain.model.config import ModelConfig, RopeScaling, scaling_problems


def stage_rope(model: ModelConfig, stages: Sequence[Stage], index: int) -> tuple[float, RopeScaling]:
    """(rope_theta, rope_scaling) in force during stage `index`: the last stage up to it that set each, else
    the model's."""
    theta, scaling = model.rope_theta, model.rope_scaling
    for stage in stages[:index + 1]:
        if stage.rope_theta:
            theta = float(stage.rope_theta)
        if stage.rope_scaling:
            scaling = RopeScaling(**dict(stage.rope_scaling))
    return theta, scaling


def model_in_stage(model: ModelConfig, stages: Sequence[Stage], index: int) -> ModelConfig:
    """The model config with the RoPE of stage `index`."""
    theta, scaling = stage_rope(model, stages, index)
    return replace(model, rope_theta=theta, rope_scaling=scaling)


def stage_problems(stages: Sequence[Stage], model: ModelConfig, seq_len: int, micro_batch: int) -> list[str]:
    """Each stage whose length or RoPE this run cannot train, one line naming the field and the fix."""
    problems = []
    for index, stage in enumerate(stages):
        where = f"curriculum.stages.{index}"
        length = int(stage.seq_len)
        if length:
            if problem := length_problem(index, length, seq_len):
                problems.append(problem)
            elif micro_batch % (length // seq_len):
                problems.append(f"{where}.seq_len={length} is {length // seq_len} x train.seq_len, so "
                                f"train.micro_batch_size={micro_batch} must be a multiple of {length // seq_len} (a "
                                "micro batch keeps its tokens: micro_batch_size x train.seq_len / seq_len samples)")
            if length > model.max_seq_len:
                problems.append(too_long(stages, model, index, length))
        if stage.rope_scaling:
            try:
                scaling = RopeScaling(**dict(stage.rope_scaling))
            except TypeError as err:
                problems.append(f"{where}.rope_scaling: {err} (its fields are model.rope_scaling's)")
                continue
            problems += scaling_problems(scaling, f"{where}.rope_scaling.")
    return problems


def too_long(stages: Sequence[Stage], model: ModelConfig, index: int, length: int) -> str:
    """Stage `index` is longer than the model's positions: raise them, and where the stage trains the model's own
    unscaled RoPE (a Llama 3 base at 8k, unlike Llama 3.1's scaling for 128k), give it one for the length too."""
    where = f"curriculum.stages.{index}"
    fix = f"raise model.max_seq_len (model.max_seq_len={length})"
    try:
        theta, scaling = stage_rope(model, stages, index)
    except TypeError:  # a stage's rope_scaling with a field RoPE has not: said on its own line (stage_problems)
        return f"{where}.seq_len={length} exceeds model.max_seq_len={model.max_seq_len}; {fix}"
    if theta == model.rope_theta and scaling.type == "none":
        fix += f" and give the stage a RoPE for that length ({where}.rope_theta or rope_scaling)"
    return f"{where}.seq_len={length} exceeds model.max_seq_len={model.max_seq_len}; {fix}"


def rope_fields(model: ModelConfig) -> dict[str, Any]:
    """The RoPE fields of a model config, as a checkpoint's record holds them."""
    return {"rope_theta": model.rope_theta, "rope_scaling": asdict(model.rope_scaling)}
