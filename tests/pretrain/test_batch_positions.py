"""Where a step's global batch began, from the run's record (pretrain/step_samples.py): the closed form against the
trainer's own loop, and the layouts of sessions and rollbacks on the present timeline. Pure, no training."""
from __future__ import annotations

import random

from curriculum.mixer import batches_due, merge_ranges
from pretrain.step_samples import Layout, layouts, position_after


def trainer_positions(first: int, steps: int, skips: list[tuple[int, int]], global_batch: int) -> list[int]:
    """What Trainer.train_step does: before each step jump a recorded range it has reached, then take a batch."""
    position, out = first, []
    for _ in range(steps + 1):
        position += batches_due(skips, position, global_batch) * global_batch
        out.append(position)
        position += global_batch
    return out


def test_the_closed_form_is_the_trainers_loop():
    rng = random.Random(51)
    for _ in range(300):
        batch = rng.choice([1, 4, 8])
        skips = merge_ranges([(start * batch, (start + rng.randint(1, 5)) * batch)
                              for start in rng.sample(range(60), rng.randint(0, 4))])
        first = rng.randint(0, 20) * batch
        expected = trainer_positions(first, 70, skips, batch)
        assert [position_after(first, steps, skips, batch) for steps in range(71)] == expected, (first, skips)


def test_ranges_closer_than_a_batch_are_jumped_as_the_trainer_does():
    """Unaligned ranges less than a global batch apart: the trainer takes the batch a jump lands in, then looks
    again (a closed form gave 160 here where the trainer gives 152)."""
    assert position_after(0, 13, [(93, 121), (126, 152)], 8) == trainer_positions(0, 13, [(93, 121), (126, 152)], 8)[-1]
    rng = random.Random(7)
    for _ in range(300):
        batch = rng.choice([3, 8])
        skips = merge_ranges([(start, start + rng.randint(1, 30)) for start in rng.sample(range(200), rng.randint(1, 5))])
        first = rng.randint(0, 40)
        expected = trainer_positions(first, 40, skips, batch)
        assert [position_after(first, steps, skips, batch) for steps in range(41)] == expected, (first, skips)


def session(step: int, first: int, dp: int) -> dict:
    return {"event": "session", "step": step, "first_sample": first, "dp_size": dp, "micro_batch": 4,
            "grad_accum": 2 // dp, "global_batch": 8}


def test_a_rollback_or_an_older_resume_replaces_the_stretch_it_retrains():
    events = [session(0, 0, 2), {"event": "stage_switch", "step": 5},
              session(100, 800, 1),  # a resume on one rank
              {"event": "recovered", "step": 80, "first_sample": 720},  # rolled back into the first session's stretch
              session(60, 480, 2)]  # then a resume from an older checkpoint (checkpoint.load_from)
    assert layouts(events) == [Layout(0, 0, 2, 4, 1, 8), Layout(60, 480, 2, 4, 1, 8)]
    assert layouts(events[:4]) == [Layout(0, 0, 2, 4, 1, 8), Layout(80, 720, 1, 4, 2, 8)]
