"""`ayumi eval TARGET [key=value ...]`: downstream tasks scored on a checkpoint, every checkpoint of a run, or a
Hugging Face folder, with the same code as the in-loop scores (downstream/), so the numbers agree.

TARGET is
- a run dir: its newest checkpoint (`--all`: every checkpoint, a curve after the fact), scored on the run's own
  `eval.downstream` tasks (its config.yaml) unless `tasks=` names others;
- a checkpoint folder (`step_XXXXXXX`), verified against its checksums first, as export and resume do;
- a transformers Llama folder (config.json + safetensors + tokenizer files), e.g. an `ayumi export hf` output.

key=value set eval.downstream's fields (`max_examples=50`, `prefix=none`, `batch_size=4`, ...) in Hydra's override
grammar, as `ayumi train` reads them (`eval.downstream.` before a key is optional); `tasks=A,B` is a shorthand for
task files with default settings, and `tasks=[{path:A,delimiter:""}]` the full form (`[{path:A,delimiter:""},B]`
mixes them). Options may come before or
after them. It prints a table (each metric with n and its standard error, as lm-evaluation-harness prints them)
and writes JSON: with `--out FILE` there; else, for a run, `--all` writes the run's curve RUN_DIR/eval/downstream.json
and one checkpoint writes beside it, RUN_DIR/eval/downstream.step_XXXXXXX.json, so it never replaces the curve.
`--all` scores every checkpoint it can: a damaged one is marked in the table and the JSON (exit status 1); one
holding a file that could run code stops the command (exit status 2, nothing written).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from common.status import BAD_INPUT, DONE, REFUSED

HF_CONFIG = "config.json"

EVAL_CONFIG = "ayumi_eval_downstream"
"""The name `ayumi eval` composes its settings under in Hydra's ConfigStore (the run's eval.downstream)."""

SECTION = "eval.downstream."
"""The prefix a key may carry (as `ayumi train` spells it); eval's settings are that section alone."""


@dataclass
class Scored:
    """One model's scores: where its weights came from and each task's metrics and examples; or, for a checkpoint
    `--all` could not load, why (`error`) and no tasks."""

    label: str
    step: int | None
    tasks: list[Any]
    error: str | None = None
    damaged: bool = False
    """The checkpoint's files do not match the checksums recorded at save."""


def compose_settings(own: dict[str, Any], overrides: list[str]):
    """eval.downstream: the run's own settings (`own`) under the overrides, composed by Hydra as `ayumi train`
    composes its config (same grammar, same one-line messages with "did you mean"); ValueError on a mistake."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from common.conf import ConfigCompositionError, compose
    from downstream.config import DownstreamConfig, TaskConfig

    overrides = [re.sub(rf"^([+~]*){re.escape(SECTION)}", r"\1", text) for text in overrides]
    for text in overrides:  # a task file given alone is the usual slip: say so in one line, not Hydra's three
        if "=" not in text and not text.startswith("~"):
            raise ValueError(f"{text!r}: expected key=value (a field of eval.downstream, e.g. max_examples=50, or "
                             f"tasks={text})")
    paths, overrides = task_shorthand(overrides)
    try:
        base = OmegaConf.merge(OmegaConf.structured(DownstreamConfig), own)
    except OmegaConfBaseException as err:
        raise ValueError(f"the run's config.yaml eval.downstream: {str(err).splitlines()[0]}") from None
    if paths is not None:
        base.tasks = [TaskConfig(path=path) for path in paths]
    try:
        composed = compose(EVAL_CONFIG, overrides, lambda: ConfigStore.instance().store(name=EVAL_CONFIG, node=base),
                           schema=DownstreamConfig, root=SECTION.rstrip("."), plain_entries={"tasks": "path"})
        return OmegaConf.to_object(composed)
    except ConfigCompositionError as err:
        raise ValueError(str(err)) from None
    except OmegaConfBaseException as err:  # a value that converts only when the dataclasses are built
        raise ValueError(f"{SECTION}{err.full_key}: {str(err).splitlines()[0]}") from None


def task_shorthand(overrides: list[str]) -> tuple[list[str] | None, list[str]]:
    """(task files, the other overrides) when the last `tasks=` names files only (`tasks=A`, `tasks=A,B`, which
    Hydra reads as a sweep, or `tasks=[A,B]`): those become tasks with default settings, and every earlier `tasks=`
    is replaced by it anyway. (None, overrides) otherwise: the full form goes to Hydra as it is."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    last = None
    for text in overrides:
        try:
            parsed = parser.parse_override(text)
        except HydraException:
            continue  # Hydra says what is wrong with it when it composes
        if parsed.key_or_group == "tasks" and not parsed.is_delete():
            last = parsed
    if last is None:
        return None, overrides
    value = last.value()
    files = value.list if isinstance(value, ChoiceSweep) else value if isinstance(value, list) else [value]
    if not all(isinstance(name, str) for name in files):
        return None, overrides
    return [name for name in files if name], [text for text in overrides if not _sets_tasks(text)]


