"""How often a run reads each domain, against its maximum repetition, and the one message that refuses it.

Every run has a repetition limit per domain, with or without a curriculum: a staged curriculum's
stage `max_repetition.<domain>` or its `default_max_repetition` (4 epochs unless configured), and the
run without a curriculum (`curriculum=none`, all domains in one shuffled stream) has the
`curriculum.default_max_repetition` of its curriculum config. Reading a corpus thousands of times
is almost always a mistake (the wrong data root, a missing shard folder, a zero too many in
train.tokens), so the plan and the trainer refuse it before step 1; a run that repeats data on
purpose raises the limit in its config.

Both kinds of run report an over-read domain with `repetition_message`, so the refusals read
alike: the domain, the epochs measured against the epochs allowed (and which field allows them),
and the three fixes (more data, fewer tokens with the largest token budget that fits, a higher
limit on purpose). Fields are named as Hydra overrides (`curriculum.stages.0.tokens=...`, numbers
without separators), so a fix can be pasted onto the command line as it is.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping

import numpy as np

from curriculum.config import CurriculumConfig, max_repetition

if TYPE_CHECKING:  # the schedule lives in mixer.py, which imports this module
    from curriculum.mixture import MixtureSchedule

DEFAULT_LIMIT_FIELD = "curriculum.default_max_repetition"


def limit_to_set(epochs: float) -> str:
    """The smallest round limit that admits `epochs`: whole epochs, or hundredths below one epoch."""
    return str(math.ceil(epochs)) if epochs >= 1 else f"{math.ceil(epochs * 100) / 100:g}"


def repetition_message(domain: str, epochs: float, limit: float, limit_field: str, wanted: int, available: int,
                       when: str, fewer_tokens: str, raise_limit: str) -> str:
    """One over-read domain, as `ayumi plan` and the trainer print it (the same words for every curriculum)."""
    return (f"domain {domain!r} would be read {epochs:.2f} times {when}, more than its limit of {limit:g} "
            f"({limit_field}): {wanted:,} samples wanted, {available:,} available. Fix one: prepare more {domain} "
            f"data (`ayumi data prepare`); {fewer_tokens}; or raise the limit on purpose ({raise_limit})")


# -- no curriculum: every domain in one shuffled stream ----------------------------------------------
def shuffled_epochs(run_samples: int, domain_samples: Mapping[str, int]) -> float:
    """Epochs of every domain after `run_samples` samples of one shuffled stream over all of them.

    `ShuffledDomains` permutes all samples together, epoch after epoch, so each domain is read in
    proportion to its size: the same number of epochs for all (exactly at whole epochs).
    """
    total = sum(domain_samples.values())
    return run_samples / total if total else math.inf


def shuffled_repetition_problems(limit: float, domain_samples: Mapping[str, int], run_samples: int,
                                 global_batch: int, seq_len: int) -> list[str]:
    """The domains a run without a curriculum would read more than `limit` epochs (all of them, or none)."""
    epochs = shuffled_epochs(run_samples, domain_samples)
    if epochs <= limit:
        return []
    # The largest whole number of steps whose samples stay within the limit: the run ends on a step.
    fitting_steps = math.floor(limit * sum(domain_samples.values()) / global_batch)
    if fitting_steps > 0:
        fewer = (f"train fewer tokens (train.tokens={fitting_steps * global_batch * seq_len} fits: "
                 f"{fitting_steps:,} steps)")
    else:
        fewer = f"train fewer tokens (none fits: one step of {global_batch:,} samples already reads more)"
    raise_limit = f"{DEFAULT_LIMIT_FIELD}={limit_to_set(epochs)}"
    return [repetition_message(name, epochs, limit, DEFAULT_LIMIT_FIELD, round(epochs * available), available,
                               "by the end of the run", fewer, raise_limit)
            for name, available in domain_samples.items() if available > 0]


# -- a staged curriculum --------------------------------------------------------------------------------
def repetition_problems(cfg: CurriculumConfig, schedule: MixtureSchedule, domain_samples: Mapping[str, int],
                        run_samples: int | None = None, global_batch: int | None = None) -> list[str]:
    """Domains whose cumulative epochs at a stage's end would exceed that stage's max_repetition.

    `run_samples` (with the run's `global_batch`) is where the whole run ends (the last step may
    overshoot the last budget); None ends the last stage at its budget, as the mixer plans it.
    """
    problems = []
    cumulative = np.cumsum(schedule.stage_picks(run_samples), axis=0)
    for index, stage in enumerate(cfg.stages):
        for d, stream in enumerate(schedule.streams):  # a domain at another seq_len or filter is read apart
            available = int(domain_samples.get(stream.name, 0))
            picks = int(cumulative[index, d])
            if picks == 0:
                continue
            limit = max_repetition(cfg, stage, stream.domain)
            epochs = picks / available if available else math.inf
            if epochs > limit:
                problems.append(_stage_problem(cfg, schedule, index, d, stream.name, epochs, limit, picks, available,
                                               run_samples, global_batch))
    return problems


def _stage_problem(cfg: CurriculumConfig, schedule: MixtureSchedule, index: int, d: int, name: str, epochs: float,
                   limit: float, picks: int, available: int, run_samples: int | None,
                   global_batch: int | None) -> str:
    stage = cfg.stages[index]
    domain = schedule.streams[d].domain
    own = f"curriculum.stages.{index}.max_repetition.{domain}"
    set_to = limit_to_set(epochs)
    if domain in stage.max_repetition:
        limit_field, raise_limit = own, f"{own}={set_to}"
    else:  # a key the stage does not have yet: Hydra adds it with '+'
        limit_field = DEFAULT_LIMIT_FIELD
        raise_limit = f"{DEFAULT_LIMIT_FIELD}={set_to}, or +{own}={set_to} for this stage alone"
    fewer = _fewer_stage_tokens(cfg, schedule, index, d, name, math.floor(limit * available), run_samples, global_batch)
    return repetition_message(name, epochs, limit, limit_field, picks, available,
                              f"by the end of stage {index + 1} ({stage.name!r})", fewer, raise_limit)


def _fewer_stage_tokens(cfg: CurriculumConfig, schedule: MixtureSchedule, index: int, d: int, name: str, cap: int,
                        run_samples: int | None, global_batch: int | None) -> str:
    """The 'fewer tokens' fix: the largest budget of the stage that keeps the domain within `cap` picks.

    Shrinking the stage moves no earlier boundary, so the domain's picks by the stage's end are exact;
    train.tokens (the sum of the budgets) shrinks by as much. The last stage of a whole run ends on a
    step, so its budget is rounded down to whole steps.
    """
    stage = cfg.stages[index]
    weight = f"lower {name}'s weight in stage {index + 1}"
    longest = schedule.longest_stage_within(index, d, cap)
    before = sum(int(s.tokens) for s in cfg.stages[:index])
    seq_len = schedule.seq_len
    if longest is None:
        return (f"train fewer tokens of it (the stages before stage {index + 1} already read it too often: "
                f"lower its weight or their tokens)")
    end = schedule.starts[index] + longest
    last_of_run = index == len(cfg.stages) - 1 and run_samples is not None and global_batch
    budget_end = (end // global_batch) * global_batch * seq_len if last_of_run else end * seq_len
    fitting = budget_end - before
    if fitting <= 0:
        return f"train fewer tokens of it ({weight}; no budget of stage {index + 1} alone fits)"
    total = sum(int(s.tokens) for s in cfg.stages) - int(stage.tokens) + fitting
    return (f"train fewer tokens of it (curriculum.stages.{index}.tokens={fitting} train.tokens={total} fits, "
            f"or {weight})")
