"""Task files, read and checked: ayumi's JSONL and llm-jp-eval's preprocessed JSON.

ayumi's JSONL has one example per line, all of one kind (docs/downstream-eval.md):

    {"context": "...", "choices": ["...", "..."], "gold": 1}      multiple_choice
    {"context": "...", "target": "..."}                             cloze
    {"context": "...", "answer": "..."}                             qa

A line may add `"split": "train"`: it then only serves as a few-shot example. llm-jp-eval's files hold
`instruction`, `output_length`, `metrics` and `samples` (`input`, `output`), and are scored as qa with the
file's metrics. A task that sets no delimiter gets one by its kind and language (default_delimiter). A mistake
raises TaskError: one line naming the file, the line (or sample) and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from downstream.config import KINDS, METRICS, TaskConfig

LLM_JP_METRICS = {"exact_match": "exact_match", "char_f1": "char_f1"}
"""llm-jp-eval metric names ayumi computes, and its name for each."""

DEFAULT_MAX_NEW_TOKENS = 32
"""qa generation length when neither the task nor its file says."""


class TaskError(ValueError):
    """A task file or task config that cannot be scored; the message is one line naming file, place and field."""


@dataclass(frozen=True)
class Example:
    """One scored (or few-shot) example."""

    where: str
    """Its place, for messages: `file:line N` or `file: samples[N]`."""
    context: str
    """The text the model continues."""
    choices: tuple[str, ...] = ()
    """multiple_choice: the candidate answers."""
    gold: int = 0
    """multiple_choice: the index of the right choice."""
    answer: str = ""
    """cloze: the target; qa: the expected answer."""

    def solved(self) -> str:
        """The right answer's text (what a few-shot example shows after its context)."""
        return self.choices[self.gold] if self.choices else self.answer


@dataclass
class Task:
    """A task ready to prompt with: its examples, few-shot pool and prompt settings."""

    name: str
    kind: str
    path: Path
    examples: list[Example]
    """The scored examples (capped by max_examples)."""
    pool: list[Example]
    """The train split: few-shot examples come from here."""
    metrics: list[str]
    instruction: str = ""
    delimiter: str = " "
    fewshot_separator: str = "\n\n"
    num_fewshot: int = 0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: list[str] = field(default_factory=lambda: ["\n"])


def load_task(cfg: TaskConfig, max_examples: int = 0) -> Task:
    """Read and check the task `cfg` names; `max_examples` is eval.downstream's cap (the task's own wins)."""
    path = Path(cfg.path)
    if not cfg.path:
        raise TaskError("eval.downstream.tasks: a task without `path`: name its .jsonl or llm-jp-eval .json file")
    if not path.is_file():
        raise TaskError(f"{path}: no such task file (eval.downstream.tasks path): give an existing .jsonl or .json")
    if cfg.kind not in KINDS:
        raise TaskError(f"{path}: kind={cfg.kind!r}: must be one of {', '.join(KINDS)}")
    if cfg.num_fewshot < 0 or cfg.max_examples < 0 or cfg.max_new_tokens < 0:
        raise TaskError(f"{path}: num_fewshot, max_examples and max_new_tokens must be >= 0")
    if path.suffix == ".json":
        task = _llm_jp_task(cfg, path)
    elif path.suffix == ".jsonl":
        task = _jsonl_task(cfg, path)
    else:
        raise TaskError(f"{path}: unknown task file type {path.suffix!r}: use .jsonl (ayumi's format) or .json "
                        "(llm-jp-eval's preprocessed dataset)")
    cap = cfg.max_examples or max_examples
    if cap:
        task.examples = task.examples[:cap]
    if not task.examples:
        raise TaskError(f"{path}: no examples to score (every line is a train-split line, or the file is empty)")
    if cfg.num_fewshot > len(task.pool):
        raise TaskError(f"{path}: num_fewshot={cfg.num_fewshot} but its train split has {len(task.pool)} examples: "
                        "lower num_fewshot, or give train_path (lines with \"split\": \"train\" in a JSONL)")
    return task


