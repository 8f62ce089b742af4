"""Prompts and the token requests they become.

A prompt is the task's instruction, then `num_fewshot` solved examples, then the example's context, joined by
`fewshot_separator`; each solved example is its context, the delimiter and its answer. The few-shot examples
are one seeded draw from the train split per task, so every example, step and rank count sees the same ones.

A continuation (a choice, a cloze target) is tokenized the way lm-evaluation-harness does it: trailing
whitespace of the context moves to the continuation, the whole text is encoded, and the continuation's
tokens are those after the context's own encoding. So a word's first piece is the one the model would
produce, and the log-likelihoods are lm-eval's on the same model (tests/downstream/test_lm_eval_parity.py).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol, Sequence

from downstream.tasks import Example, Task, TaskError


class Tokenizer(Protocol):
    """What scoring needs of a tokenizer (tokenizer.declared.DeclaredTokenizer is one)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class LoglikRequest:
    """Score `continuation` after `context` (token ids, the prefix token included in context)."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


@dataclass(frozen=True)
class GenerateRequest:
    """Greedily continue `context` (the prefix token included) for at most the task's max_new_tokens."""

    context: tuple[int, ...]


def fewshot_examples(task: Task, seed: int) -> list[Example]:
    """The task's few-shot examples: one draw of num_fewshot from its train split, seeded by seed and name."""
    if task.num_fewshot == 0:
        return []
    return random.Random(f"{seed}:{task.name}").sample(task.pool, task.num_fewshot)


def prompt(task: Task, example: Example, shots: list[Example]) -> str:
    """The text before the answer (without the delimiter: that starts the continuation)."""
    parts = [task.instruction] if task.instruction else []
    parts += [shot.context + task.delimiter + shot.solved() for shot in shots]
    parts.append(example.context)
    return task.fewshot_separator.join(parts)


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids), split as lm-evaluation-harness splits them (see the module docstring)."""
    stripped = context.rstrip()
    if stripped != context:
        continuation = context[len(stripped):] + continuation
        context = stripped
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def loglik_requests(task: Task, example: Example, shots: list[Example], tokenizer: Tokenizer,
                    prefix: list[int], max_len: int) -> list[LoglikRequest]:
    """One request per choice (multiple_choice) or one for the target (cloze)."""
    text = prompt(task, example, shots)
    answers = example.choices if task.kind == "multiple_choice" else (example.answer,)
    requests = []
    for answer in answers:
        context, continuation = encode_pair(tokenizer, text, task.delimiter + answer)
        context = prefix + context
        if not context:
            raise TaskError(f"{example.where}: context: empty with prefix=none: give a context or use prefix=eos")
        if not continuation:
            raise TaskError(f"{example.where}: {'choices' if example.choices else 'target'}: {answer!r} encodes to "
                            "no tokens of its own after the context")
        _check_length(example, len(context) + len(continuation) - 1, max_len, task)
        requests.append(LoglikRequest(tuple(context), tuple(continuation)))
    return requests


def generate_request(task: Task, example: Example, shots: list[Example], tokenizer: Tokenizer,
                     prefix: list[int], max_len: int) -> GenerateRequest:
    """The qa prompt as ids, checked to leave room for max_new_tokens."""
    context = prefix + tokenizer.encode(prompt(task, example, shots) + task.delimiter)
    if not context:
        raise TaskError(f"{example.where}: input: empty with prefix=none: give a question or use prefix=eos")
    _check_length(example, len(context) + task.max_new_tokens - 1, max_len, task)
    return GenerateRequest(tuple(context))


def _check_length(example: Example, needed: int, max_len: int, task: Task) -> None:
    if needed > max_len:
        field = "input" if ": samples[" in example.where else "context"
        raise TaskError(f"{example.where}: {field}: needs {needed} positions ({task.num_fewshot} few-shot examples "
                        f"and {task.max_new_tokens if task.kind == 'qa' else 0} generated tokens included) but the "
                        f"model reads {max_len}: shorten it, or lower num_fewshot or max_new_tokens")