def _sets_tasks(override: str) -> bool:
    """Whether an override (as eval reads it, without the eval.downstream. prefix) assigns `tasks`."""
    return override.lstrip("+").split("=", 1)[0] == "tasks"


def run_config_downstream(run_dir: Path) -> dict[str, Any]:
    """The run's own eval.downstream (RUN_DIR/config.yaml), or {} when it has none. Read as plain YAML and refused
    (PlantedInterpolation, a ValueError) when a value holds `${...}`: the run records it resolved, and composing
    would resolve what someone else wrote there."""
    import yaml

    from common.conf import plain_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    try:
        run_cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    evals = run_cfg.get("eval") if isinstance(run_cfg, dict) else None
    section = evals.get("downstream") if isinstance(evals, dict) else None
    if not isinstance(section, dict):
        return {}
    return plain_config(section, str(path), "eval.downstream")


def settings_for(target: Path, overrides: list[str]):
    """eval.downstream for this target: the run's own (when TARGET belongs to a run) under the command's overrides."""
    run_dir = run_dir_of(target)
    cfg = compose_settings(run_config_downstream(run_dir) if run_dir else {}, overrides)
    if not cfg.tasks:
        where = f" and {run_dir / 'config.yaml'} names none" if run_dir else ""
        raise ValueError(f"no tasks to score: give tasks=FILE[,FILE]{where}")
    return cfg


def run_dir_of(target: Path) -> Path | None:
    """The run dir TARGET belongs to (itself, or a checkpoint's run), None for an HF folder."""
    from pretrain.checkpoint.layout import is_complete

    if (target / HF_CONFIG).is_file():
        return None
    if is_complete(target):
        return target.parent.parent if target.parent.name == "checkpoints" else None
    return target if (target / "checkpoints").is_dir() or (target / "config.yaml").is_file() else None


def checkpoint_targets(target: Path, every: bool) -> list[Path]:
    """The checkpoint folders to score: TARGET itself, a run's newest, or (every) all of a run's."""
    from pretrain.checkpoint.checkpointer import resolve_checkpoint
    from pretrain.checkpoint.layout import complete_tags

    root, tag = resolve_checkpoint(target)
    return [root / t for t in complete_tags(root)] if every else [root / tag]


def load_checkpoint_model(path: Path, dtype: torch.dtype, device: torch.device, tokenizer_dir: Path | None):
    """(model, tokenizer, step) of a training checkpoint (files verified first)."""
    from pretrain.checkpoint.checkpointer import load_for_export
    from pretrain.checkpoint.layout import step_of
    from pretrain.model.llama import Llama
    from tokenizer.declared import load_declared_tokenizer

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's consolidation talks on stdout: the table is the output
        state, model_cfg, extra = load_for_export(path)
    if not extra.get("verified"):
        print(f"note: {path} records no checksums (saved before ayumi recorded them): scored without verifying",
              file=sys.stderr)
    model = Llama(model_cfg, init_weights=False)
    _load_weights(model, state)
    from pretrain.checkpoint.recorded import recorded_tokenizer

    tok = tokenizer_dir or recorded_tokenizer(path, extra.get("tokenizer_dir"))  # a recorded path: inside the run only
    if not tok:
        raise ValueError(f"{path} records no tokenizer: give --tokenizer-dir")
    return model.to(device, dtype).eval(), load_declared_tokenizer(tok), step_of(path.name)


def load_hf_model(folder: Path, dtype: torch.dtype, device: torch.device, tokenizer_dir: Path | None):
    """(model, tokenizer, None) of a transformers Llama folder."""
    from pretrain.model.config import ModelConfig
    from pretrain.model.hf_import import HFWeights, model_fields, read_hf_config
    from pretrain.model.llama import Llama
    from tokenizer.declared import load_declared_tokenizer

    model_cfg = ModelConfig(**model_fields(read_hf_config(folder), folder))
    weights = HFWeights(folder)
    model = Llama(model_cfg, init_weights=False)
    _load_weights(model, {name: weights.tensor(name) for name in weights.files})
    # Its SentencePiece model when it has one (what ayumi trained with), else its tokenizer.json.
    own = folder / "tokenizer.model" if (folder / "tokenizer.model").is_file() else folder
    return model.to(device, dtype).eval(), load_declared_tokenizer(tokenizer_dir or own), None


