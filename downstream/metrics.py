"""Downstream metrics: from per-example scores to a task's numbers.

Answers are compared after NFKC normalisation and stripping (full-width and half-width forms are the same
answer, as llm-jp-eval treats them). Character F1 is the F1 of the two answers' characters as multisets,
JSQuAD's character-level score.
"""
from __future__ import annotations

import math
import unicodedata
from collections import Counter
from typing import Sequence


def normalize(text: str) -> str:
    """NFKC, surrounding whitespace removed."""
    return unicodedata.normalize("NFKC", text).strip()


def exact_match(prediction: str, answer: str) -> float:
    return float(normalize(prediction) == normalize(answer))


def char_f1(prediction: str, answer: str) -> float:
    """F1 over characters (as multisets) of the normalised strings; 1.0 when both are empty."""
    pred, gold = normalize(prediction), normalize(answer)
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def choice_scores(logliks: Sequence[float], choices: Sequence[str], gold: int) -> dict[str, float]:
    """acc: the most likely choice is gold; acc_norm: the same with each log-likelihood divided by the choice's
    length in characters (lm-eval's acc_norm). Ties go to the first choice, as numpy's argmax."""
    best = max(range(len(logliks)), key=lambda i: (logliks[i], -i))
    normed = [ll / len(choice) for ll, choice in zip(logliks, choices)]
    best_norm = max(range(len(normed)), key=lambda i: (normed[i], -i))
    return {"acc": float(best == gold), "acc_norm": float(best_norm == gold)}


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before the first stop string (all of it when none occurs)."""
    ends = [text.find(stop) for stop in stops if stop and stop in text]
    return text[:min(ends)] if ends else text


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def mean_stderr(values: Sequence[float]) -> float:
    """The standard error of the mean, as lm-evaluation-harness computes it for every metric it averages (its
    `mean_stderr`): the sample standard deviation (n - 1 in the denominator) over sqrt(n). For 0/1 scores (acc,
    exact_match) that is sqrt(p (1 - p) / (n - 1)). NaN below two values, where lm-eval prints N/A."""
    n = len(values)
    if n < 2:
        return float("nan")
    center = mean(values)
    return math.sqrt(sum((v - center) ** 2 for v in values) / (n - 1)) / math.sqrt(n)
