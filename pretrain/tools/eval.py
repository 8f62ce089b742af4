"""`ayumi eval TARGET [key=value ...]`: downstream tasks scored on a checkpoint, every checkpoint of a run, or a
Hugging Face folder, with the same code as the in-loop scores (downstream/), so the numbers agree.

TARGET is
- a run dir: its newest checkpoint (`--all`: every checkpoint, a curve after the fact), scored on the run's own
  `eval.downstream` tasks (its config.yaml) unless `tasks=` names others;
- a checkpoint folder (`step_XXXXXXX`), verified against its checksums first, as export and resume do;
- a transformers Llama folder (config.json + safetensors + tokenizer files), e.g. an `ayumi export hf` output.

key=value set eval.downstream's fields (`max_examples=50`, `prefix=none`, `batch_size=4`, ...); `tasks=A,B` is a
shorthand for task files with default settings, and `tasks=[{path:A,delimiter:""}]` the full form. It prints
a table and writes JSON (`--out`, default TARGET's folder for a run: RUN_DIR/eval/downstream.json).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from common.status import BAD_INPUT

HF_CONFIG = "config.json"


@dataclass
class Scored:
    """One model's scores: where its weights came from and each task's metrics and examples."""

    label: str
    step: int | None
    tasks: list[Any]


def parse_overrides(pairs: list[str]):
    """DownstreamConfig from key=value pairs (tasks=A,B: task files with default settings)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from downstream.config import DownstreamConfig, TaskConfig

    dotlist = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"{pair!r}: expected key=value (a field of eval.downstream, e.g. max_examples=50)")
        key = key.removeprefix("eval.downstream.")
        if key == "tasks" and not value.startswith("["):
            value = json.dumps([{"path": name} for name in value.split(",") if name])
        dotlist.append(f"{key}={value}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(DownstreamConfig), OmegaConf.from_dotlist(dotlist))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:  # an unknown key or a wrongly typed value: its name, in one line
        raise ValueError(f"eval.downstream: {str(err).splitlines()[0]} (full_key {err.full_key})") from None
    cfg.tasks = [task if isinstance(task, TaskConfig) else TaskConfig(**task) for task in cfg.tasks]
    return cfg


def run_config_downstream(run_dir: Path) -> dict[str, Any]:
    """The run's own eval.downstream (RUN_DIR/config.yaml), or {} when it has none."""
    from omegaconf import OmegaConf

    path = run_dir / "config.yaml"
    if not path.is_file():
        return {}
    run_cfg = OmegaConf.load(path)
    section = OmegaConf.select(run_cfg, "eval.downstream")
    return OmegaConf.to_container(section, resolve=False) if section is not None else {}


def settings_for(target: Path, pairs: list[str]):
    """eval.downstream for this target: the run's own (when TARGET belongs to a run) under the command's pairs."""
    run_dir = run_dir_of(target)
    own = run_config_downstream(run_dir) if run_dir else {}
    base = [f"{key}={json.dumps(value)}" for key, value in own.items() if key != "tasks"]
    if own.get("tasks") and not any(pair.startswith(("tasks=", "eval.downstream.tasks=")) for pair in pairs):
        base.append("tasks=" + json.dumps(own["tasks"]))
    cfg = parse_overrides(base + pairs)
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
    tok = tokenizer_dir or extra.get("tokenizer_dir")
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


def table(results: list[Scored]) -> str:
    """Task, metric, then one column per scored model."""
    header = ["task", "metric"] + [r.label for r in results]
    rows = []
    for index, task in enumerate(results[0].tasks):
        for metric in task.metrics:
            rows.append([task.name, metric] + [f"{r.tasks[index].metrics[metric]:.4f}" for r in results])
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in [header] + rows]
    return "\n".join(lines)


def as_json(target: Path, settings, results: list[Scored]) -> dict[str, Any]:
    return {"target": str(target), "settings": asdict(settings),
            "scores": [{"label": r.label, "step": r.step,
                        "tasks": {t.name: {"kind": t.kind, "metrics": t.metrics, "examples": t.examples}
                                  for t in r.tasks}} for r in results]}


def main(argv: list[str]) -> int:
    """`ayumi eval TARGET [key=value ...] [--all] [--out FILE] [--dtype fp32|bf16] [--tokenizer-dir DIR]`."""
    from common.conf import config_help, fields_help
    from downstream.config import DownstreamConfig, TaskConfig

    reads = config_help("eval.downstream from the run's config.yaml (RUN_DIR, or a checkpoint's run; nothing for an "
                        "HF folder), no conf/ files; tasks=A,B is short for task files with default settings")
    fields = fields_help(DownstreamConfig, "downstream/config.py", entries={"tasks": TaskConfig})
    parser = argparse.ArgumentParser(
        prog="ayumi eval", description="Score downstream tasks on a checkpoint, a run's checkpoints or an HF folder "
        "(docs/downstream-eval.md).", epilog=f"{reads}\n\n{fields}", formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", type=Path, help="run dir, checkpoint folder, or transformers Llama folder")
    parser.add_argument("overrides", nargs="*", help="eval.downstream fields as key=value")
    parser.add_argument("--all", action="store_true", help="every checkpoint of the run (a curve), not the newest")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON to write (default: RUN_DIR/eval/downstream.json for a run, none otherwise)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weights while scoring")
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help="tokenizer (default: the one the checkpoint records, or the HF folder's own)")
    parser.add_argument("--cfg", choices=("job",), default=None, help="print the resolved eval.downstream and exit")
    args = parser.parse_args(argv)

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
            return 0
        results = []
        if (args.target / HF_CONFIG).is_file():
            model, tokenizer, step = load_hf_model(args.target, dtype, device, args.tokenizer_dir)
            results.append(Scored(args.target.name, step, score_model(model, tokenizer, settings, device)))
        else:
            for path in checkpoint_targets(args.target, args.all):
                model, tokenizer, step = load_checkpoint_model(path, dtype, device, args.tokenizer_dir)
                results.append(Scored(path.name, step, score_model(model, tokenizer, settings, device)))
    except (TaskError, CheckpointError, HFImportError, TokenizerNotFoundError, ValueError, FileNotFoundError) as err:
        print(f"ayumi eval: {err}", file=sys.stderr)
        return BAD_INPUT
    if not results[0].tasks:
        print("ayumi eval: every task was left out (see above)", file=sys.stderr)
        return BAD_INPUT
    print(table(results))
    run_dir = run_dir_of(args.target)
    out = args.out or (run_dir / "eval" / "downstream.json" if run_dir else None)
    if out is not None:
        from common.files import write_text_atomic

        out.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out, json.dumps(as_json(args.target, settings, results), ensure_ascii=False, indent=1))
        print(f"wrote {out}")
    return 0
