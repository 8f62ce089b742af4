"""Staged data curriculum: stages, their schedule, the deterministic mixer, the plan.

- `config.py`: stages, weights, budgets (documented dataclasses); `declared.py`: the curriculum's own
  (Megatron) domains;
- `schedule.py`: where stages begin and end (pure functions); `mixture.py`: the pure mixture schedule
  (sample -> stage, domain, cursor);
- `mixer.py`: the mixer that turns the schedule into samples, skips and resumable state;
- `repetition.py`: how often each domain repeats; `plan.py`: budgets, repetition and checkpoint disk for
  `ayumi plan`.

May import: `common`, `data` (shards, manifests), `tokenizer` (identities); never `pretrain`.
"""