def _load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy `state` into the model (a tied lm_head is the embedding, tied when the Llama was built)."""
    result = model.load_state_dict(state, strict=False)
    missing = set(result.missing_keys) - ({"lm_head.weight"} if model.cfg.tie_embeddings else set())
    if missing or result.unexpected_keys:
        raise ValueError(f"weights do not match the model: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(result.unexpected_keys)[:3]}")


def score_model(model, tokenizer, settings, device: torch.device) -> list[Any]:
    """Every task of `settings` on one model, in this process."""
    from downstream.evaluate import prepare_tasks, score_tasks
    from downstream.scoring import Share

    eos = tokenizer.eod_id
    prepared = prepare_tasks(settings, tokenizer, model.cfg.max_seq_len, tokenizer.bos_id, eos,
                             on_error=lambda message: print(f"task left out (strict=false): {message}",
                                                            file=sys.stderr))
    end_ids = (eos,) if eos is not None else ()
    return score_tasks(prepared, lambda ids: model(ids).logits, tokenizer, Share(), settings.batch_size, device,
                       pad_id=end_ids[0] if end_ids else 0, end_ids=end_ids, vocab=tokenizer.vocab_size)


def score_checkpoints(paths: list[Path], every: bool, settings, dtype: torch.dtype, device: torch.device,
                      tokenizer_dir: Path | None) -> list[Scored]:
    """Each checkpoint's scores. With `every` (a curve) a checkpoint that cannot be loaded (damaged files, a save
    it cannot read) is recorded with its reason and the others are still scored; alone, it is an error, and so is
    an unsafe one (a file that could run code) in a curve."""
    from pretrain.checkpoint.checkpointer import CheckpointCorrupt, CheckpointError, CheckpointUnsafe
    from pretrain.checkpoint.layout import step_of
    from pretrain.checkpoint.safety import folder_problem

    for path in paths if every else ():  # every folder checked before any is read (one is checked as it loads)
        problem = folder_problem(path)
        if problem:
            raise CheckpointUnsafe(problem)
    results = []
    for path in paths:
        try:
            model, tokenizer, step = load_checkpoint_model(path, dtype, device, tokenizer_dir)
        except CheckpointError as err:
            # A file that could run code stops the whole command, curve or not: someone could write into this run,
            # and a curve with a hole would read as ordinary damage (fail closed: nothing written, exit 2).
            if not every or isinstance(err, CheckpointUnsafe):
                raise
            print(f"ayumi eval: {path.name} left out of the curve: {err}", file=sys.stderr)
            results.append(Scored(path.name, step_of(path.name), [], str(err), isinstance(err, CheckpointCorrupt)))
            continue
        results.append(Scored(path.name, step, score_model(model, tokenizer, settings, device)))
    return results


def table(results: list[Scored]) -> str:
    """Task, metric, n (examples scored), then one column per model: the value ± its standard error, as lm-eval
    prints them (N/A under two examples), or why a checkpoint left out has no scores."""
    scored = [r for r in results if r.tasks]
    header = ["task", "metric", "n"] + [r.label for r in results]
    rows = []
    for task in scored[0].tasks:
        for metric in task.metrics:
            counts = sorted({by_name(r)[task.name].n for r in scored if task.name in by_name(r)})
            rows.append([task.name, metric, "/".join(map(str, counts))] + [cell(r, task.name, metric) for r in results])
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in [header] + rows]
    return "\n".join(line.rstrip() for line in lines)


def by_name(result: Scored) -> dict[str, Any]:
    """A model's task scores by task name (a task left out under strict=false is absent)."""
    return {task.name: task for task in result.tasks}


def cell(result: Scored, task: str, metric: str) -> str:
    """One model's `value ± stderr` for a task's metric; `damaged` (or `left out`) for a checkpoint not scored."""
    if result.error is not None:
        return "damaged" if result.damaged else "left out"
    scores = by_name(result).get(task)
    if scores is None:
        return "-"
    stderr = scores.stderr.get(metric, math.nan)
    return f"{scores.metrics[metric]:.4f} ± {'N/A' if math.isnan(stderr) else f'{stderr:.4f}'}"


def as_json(target: Path, settings, results: list[Scored]) -> dict[str, Any]:
    """What `ayumi eval` writes: the target, the settings and each model's tasks (metrics, stderr, n, examples) or
    why a checkpoint was left out (`error`, `damaged`)."""
    def entry(r: Scored) -> dict[str, Any]:
        if r.error is not None:
            return {"label": r.label, "step": r.step, "error": r.error, "damaged": r.damaged}
        return {"label": r.label, "step": r.step,
                "tasks": {t.name: {"kind": t.kind, "metrics": t.metrics, "n": t.n,
                                   "stderr": {m: None if math.isnan(v) else v for m, v in t.stderr.items()},
                                   "examples": t.examples} for t in r.tasks}}
    return {"target": str(target), "settings": asdict(settings), "scores": [entry(r) for r in results]}


