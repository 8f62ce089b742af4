"""The `eval.downstream` config: which task files to score, how often, and how strictly to read them.

Each task names a file (`path`) and how to turn its examples into prompts. The kinds (docs/downstream-eval.md):

- `multiple_choice`: every choice's log-likelihood after the context; metrics `acc` and `acc_norm`;
- `cloze`: the target's log-likelihood after the context, and whether greedy decoding gives exactly the target;
  metrics `exact_match` and `loglik`;
- `qa`: greedy generation up to a stop string or `max_new_tokens`; metrics `exact_match` and `char_f1`.

`auto` reads the kind from the file: llm-jp-eval's JSON is `qa` (its `metrics` decide which are reported); an
ayumi JSONL line with `choices` is multiple choice, with `target` cloze, with `answer` qa.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("auto", "multiple_choice", "cloze", "qa")
"""What `kind` accepts."""

PREFIXES = ("eos", "bos", "none")
"""What `prefix` accepts."""

METRICS = {"multiple_choice": ("acc", "acc_norm"), "cloze": ("exact_match", "loglik"), "qa": ("exact_match", "char_f1")}
"""The metrics each kind can report (all of them unless a task or its file names fewer)."""


@dataclass
class TaskConfig:
    """One task: a file of examples and how to prompt with them."""

    path: str = ""
    """The task file: `.jsonl` (ayumi's format, one example per line) or `.json` (llm-jp-eval's preprocessed
    dataset: instruction, output_length, metrics, samples)."""
    name: str = ""
    """The name in metrics (`eval/<name>/<metric>`); empty: the file's name without its suffix."""
    kind: str = "auto"
    """auto | multiple_choice | cloze | qa (see the module docstring)."""
    num_fewshot: int = 0
    """Solved examples put before each question, drawn from the task's train split with `eval.downstream.seed`."""
    train_path: str = ""
    """The train split for few-shot examples; empty: the JSONL's own lines with "split": "train", or for
    llm-jp-eval the same file name in the sibling `train/` folder (its layout: train/, dev/, test/)."""
    delimiter: str | None = None
    """Between a context and its answer (lm-eval's target_delimiter); unset: a newline for qa; for multiple_choice
    and cloze "" when most of the file's examples are Japanese (kana or kanji: no spaces between words), else " "
    (lm-eval's default)."""
    fewshot_separator: str = "\n\n"
    """Between one few-shot example and the next, and before the question."""
    instruction: str = ""
    """Text put before everything (llm-jp-eval's files bring their own)."""
    max_new_tokens: int = 0
    """qa: tokens generated at most; 0: the file's `output_length`, else 32."""
    stop: list[str] = field(default_factory=lambda: ["\n"])
    """qa: generation ends at the first of these strings (the answer is the text before it)."""
    max_examples: int = 0
    """Examples scored at most (the first ones of the file); 0: `eval.downstream.max_examples`."""
    metrics: list[str] = field(default_factory=list)
    """Metrics to report; empty: all of the kind's (llm-jp-eval: the file's own `metrics`)."""


@dataclass
class DownstreamConfig:
    """Downstream tasks scored during training (`eval.downstream`) and by `ayumi eval`."""

    tasks: list[TaskConfig] = field(default_factory=list)
    """The tasks; empty: none scored."""
    interval: int = 0
    """Score before a fresh run's first step (the curve's start), every this many optimizer steps, and after the
    last one; 0: only after the last step."""
    max_examples: int = 200
    """Examples per task at most, unless the task says otherwise (0: all)."""
    batch_size: int = 8
    """Sequences per forward pass on each rank."""
    seed: int = 1234
    """Chooses the few-shot examples (the same for every example of a task, every step and every rank count)."""
    prefix: str = "eos"
    """The token before every prompt: eos (what precedes every document in ayumi's training data), bos, or none
    (lm-evaluation-harness's choice for a non-empty context: use it to compare with lm-eval's numbers)."""
    strict: bool = True
    """A task file with a mistake stops the run before training (exit 2); false: that task is left out, with a
    line saying why, and the run goes on."""


def config_problems(cfg: DownstreamConfig, key: str = "eval.downstream") -> list[str]:
    """One line per value out of range (the task files themselves are checked when read: downstream/tasks.py)."""
    problems = []
    if cfg.prefix not in PREFIXES:
        problems.append(f"{key}.prefix={cfg.prefix!r} must be one of {', '.join(PREFIXES)}")
    for name, value, low in (("interval", cfg.interval, 0), ("max_examples", cfg.max_examples, 0),
                             ("batch_size", cfg.batch_size, 1)):
        if value < low:
            problems.append(f"{key}.{name}={value} must be >= {low}")
    for index, task in enumerate(cfg.tasks):
        if task.kind not in KINDS:
            problems.append(f"{key}.tasks[{index}].kind={task.kind!r} must be one of {', '.join(KINDS)}")
        if not task.path:
            problems.append(f"{key}.tasks[{index}].path is empty: name the task's .jsonl or .json file")
    return problems