def _settings(cfg: TaskConfig, path: Path, kind: str, metrics: list[str], examples: list[Example] | None = None,
              **file_values: Any) -> dict[str, Any]:
    """The Task fields every format shares, the config's values over the file's (`examples`: the scored ones,
    whose language chooses an unset delimiter)."""
    wanted = list(cfg.metrics) or metrics
    unknown = [m for m in wanted if m not in METRICS[kind]]
    if unknown:
        raise TaskError(f"{path}: metrics: {unknown[0]!r} is not a {kind} metric ayumi computes "
                        f"({', '.join(METRICS[kind])}): remove it or choose another task kind")
    delimiter = cfg.delimiter if cfg.delimiter is not None else default_delimiter(kind, examples or [])
    return dict(name=cfg.name or path.stem, kind=kind, path=path, metrics=wanted, delimiter=delimiter,
                fewshot_separator=cfg.fewshot_separator, num_fewshot=cfg.num_fewshot, stop=list(cfg.stop),
                instruction=file_values.get("instruction", "") if not cfg.instruction else cfg.instruction,
                max_new_tokens=cfg.max_new_tokens or file_values.get("output_length") or DEFAULT_MAX_NEW_TOKENS)


UNSPACED_SCRIPTS = ((0x3040, 0x30FF), (0x31F0, 0x31FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF),
                    (0xFF66, 0xFF9F))
"""Kana, CJK ideographs and half-width katakana: scripts written without spaces between words."""


def default_delimiter(kind: str, examples: list[Example] | tuple[Example, ...] = ()) -> str:
    """The delimiter of a task that sets none: a newline for qa; for multiple_choice and cloze "" when most of its
    examples are Japanese (or Chinese) text, else " " (lm-eval's default).

    A space before a Japanese answer is text the model never saw there (Japanese has no spaces between words),
    so it costs the answer log-likelihood (issue 48: the README's cloze task, -10.92 with " ", -7.40 with "")."""
    if kind == "qa":
        return "\n"
    unspaced = sum(1 for example in examples if is_unspaced(example.context + example.solved()))
    return "" if examples and unspaced * 2 > len(examples) else " "


def is_unspaced(text: str) -> bool:
    """Whether most of the letters of `text` are of a script written without spaces (kana, kanji)."""
    letters = [ch for ch in text if ch.isalpha()]
    unspaced = sum(1 for ch in letters if any(low <= ord(ch) <= high for low, high in UNSPACED_SCRIPTS))
    return unspaced * 2 > len(letters)


# -- ayumi's JSONL --------------------------------------------------------------------------------------------------
KIND_FIELDS = {"multiple_choice": "choices", "cloze": "target", "qa": "answer"}
"""The field that marks each kind in a JSONL line (and the one `auto` looks for)."""


def _jsonl_task(cfg: TaskConfig, path: Path) -> Task:
    records = _jsonl_records(path)
    if not records:
        raise TaskError(f"{path}: empty task file: write one JSON object per line")
    kind = cfg.kind if cfg.kind != "auto" else _jsonl_kind(path, *records[0])
    examples, pool = [], []
    for line, record in records:
        example = _jsonl_example(path, line, record, kind)
        split = record.get("split", "test")
        if split not in ("train", "test"):
            raise TaskError(f"{path}:{line}: split: {split!r} must be \"train\" (few-shot only) or \"test\"")
        (pool if split == "train" else examples).append(example)
    if cfg.train_path:
        pool = [_jsonl_example(Path(cfg.train_path), line, record, kind)
                for line, record in _jsonl_records(_existing(cfg.train_path, path))]
    return Task(examples=examples, pool=pool, **_settings(cfg, path, kind, list(METRICS[kind]), examples=examples))


def _jsonl_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    records = []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                raise TaskError(f"{path}:{line}: not JSON ({err.msg}): write one JSON object per line") from None
            if not isinstance(record, dict):
                raise TaskError(f"{path}:{line}: a JSON object is needed, found {type(record).__name__}")
            records.append((line, record))
    return records


def _jsonl_kind(path: Path, line: int, record: dict[str, Any]) -> str:
    kinds = [kind for kind, key in KIND_FIELDS.items() if key in record]
    if len(kinds) != 1:
        raise TaskError(f"{path}:{line}: cannot tell the task kind: a line needs exactly one of "
                        f"{', '.join(KIND_FIELDS.values())} (or set the task's kind)")
    return kinds[0]


