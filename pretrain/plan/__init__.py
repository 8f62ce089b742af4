"""The plan of a run, checked before any GPU time is spent.

- `run_plan.py`: the curriculum's budgets, repetition and checkpoint disk plus the per-GPU memory, in one
  verdict that `ayumi plan`, `ayumi train`, the trainer and `ayumi doctor` share;
- `memory.py`: the per-GPU memory model (parameters, gradients, optimizer states, activations, loss);
- `hardware.py`: the GPUs a plan is checked against (visible here, or `train.num_gpus`/`gpu_memory_gib`);
- `lr_schedule.py`: the LR of every step, a pure function of the step, the optim config and the run's lengths.

May import: `pretrain.config`, `pretrain.model`, `curriculum`, `common`. Never torch at import time (a plan on
a login node must answer at once) and never DeepSpeed.
"""
