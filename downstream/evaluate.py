"""Downstream evaluation of a list of tasks: prepared once, scored whenever asked.

`prepare_tasks` reads every task file and turns each example into token requests (this is where a mistake in a
file is found: missing fields, empty choices, prompts longer than the model reads). `score_tasks` runs them
through a model and returns each task's metrics. The trainer's in-loop evaluator and `ayumi eval` both call
these two, so a checkpoint scored after the fact gets the in-loop numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from downstream.config import DownstreamConfig
from downstream.metrics import char_f1, choice_scores, cut_at_stop, exact_match, mean, mean_stderr
from downstream.prompts import (GenerateRequest, LoglikRequest, Tokenizer, fewshot_examples, generate_request,
                                loglik_requests)
from downstream.tasks import Task, TaskError, load_task

if TYPE_CHECKING:  # torch loads with the scoring only: `ayumi train` prepares the tasks before launch without it
    import torch

    from downstream.scoring import LogitsFn, Share


@dataclass
class PreparedTask:
    """A task with its requests: loglik ones per example (multiple_choice, cloze) or one generation (qa)."""

    task: Task
    loglik: list[list[LoglikRequest]] = field(default_factory=list)
    generate: list[GenerateRequest] = field(default_factory=list)
    max_len: int = 0
    """The positions the model reads (prepare_tasks' max_len): every request fits, and batches are padded no further."""


@dataclass
class TaskScores:
    """A task's metrics, their standard errors and what each example got."""

    name: str
    kind: str
    metrics: dict[str, float]
    examples: list[dict[str, Any]]
    stderr: dict[str, float] = field(default_factory=dict)
    """Each metric's standard error of the mean over the examples (downstream.metrics.mean_stderr)."""

    @property
    def n(self) -> int:
        """The examples scored."""
        return len(self.examples)


def prefix_ids(prefix: str, bos_id: int | None, eos_id: int | None) -> list[int]:
    """The token put before every prompt (eval.downstream.prefix)."""
    if prefix == "none":
        return []
    token = eos_id if prefix == "eos" else bos_id
    if token is None or token < 0:
        raise TaskError(f"eval.downstream.prefix={prefix}: the tokenizer has no {prefix.upper()} token: "
                        "use prefix=none (or the other one)")
    return [token]


def prepare_tasks(cfg: DownstreamConfig, tokenizer: Tokenizer, max_len: int, bos_id: int | None,
                  eos_id: int | None, on_error: Callable[[str], None] | None = None) -> list[PreparedTask]:
    """Every task of cfg, read and tokenized. A TaskError is raised (strict), or passed to on_error and the task
    left out; the same task names twice are a mistake either way."""
    prefix = prefix_ids(cfg.prefix, bos_id, eos_id)
    prepared: list[PreparedTask] = []
    for task_cfg in cfg.tasks:
        try:
            task = load_task(task_cfg, cfg.max_examples)
            if any(p.task.name == task.name for p in prepared):
                raise TaskError(f"{task.path}: task name {task.name!r} is used twice: give one of them a name")
            prepared.append(_requests(task, tokenizer, prefix, max_len, cfg.seed))
        except TaskError as err:
            if on_error is None or cfg.strict:
                raise
            on_error(str(err))
    return prepared


def _requests(task: Task, tokenizer: Tokenizer, prefix: list[int], max_len: int, seed: int) -> PreparedTask:
    shots = fewshot_examples(task, seed)
    prepared = PreparedTask(task, max_len=max_len)
    for example in task.examples:
        if task.kind == "qa":
            prepared.generate.append(generate_request(task, example, shots, tokenizer, prefix, max_len))
        else:
            prepared.loglik.append(loglik_requests(task, example, shots, tokenizer, prefix, max_len))
    return prepared


def score_tasks(prepared: list[PreparedTask], logits_fn: LogitsFn, tokenizer: Tokenizer, share: Share,
                batch_size: int, device: torch.device, pad_id: int = 0, end_ids: tuple[int, ...] = (),
                vocab: int | None = None) -> list[TaskScores]:
    """Every task's metrics (every rank calls this together and gets the same numbers). `vocab`: the tokenizer's
    size, the ids greedy decoding may choose (a model's embedding is often padded beyond it)."""
    return [_score(p, logits_fn, tokenizer, share, batch_size, device, pad_id, end_ids, vocab) for p in prepared]


def _score(prepared: PreparedTask, logits_fn: LogitsFn, tokenizer: Tokenizer, share: Share, batch_size: int,
           device: torch.device, pad_id: int, end_ids: tuple[int, ...], vocab: int | None) -> TaskScores:
    from downstream.scoring import greedy_continuations, loglikelihoods

    task = prepared.task
    per_example: list[dict[str, Any]] = []
    if task.kind == "qa":
        def finished(ids: list[int]) -> bool:  # called per token: one decode
            if ids[-1] in end_ids:
                return True
            text = tokenizer.decode(ids)
            return any(stop and stop in text for stop in task.stop)
        contexts = [request.context for request in prepared.generate]
        outputs = greedy_continuations(logits_fn, contexts, task.max_new_tokens, finished, share, batch_size,
                                       device, pad_id, prepared.max_len, vocab)
        for example, ids in zip(task.examples, outputs):
            raw = tokenizer.decode([i for i in ids if i not in end_ids])
            text = cut_at_stop(raw, task.stop).strip()
            per_example.append({"prediction": text, "answer": example.answer, "generated": raw,
                                "exact_match": exact_match(text, example.answer),
                                "char_f1": char_f1(text, example.answer)})
    else:
        flat = [(r.context, r.continuation) for requests in prepared.loglik for r in requests]
        scores = iter(loglikelihoods(logits_fn, flat, share, batch_size, device, pad_id, prepared.max_len, vocab))
        for example, requests in zip(task.examples, prepared.loglik):
            results = [next(scores) for _ in requests]
            logliks = [loglik for loglik, _ in results]
            if task.kind == "multiple_choice":
                row = {"logliks": logliks, "gold": example.gold, **choice_scores(logliks, example.choices, example.gold)}
            else:
                row = {"loglik": logliks[0], "exact_match": float(results[0][1]), "target": example.answer}
            per_example.append(row)
    columns = {name: [row[name] for row in per_example] for name in task.metrics}
    return TaskScores(task.name, task.kind, {name: mean(values) for name, values in columns.items()}, per_example,
                      {name: mean_stderr(values) for name, values in columns.items()})


def flat_metrics(scores: list[TaskScores]) -> dict[str, float]:
    """`eval/<task>/<metric>` for the metrics log."""
    return {f"eval/{s.name}/{metric}": value for s in scores for metric, value in s.metrics.items()}
