"""The curve `ayumi eval RUN_DIR --all` wrote (RUN_DIR/eval/downstream.json): every checkpoint's downstream scores,
read back so the report shows them beside the scores the run logged in the loop.

The file holds one entry per checkpoint: its step and each task's metrics with their standard error and n, or why
the checkpoint was left out (damaged). The report draws against tokens, so each checkpoint takes the tokens the run
had trained at its step (the continued timeline of metrics.jsonl). A file that cannot be read is said in the
summary, never a failed report: the report is made from what the run wrote, whatever state it is in.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pretrain.metrics import EVAL_CURVE_FILE
from pretrain.tools.report.plots import (PlotContext, draw_alarm_lines, draw_stages, finish_axis, finish_figure,
                                         fit_to_kept, new_figure, plot_series)
from pretrain.tools.report.timeline import Series, Timeline, is_train_record


@dataclass
class Score:
    """One metric of one task at one checkpoint."""
    value: float
    stderr: float | None
    """None when lm-eval's standard error is undefined (fewer than two examples)."""
    n: int


@dataclass
class CurvePoint:
    """One checkpoint of the curve: its scores, or why it was left out."""
    label: str
    step: int
    tokens: float
    scores: dict[str, dict[str, Score]] = field(default_factory=dict)
    """task -> metric -> score; empty for a checkpoint left out."""
    error: str | None = None
    damaged: bool = False


@dataclass
class EvalCurve:
    """RUN_DIR/eval/downstream.json as the report uses it."""
    path: Path
    points: list[CurvePoint]
    problem: str | None = None
    """Why the file could not be read (then there are no points)."""

    def metrics(self) -> dict[str, list[str]]:
        """Each task's metrics over every scored checkpoint (tasks and metrics in the file's order)."""
        found: dict[str, list[str]] = {}
        for point in self.points:
            for task, scores in point.scores.items():
                found.setdefault(task, [])
                found[task] += [metric for metric in scores if metric not in found[task]]
        return found

    def scored(self, task: str, metric: str) -> list[tuple[CurvePoint, Score]]:
        """The checkpoints that have a finite score for `task`'s `metric`, in step order."""
        pairs = [(point, point.scores.get(task, {}).get(metric)) for point in self.points]
        return [(point, score) for point, score in pairs if score is not None and math.isfinite(score.value)]


def read_eval_curve(run_dir: Path, timeline: Timeline) -> EvalCurve | None:
    """The run's curve, None when `ayumi eval --all` has not written one."""
    path = run_dir / EVAL_CURVE_FILE
    if not path.is_file():
        return None
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))["scores"]
        tokens = tokens_at_step(timeline)
        points = [curve_point(entry, tokens) for entry in entries]
    except (OSError, ValueError, KeyError, TypeError) as err:  # a hand-edited or cut file: say so, go on
        return EvalCurve(path, [], problem=f"{type(err).__name__}: {err}")
    return EvalCurve(path, sorted(points, key=lambda point: point.step))


def curve_point(entry: dict[str, Any], tokens_at) -> CurvePoint:
    """One entry of the file's `scores` (see pretrain/tools/eval.py as_json)."""
    step = int(entry["step"])
    point = CurvePoint(str(entry.get("label", f"step {step}")), step, tokens_at(step), error=entry.get("error"),
                       damaged=bool(entry.get("damaged")))
    for task, body in (entry.get("tasks") or {}).items():
        stderr = body.get("stderr") or {}
        point.scores[task] = {metric: Score(float(value), _number(stderr.get(metric)), int(body.get("n", 0)))
                              for metric, value in body["metrics"].items()}
    return point


def _number(value: Any) -> float | None:
    """A standard error as written (null when undefined) as a float, or None."""
    return None if value is None or not math.isfinite(float(value)) else float(value)


def tokens_at_step(timeline: Timeline):
    """step -> tokens trained at that step, from the continued timeline's train records (step 0 is 0 tokens; a
    step between two logged ones is interpolated, one past the last logged takes the last tokens)."""
    kept = sorted({record.step: record.tokens for record in timeline.records
                   if not record.abandoned and is_train_record(record.values)}.items())
    steps = np.array([0.0] + [float(step) for step, _ in kept])
    tokens = np.array([0.0] + [tokens for _, tokens in kept])
    return lambda step: float(np.interp(float(step), steps, tokens))


def newer_checkpoints(run_dir: Path, curve: EvalCurve) -> list[str]:
    """The run's checkpoint folders newer than the curve's last checkpoint: saved after `ayumi eval --all` ran."""
    last = max((point.step for point in curve.points), default=-1)
    found = []
    for folder in sorted((run_dir / "checkpoints").glob("step_*")):
        match = re.fullmatch(r"step_(\d+)", folder.name)
        if match and folder.is_dir() and int(match.group(1)) > last:
            found.append(folder.name)
    return found


# -- the plot ---------------------------------------------------------------------------------------
def eval_curve_plot_name(task: str) -> str:
    """The PNG of one task's curve: `eval_curve_<task>.png` (file-safe), beside the in-loop `downstream_<task>.png`."""
    return f"eval_curve_{re.sub(r'[^A-Za-z0-9_.-]+', '_', task)}.png"


def plot_eval_curve(curve: EvalCurve, timeline: Timeline, ctx: PlotContext, task: str, metrics: list[str],
                    path: Path) -> None:
    """One panel per metric of `task`: each checkpoint's score with its standard error as a bar, and the in-loop
    scores of the same metric (when the run logged any) faint behind, so the two can be compared at a glance."""
    fig, axes = new_figure(len(metrics), [2.8] * len(metrics))
    for ax, metric in zip(axes, metrics):
        scored = curve.scored(task, metric)
        x = np.array([point.tokens for point, _ in scored])
        y = np.array([score.value for _, score in scored])
        err = np.array([score.stderr if score.stderr is not None else 0.0 for _, score in scored])
        ax.errorbar(x, y, yerr=err, color="tab:orange", marker="o", markersize=4, linewidth=1.5, capsize=3,
                    label="checkpoints (ayumi eval --all), ± stderr", zorder=3)
        in_loop = timeline.series(f"eval/{task}/{metric}")
        if len(in_loop.x):
            plot_series(ax, in_loop, "in the loop (eval.downstream)", "tab:green", 1)
        # The y range holds every bar whole: a bar cut by the axis would understate the uncertainty.
        band = Series(metric, np.concatenate([x, x]), np.concatenate([y - err, y + err]), np.concatenate([x, x]), [])
        fit_to_kept(ax, [band, *([in_loop] if len(in_loop.x) else [])], log=False)
        note = f" (last {y[-1]:.4g} at step {scored[-1][0].step:,})" if len(y) else " (no checkpoint scored)"
        finish_axis(ax, f"{task}: {metric} per checkpoint{note}", metric)
    for index, ax in enumerate(axes):
        draw_stages(ax, ctx.stages, label=index == 0)
        draw_alarm_lines(ax, ctx.events)
    finish_figure(fig, axes, ctx, path)
