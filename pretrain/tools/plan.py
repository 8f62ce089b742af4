"""`ayumi plan [--tokens-per-s N] [--free-bytes N] [--cfg job] key=value ...`: the run's whole plan.

Exit statuses (common/status.py): 0 plan ok, 1 plan refused (reasons printed), 2 invalid configuration or
arguments.
"""
from __future__ import annotations

import sys

from common.conf import asks_for_help
from common.status import BAD_INPUT, DONE, REFUSED
from pretrain.plan.hardware import planned_hardware
from pretrain.plan.run_plan import format_run_plan, run_plan

USAGE = """usage: ayumi plan [--tokens-per-s N] [--free-bytes N] [--cfg job] [key=value ...]

Prints the stage x domain table (tokens requested and available, epochs vs max_repetition), steps,
tokens/step, checkpoint count and disk need vs free space, the wall time when --tokens-per-s (the
whole run's training throughput) is given, and the per-GPU memory breakdown (parameters, gradients,
optimizer states, activations, loss, allowances) against the GPUs visible here or train.gpu_memory_gib
with train.num_gpus. Exits 1 when the plan is impossible (data, budgets, repetition, disk, memory).
  e.g. ayumi plan experiment=ja_en_4stage --tokens-per-s 4e5
       ayumi plan experiment=llama_1b_example train.num_gpus=8 train.gpu_memory_gib=80"""


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
    from pretrain.config import print_config_error
    from data.domains import validation_notice
    from pretrain.startup.checks import settled_before_launch
    from pretrain.model.flops import count_parameters

    try:
        rest, options = parse_args(argv)
        # The same checks as `ayumi train` before it starts a rank: ranges, names, shapes, stages, what a resume
        # changes, vocabulary, tasks
        settled = settled_before_launch(rest)
    except ValueError as err:  # a bad option, or a ConfigError (a ValueError too)
        print_config_error("ayumi plan", err)
        return BAD_INPUT
    if settled.printed:  # --cfg job printed the resolved config
        return DONE
    cfg = settled.cfg
    for line in settled.resume.lines() if settled.resume else []:
        print(f"ayumi plan: {line}")
    no_validation = validation_notice(cfg.data.root, cfg.data.domains, cfg.data.validation)
    if no_validation:
        print(f"ayumi plan: {no_validation}")
    free = options.get("free_bytes")
    run = run_plan(cfg, count_parameters(cfg.model), planned_hardware(cfg), tokens_per_s=options.get("tokens_per_s"),
                   free_bytes=int(free) if free is not None else None)
    from data.exclude import ExcludeError
    from pretrain.excluded import plan_lines

    try:
        excluded = plan_lines(cfg)  # what data.exclude takes out of the stream, checked before anything is printed
    except ExcludeError as err:
        print_config_error("ayumi plan", err)
        return BAD_INPUT
    print(format_run_plan(run))
    for line in excluded:
        print(line)
    if run.problems:
        print(f"ayumi plan: refused ({len(run.problems)} problem(s), listed above)", file=sys.stderr)
        return REFUSED
    return DONE


if __name__ == "__main__":
    sys.exit(main())