def default_out(target: Path, every: bool, results: list[Scored]) -> Path | None:
    """Where the scores go without --out: for a run, `--all`'s curve is RUN_DIR/eval/downstream.json and one
    checkpoint's scores go beside it, named after the checkpoint (never over the curve); nothing for an HF folder."""
    from pretrain.metrics import EVAL_CURVE_FILE  # the report reads the curve back from there

    run_dir = run_dir_of(target)
    if run_dir is None:
        return None
    curve = run_dir / EVAL_CURVE_FILE
    return curve if every else curve.with_name(f"downstream.{results[0].label}.json")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line: options before or after the key=value overrides (argparse's intermixed parsing)."""
    from common.conf import config_help, fields_help
    from downstream.config import DownstreamConfig, TaskConfig

    reads = config_help("eval.downstream from the run's config.yaml (RUN_DIR, or a checkpoint's run; nothing for an "
                        "HF folder), no conf/ files; overrides in Hydra's grammar, as `ayumi train` takes them; "
                        "tasks=A,B is short for task files with default settings")
    fields = fields_help(DownstreamConfig, "downstream/config.py", entries={"tasks": TaskConfig})
    parser = argparse.ArgumentParser(
        prog="ayumi eval", description="Score downstream tasks on a checkpoint, a run's checkpoints or an HF folder "
        "(docs/downstream-eval.md).", epilog=f"{reads}\n\n{fields}", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path, help="run dir, checkpoint folder, or transformers Llama folder")
    parser.add_argument("overrides", nargs="*", help="eval.downstream fields as key=value")
    parser.add_argument("--all", action="store_true",
                        help="every checkpoint of the run (a curve), not the newest; a damaged one is marked and "
                        "the others scored (exit status 1)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON to write (default for a run: --all writes the curve, RUN_DIR/eval/downstream.json; "
                        "one checkpoint writes RUN_DIR/eval/downstream.step_XXXXXXX.json beside it; an HF folder: "
                        "none)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights while scoring")
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help="tokenizer (default: the one the checkpoint records, or the HF folder's own)")
    parser.add_argument("--cfg", choices=("job",), default=None, help="print the resolved eval.downstream and exit")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str]) -> int:
    """`ayumi eval TARGET [key=value ...] [--all] [--out FILE] [--dtype fp32|bf16] [--tokenizer-dir DIR]`, the
    options anywhere."""
    args = parse_args(argv)

    from common.conf import error_lines
    from downstream.tasks import TaskError
    from pretrain.checkpoint.checkpointer import CheckpointError
    from pretrain.model.hf_import import HFImportError
    from tokenizer.info import TokenizerNotFoundError

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        settings = settings_for(args.target, args.overrides)
        if args.cfg:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.structured(settings)), end="")
            return DONE
        if (args.target / HF_CONFIG).is_file():
            model, tokenizer, step = load_hf_model(args.target, dtype, device, args.tokenizer_dir)
            results = [Scored(args.target.name, step, score_model(model, tokenizer, settings, device))]
        else:
            results = score_checkpoints(checkpoint_targets(args.target, args.all), args.all, settings, dtype, device,
                                        args.tokenizer_dir)
    except (TaskError, CheckpointError, HFImportError, TokenizerNotFoundError, ValueError, FileNotFoundError) as err:
        print(error_lines("ayumi eval: ", err), file=sys.stderr)  # one line per typo of the command line
        return BAD_INPUT
    scored = [r for r in results if r.tasks]
    if not scored:  # nothing to show, and nothing written over an earlier curve
        print("ayumi eval: " + ("no checkpoint could be scored (see above)" if any(r.error for r in results)
                                else "every task was left out (see above)"), file=sys.stderr)
        return REFUSED if any(r.error for r in results) else BAD_INPUT
    print(table(results))
    out = args.out or default_out(args.target, args.all, results)
    if out is not None:
        from common.files import write_text_atomic

        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, json.dumps(as_json(args.target, settings, results), ensure_ascii=False, indent=1))
        print(f"wrote {out}")
    left_out = [r.label for r in results if r.error]
    if left_out:  # the curve has holes: a verdict to read, as `ayumi checkpoint verify` gives for damage
        print(f"ayumi eval: {len(left_out)} of {len(results)} checkpoint(s) left out: {', '.join(left_out)}",
              file=sys.stderr)
        return REFUSED
    return DONE