def _jsonl_example(path: Path, line: int, record: dict[str, Any], kind: str) -> Example:
    where = f"{path}:{line}"
    context = _string(record, "context", where)
    if kind == "multiple_choice":
        choices = record.get("choices")
        if not isinstance(choices, list) or not choices:
            raise TaskError(f"{where}: choices: {'missing' if choices is None else 'empty or not a list'}: "
                            "give a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in choices):
            raise TaskError(f"{where}: choices: every choice must be a non-empty string")
        gold = record.get("gold")
        if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
            raise TaskError(f"{where}: gold: {'missing' if gold is None else repr(gold)}: the index of the right "
                            f"choice, 0 to {len(choices) - 1}")
        return Example(where, context, tuple(choices), gold)
    answer = _string(record, KIND_FIELDS[kind], where)
    if not answer:
        raise TaskError(f"{where}: {KIND_FIELDS[kind]}: empty: give the expected text")
    return Example(where, context, answer=answer)


def _string(record: dict[str, Any], key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise TaskError(f"{where}: {key}: {'missing' if value is None else 'not a string'}: give it as a string")
    return value


def _existing(name: str, task_path: Path) -> Path:
    path = Path(name)
    if not path.is_file():
        raise TaskError(f"{task_path}: train_path {path}: no such file")
    return path


# -- llm-jp-eval's preprocessed JSON ---------------------------------------------------------------------------------
def _llm_jp_task(cfg: TaskConfig, path: Path) -> Task:
    data = _llm_jp_file(path)
    if cfg.kind not in ("auto", "qa"):
        raise TaskError(f"{path}: kind={cfg.kind}: llm-jp-eval files are generation tasks: use kind=qa (or auto)")
    # The file's own metrics are only used when the task names none: naming them is the way past one ayumi
    # does not compute (llm-jp-eval's bleu_ja, set_f1, ...), so they are only checked then.
    unknown = [m for m in data["metrics"] if not isinstance(m, str) or m not in LLM_JP_METRICS]
    if unknown and not cfg.metrics:
        raise TaskError(f"{path}: metrics: {unknown[0]!r} is not computed by ayumi (it computes "
                        f"{', '.join(LLM_JP_METRICS)}): set the task's metrics to those you want")
    examples = _llm_jp_samples(path, data)
    train = Path(cfg.train_path) if cfg.train_path else path.parent.parent / "train" / path.name
    pool: list[Example] = []
    if cfg.train_path or (train.is_file() and train.resolve() != path.resolve()):
        pool = _llm_jp_samples(train, _llm_jp_file(_existing(str(train), path)))
    metrics = [LLM_JP_METRICS[m] for m in data["metrics"] if m not in unknown]
    return Task(examples=examples, pool=pool, **_settings(cfg, path, "qa", metrics, instruction=data["instruction"],
                                                          output_length=data["output_length"]))


def _llm_jp_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TaskError(f"{path}: line {err.lineno}: not JSON ({err.msg})") from None
    if not isinstance(data, dict):
        raise TaskError(f"{path}: an llm-jp-eval dataset is a JSON object (instruction, output_length, metrics, "
                        "samples)")
    checks = {"instruction": str, "output_length": int, "metrics": list, "samples": list}
    for key, kind in checks.items():
        if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
            state = "missing" if key not in data else f"not a {kind.__name__}"
            raise TaskError(f"{path}: {key}: {state}: llm-jp-eval's preprocessed files have instruction, "
                            "output_length, metrics and samples")
    if data["output_length"] <= 0:
        raise TaskError(f"{path}: output_length: {data['output_length']}: must be > 0")
    return data


def _llm_jp_samples(path: Path, data: dict[str, Any]) -> list[Example]:
    examples = []
    for index, sample in enumerate(data["samples"]):
        where = f"{path}: samples[{index}]"
        if not isinstance(sample, dict):
            raise TaskError(f"{where}: a JSON object with input and output is needed")
        examples.append(Example(where, _string(sample, "input", where), answer=_string(sample, "output", where)))
    return examples
