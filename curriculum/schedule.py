"""Where stages begin and end, which stage a token or sample is in, and the per-stage LR hook: pure functions.

Stage boundaries are in tokens. Sample g (global stream index) covers tokens [g*L, (g+1)*L) of the
run (L = seq_len), and belongs to the stage in effect at its first token: stage i holds the samples
with cum[i-1] <= g*L < cum[i], where cum[i] is the sum of the budgets of stages 0..i. So stage i is
samples [ceil(cum[i-1] / L), ceil(cum[i] / L)): a budget that is not a multiple of L is rounded up
to whole samples, never more than one sample (L tokens) per boundary. The boundary does not wait
for a step: a step whose global batch straddles it trains on both stages' samples.

Past the last budget (the final step overshooting train.tokens, or skipped batches extending the
run) the last stage continues with the same mixture.

A stage with its own, longer seq_len L' (a short-to-long schedule) keeps the index in L-token slots:
each of its samples spans L' / L consecutive indices, so positions, skips and step boundaries mean the
same in every stage, and the stage boundaries are rounded as `stage_starts` says: a stage of another
length, or one that sets its own RoPE, begins on a step.
"""
from __future__ import annotations

import bisect
from typing import Sequence

from curriculum.config import LRPolicy, Stage


def cumulative_tokens(stages: Sequence[Stage]) -> list[int]:
    """cum[i] = tokens of stages 0..i."""
    out, total = [], 0
    for stage in stages:
        total += int(stage.tokens)
        out.append(total)
    return out


def stage_at(stages: Sequence[Stage], tokens: int) -> tuple[int, Stage]:
    """(index, stage) in effect after `tokens` tokens; the last stage past the end."""
    if not stages:
        raise ValueError("stage_at needs at least one stage")
    index = min(bisect.bisect_right(cumulative_tokens(stages), tokens), len(stages) - 1)
    return index, stages[index]


def stage_seq_lens(stages: Sequence[Stage], seq_len: int) -> list[int]:
    """Tokens per sample of each stage: its own `seq_len`, else the run's."""
    return [int(stage.seq_len) or seq_len for stage in stages]


def length_problem(index: int, length: int, seq_len: int) -> str | None:
    """Why stage `index`'s seq_len cannot be trained in a run of train.seq_len `seq_len` (None when it can)."""
    if length % seq_len:
        return (f"curriculum.stages.{index}.seq_len={length} is not a multiple of train.seq_len={seq_len}: set "
                "train.seq_len to the run's shortest length (every stage's seq_len a multiple of it)")
    return None


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def stage_starts(stages: Sequence[Stage], seq_len: int, global_batch: int = 1) -> list[int]:
    """First global sample of each stage (see the module doc for the rounding).

    A stage with a longer seq_len L' spans L' / L global samples per sample it trains (the global index
    counts L-token slots, L = the run's seq_len), so it starts on a multiple of L' / L. A stage whose length
    differs from the one before starts on a step (a multiple of `global_batch`), since one step's batch
    holds samples of one length; so does a stage that sets its own RoPE, since one step's forward uses one
    RoPE table (else the samples of that step from the new stage would train with the old RoPE).
    """
    lengths = stage_seq_lens(stages, seq_len)
    starts = [0]
    for index, cum in enumerate(cumulative_tokens(stages)[:-1]):
        following = index + 1
        on_a_step = lengths[following] != lengths[index] or sets_rope(stages[following])
        align = global_batch if on_a_step else lengths[following] // seq_len
        starts.append(max(starts[-1], round_up(-(-cum // seq_len), align)))
    return starts


def sets_rope(stage: Stage) -> bool:
    """Whether a stage sets its own RoPE (rope_theta or rope_scaling), in force from its first step."""
    return bool(stage.rope_theta) or bool(stage.rope_scaling)


def stage_ends(stages: Sequence[Stage], seq_len: int, global_batch: int = 1) -> list[int]:
    """One past the planned last sample of each stage (the last stage may run past its end)."""
    starts = stage_starts(stages, seq_len, global_batch)
    last = round_up(-(-cumulative_tokens(stages)[-1] // seq_len), stage_seq_lens(stages, seq_len)[-1] // seq_len)
    return starts[1:] + [max(last, starts[-1])]


def stage_at_sample(starts: Sequence[int], sample: int) -> int:
    """Index of the stage holding global sample `sample`, given `stage_starts`."""
    return max(0, bisect.bisect_right(starts, sample) - 1)


def step_in_stage(start: int, end: int, position: int, global_batch: int) -> tuple[int, int]:
    """(step within the stage, the stage's planned steps) for a step beginning at stream `position`."""
    stage_steps = max(1, -(-(end - start) // global_batch))
    return max(0, (position - start) // global_batch), stage_steps


def stage_lr(lr: float, min_lr: float, policy: LRPolicy, step: int, stage_steps: int) -> float:
    """The LR of a step, given the run schedule's `lr` for it and the stage's policy.

    Order: scale, then anneal toward min_lr (linear over the stage, reaching min_lr on its last
    step), then the re-warmup ramp ((step+1)/rewarmup_steps, as the run's own warmup: never 0).
    """
    out = lr * policy.scale
    if policy.decay_to_min:
        progress = min(1.0, (step + 1) / max(1, stage_steps))
        out = out + (min_lr - out) * progress
    if policy.rewarmup_steps > 0:
        out *= min(1.0, (step + 1) / policy.rewarmup_steps)
    return out


def eval_due(step: int, interval: int, dense_interval: int = 0, dense_until: int = 0) -> bool:
    """Whether to evaluate after optimizer step `step` (1-based count of steps done).

    Early instabilities hide between sparse evaluations, so the first `dense_until` steps are
    evaluated every `dense_interval` steps, the rest every `interval` (0 = never on that schedule).
    E.g. (200, 10, 200): steps 10, 20, ..., 200, then 400, 600, ...
    """
    if step <= 0:
        return False
    if dense_interval > 0 and step <= dense_until:
        return step % dense_interval == 0
    return interval > 0 and step % interval == 0
