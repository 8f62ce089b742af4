"""The `ayumi` command: one entry, subcommands routed to the package that owns them.

The commands that compose a config from `conf/` (OVERRIDE_COMMANDS) take Hydra overrides (`key=value`);
all but doctor print the resolved config with `--cfg job`. Every command exits with the statuses of
common/status.py (`ayumi --help` lists them).
"""
from __future__ import annotations

import importlib
import os
import sys
import textwrap

from common.status import BAD_INPUT, exit_status_help

# subcommand -> (module, function, one-line help). Modules load lazily so `ayumi --help` is instant
# and a command never pays for another's imports (DeepSpeed takes seconds to import).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("pretrain.tools.launch", "main", "train locally with the right launcher (deepspeed/torchrun) for this machine"),
    "demo": ("demo.run", "main", "the whole pipeline on the embedded default (Quickstart command 1)"),
    "export": ("pretrain.tools.export", "main", "export hf CHECKPOINT_DIR OUT_DIR: a transformers LlamaForCausalLM folder"),
    "eval": ("pretrain.tools.eval", "main", "eval TARGET [key=value]: downstream tasks on a run, checkpoint or HF folder"),
    "checkpoint": ("pretrain.tools.verify", "main", "verify | convert RUN_DIR: checksums, only safe-to-load files; old ones rewritten"),
    "tokenizer": ("tokenizer.cli", "main", "build | eval | sweep | export | expand: the merged SentencePiece tokenizer"),
    "data": ("data.cli", "main", "prepare | inspect | verify | merge: corpus to Megatron .bin/.idx token shards"),
    "plan": ("pretrain.tools.plan", "main", "stage table, repetition, steps, disk and per-GPU memory for an experiment"),
    "report": ("pretrain.tools.report.build", "main", "plots and a summary of a run dir"),
    "batch": ("pretrain.tools.batch", "main", "batch RUN_DIR --step N: every sample a step trained on, with its documents"),
    "replay": ("pretrain.tools.replay", "main", "replay RUN_DIR --spike K: was a spike the data or the state? (PaLM's replay)"),
    "doctor": ("pretrain.tools.doctor", "main", "versions, devices, DeepSpeed ops, disk and W&B mode"),
}


OVERRIDE_COMMANDS = ("train", "plan", "doctor", "tokenizer build", "tokenizer sweep", "data prepare", "eval")
"""The commands that compose a config and so take overrides (key=value): from conf/, except `eval`, which
composes eval.downstream from the run's own config.yaml. The others take only the arguments their --help lists.
All but doctor also print the resolved config with `--cfg job`."""


def usage() -> str:
    lines = ["usage: ayumi COMMAND [ARGS] [key=value ...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    overrides = (f"key=value overrides over conf/ (eval: over the run's eval.downstream): {', '.join(OVERRIDE_COMMANDS)} "
                 "(all but doctor print the resolved "
                 "config with `--cfg job`); the other commands take only their arguments. `ayumi COMMAND --help` (or -h) "
                 "for a command's options, the config it reads and that config's fields.")
    lines += ["", *textwrap.wrap(overrides, width=100, break_on_hyphens=False), "", exit_status_help()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"ayumi: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return BAD_INPUT
    module_name, func_name, _ = COMMANDS[name]
    # Every process a command starts (ranks, converters, data-preparation workers) keeps the working folder off its
    # import path: a folder there named like one of ayumi's packages would be imported instead ("" means off to
    # Python, so the value is set, not defaulted).
    os.environ["PYTHONSAFEPATH"] = "1"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name == module_name:
            print(f"ayumi {name}: not available in this version yet", file=sys.stderr)
            return BAD_INPUT
        raise
    result = getattr(module, func_name)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
